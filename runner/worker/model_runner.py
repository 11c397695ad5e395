"""Runs one scheduled step on the model: inputs, forward over the paged KV cache, logits, sampling.

The model is an unmodified Hugging Face causal LM loaded with `attn_implementation="bridge_paged"`
(see `runner.layers.hf_attention`). A step's batch is packed as one sequence `(1, T)`: `position_ids`
restart per request and the attention metadata says which rows belong together.

Host work per step is a few vectorised numpy operations over host-side tables (token ids and block
table per slot), written into two pinned staging buffers (one int64, one int32) and moved to the
device with two non-blocking copies. Every per-step device tensor is a view at a fixed offset of
two device buffers, so a decode step can replay a CUDA graph captured on the same addresses.
The only host sync per step reads the sampled tokens.

Only rows that need a token go through the LM head (the last scheduled row of each request whose
prefill completes or which decodes), plus prompt rows of requests that asked for prompt logprobs;
full-sequence logits are never formed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from runner.config import EngineConfig, auto_mixed_graph_max_tokens
from runner.hf_config import text_config
from runner.layers.attention_metadata import AttentionMetadata, ForwardContext, set_forward_context
from runner.layers.batch_invariant import batch_invariant_ops
from runner.layers.hf_attention import ATTN_IMPLEMENTATION, register_bridge_attention
from runner.layers.logits_head import wrap_lm_head
from runner.layers.sampler import Sampler
from runner.multimodal.state import MultimodalState
from runner.request import Request
from runner.step_io import SchedulerOutput, StepResult, StepTokenMask
from runner.worker.cuda_graphs import DecodeGraphs, GraphBuckets
from runner.worker.decode_window import (
    LaunchedWindow,
    finish_decode_window,
    launch_decode_window,
    run_decode_window,
)
from runner.worker.host_upload import HostUploader
from runner.worker.inputs_embeds import InputsEmbedsBuilder
from runner.worker.kernel_builds_ahead import build_startup_kernels
from runner.worker.kernels import install_kernels
from runner.worker.kv_cache import KVCacheSpec, allocate_kv_caches, determine_num_blocks
from runner.worker.memory_profile import profile_peak_memory
from runner.worker.pending_tokens import PendingTokenFeed
from runner.worker.progress_bars import hf_progress_bars_off
from runner.worker.prompt_embeds import PromptEmbedsState
from runner.worker.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_rows
from runner.worker.staging import StagedStep, StagingBuffers
from runner.worker.startup_phases import StartupPhases
from runner.worker.step_graphs import capture_step_graphs
from runner.worker.step_sampling import LaunchedStep, new_step, sample_on_device, sampled_result

logger = logging.getLogger(__name__)

# Extra room reserved on the GPU beyond the profiled peak: CUDA graphs, allocator slack.
GPU_HEADROOM_BYTES = 1 << 30
# Composite checkpoints with no causal-LM class in transformers 5: load the full model and run its
# text model + LM head (the vision tower is the encoders' business, not the runner's).
_IMAGE_TEXT_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


class ModelRunner:
    """Owns the model, the KV cache, the per-slot host tables and the CUDA graphs."""

    def __init__(self, config: EngineConfig, hf_config: Any, *, eos_token_ids: tuple[int, ...] = (),
                 mm: MultimodalState | None = None, setup: bool = True) -> None:
        """Load the model and build the per-step state; with `setup` (the default) also profile,
        size and allocate the KV cache and capture the decode graphs (`setup`)."""
        register_bridge_attention()
        self.engine_config = config
        self.device = device = config.device
        self.dtype = dtype = config.dtype
        self.config = hf_config
        self.max_num_seqs = max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_size = config.block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.batch_invariant = config.batch_invariant  # fixed reduction orders: runner.layers.batch_invariant

        # Seconds and Triton builds of each start-up phase (load, profile, KV cache, graph captures).
        self._startup = StartupPhases(device)
        self.startup_phases = self._startup.phases
        model_cls = (AutoModelForImageTextToText if getattr(hf_config, "model_type", None)
                     in _IMAGE_TEXT_MODEL_TYPES else AutoModelForCausalLM)
        with self.startup_phase("load"), hf_progress_bars_off():  # a library call prints no bars
            model = model_cls.from_pretrained(
                config.model, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
            )
            self.model = model.to(device).eval().requires_grad_(False)
            self.kernels = install_kernels(self.model, config)
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = wrap_lm_head(model.get_output_embeddings(), hf_config)  # + final logit scaling/capping
        self.hidden_size = text_config(hf_config).hidden_size
        # Largest step replayed from a mixed-step graph: as configured, else from the decoder's size.
        decoder_params = sum(p.numel() for p in self.decoder.parameters()) - self.embed_tokens.weight.numel()
        self.mixed_graph_max_tokens = min(
            config.mixed_graph_max_tokens if config.mixed_graph_max_tokens is not None
            else auto_mixed_graph_max_tokens(decoder_params), config.max_num_batched_tokens)
        self.vocab_size = self.embed_tokens.weight.shape[0]
        self.kv_spec = KVCacheSpec.from_config(hf_config, dtype, config.block_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = 0

        self.set_max_model_len(config.max_model_len)
        self.embeds_builder = InputsEmbedsBuilder(config.max_num_batched_tokens, self.hidden_size, dtype,
                                                  device)
        # Host tensors (prompt embeds, passthrough items) reach the device through one uploader.
        self.uploader = HostUploader(device)
        # Threads that build start-up's Triton kernels side by side (`runner.layers.triton_launch`);
        # 0 or 1: each is built when a launch first meets it.
        self.kernel_build_threads = config.kernel_build_threads
        self.kernels_built_ahead = False  # set by `setup` when that pass ran
        self.prompt_embeds_state = (PromptEmbedsState(max_num_seqs, self.hidden_size, dtype, device,
                                                      uploader=self.uploader)
                                    if config.enable_prompt_embeds else None)
        # Encoders, encoder cache, M-RoPE positions (runner.multimodal.state).
        self.mm = mm
        self.sampler = Sampler(batch_invariant=config.batch_invariant)
        self.decode_graphs = DecodeGraphs()
        self.mixed_graphs = GraphBuckets()  # prefill / mixed steps by token count (cuda_graphs.py)
        self.num_graph_replays = 0
        self.num_mixed_graph_replays = 0
        self.activation_peak_bytes = self.cuda_graph_pool_bytes = 0  # measured by setup()
        self.num_decode_windows = 0
        self.num_forward_steps = 0
        # Async scheduling: input ids copied on the device from the step in flight.
        self.token_feed = PendingTokenFeed(max_num_seqs, device)
        if setup:
            self.setup()

    # ----------------------------------------------------------------------------- kernels (read-only)
    @property
    def num_fused_norms(self) -> int:
        return self.kernels.num_fused_norms

    @property
    def fused_rotary(self) -> bool:
        return self.kernels.fused_rotary

    @property
    def num_fused_linears(self) -> tuple[int, int]:
        return self.kernels.num_fused_linears

    @property
    def num_fused_layers(self) -> int:
        return self.kernels.num_fused_layers

    @property
    def num_grouped_moe(self) -> int:
        return self.kernels.num_grouped_moe

    @property
    def num_fed_tokens(self) -> int:
        """Pending tokens async scheduling copied on the device (`runner.worker.pending_tokens`)."""
        return self.token_feed.num_fed_tokens

    @property
    def graphs(self) -> dict:
        """Captured decode graphs by batch-size bucket (empty: every step runs eagerly)."""
        return self.decode_graphs.graphs

    def mixed_graph_rows(self, tokens: int) -> int:
        """Request rows (and LM-head rows) of the mixed-step graph of `tokens` tokens."""
        return min(tokens, self.max_num_seqs)

    # ----------------------------------------------------------------------------- setup
    def startup_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """`with runner.startup_phase(name):` records the block's seconds and Triton builds in
        `startup_phases` (`runner.worker.startup_phases`)."""
        return self._startup.record(name)

    def set_max_model_len(self, max_model_len: int) -> None:
        """(Re)size the per-slot host tables and staging buffers for sequences up to `max_model_len`."""
        self.max_model_len = max_model_len
        self.max_blocks_per_req = -(-max_model_len // self.block_size)
        # +1: a request whose prompt fills the context still records its one sampled token.
        self.token_table = np.zeros((self.max_num_seqs, max_model_len + 1), dtype=np.int64)
        self.block_table = np.zeros((self.max_num_seqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks_known = np.zeros(self.max_num_seqs, dtype=np.int64)
        self.num_computed_by_slot = np.zeros(self.max_num_seqs, dtype=np.int32)
        self.staging = StagingBuffers(self.max_num_batched_tokens, self.max_num_seqs,
                                     self.max_blocks_per_req, self.device)

    def profile_peak_memory(self, *, force: bool = False) -> int:
        """Activation peak of the largest step in bytes (`runner.worker.memory_profile`)."""
        return profile_peak_memory(self, force=force)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        self.num_kv_blocks = num_blocks

    def setup(self) -> None:
        """Profile -> size the KV cache -> allocate it -> capture the decode graphs.

        On the GPU without an explicit budget, the KV cache takes what `gpu_memory_utilization`
        leaves after the weights, the profiled activation peak and a fixed headroom. When the cache
        cannot hold `max_model_len` tokens, the context is lowered to what it holds (a warning).
        """
        c = self.engine_config
        on_gpu = self.device.type == "cuda"
        if on_gpu:  # engines dropped without shutdown() may sit in reference cycles: free them first
            gc.collect()
        if on_gpu and self.kernel_build_threads > 1:
            with self.startup_phase("kernel_builds"):
                self.kernels_built_ahead = build_startup_kernels(self, graphs=c.use_cuda_graphs)
        with self.startup_phase("profile"):
            peak = self.activation_peak_bytes = (self.profile_peak_memory()
                                                 if on_gpu and c.kv_cache_memory is None else 0)
        # The mixed-step graphs' pool holds the activations of their largest step beside the eager
        # path's: estimated as the profiled peak's share for that many tokens (an overestimate: the
        # peak includes the sampler's worst case, which no graph holds).
        graph_peak = (peak * self.mixed_graph_max_tokens // self.max_num_batched_tokens
                      if c.use_cuda_graphs else 0)
        num_blocks = determine_num_blocks(
            self.kv_spec, self.device, num_kv_blocks=c.num_kv_blocks, kv_cache_memory=c.kv_cache_memory,
            gpu_memory_utilization=c.gpu_memory_utilization,
            peak_activation_bytes=peak + graph_peak + (GPU_HEADROOM_BYTES if on_gpu else 0),
        )
        if num_blocks * self.block_size < self.max_model_len:
            logger.warning("KV cache holds %d tokens; max_model_len lowered from %d",
                           num_blocks * self.block_size, self.max_model_len)
            self.set_max_model_len(num_blocks * self.block_size)
        with self.startup_phase("kv_cache"):
            self.allocate_kv_cache(num_blocks)
        if c.use_cuda_graphs:
            before = torch.cuda.memory_reserved(self.device)
            self.capture_cuda_graphs()
            self.cuda_graph_pool_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("start-up: %s", self._startup.summary())

    def release(self) -> None:
        """Drop everything this runner holds on the device: graphs, KV cache, buffers, the model."""
        self.mixed_graphs.release()
        self.decode_graphs.release()
        self.kv_caches = []
        self.num_kv_blocks = 0
        self.prompt_embeds_state = None
        self.embeds_builder = None
        self.staging = None
        self.uploader = None
        self.token_feed.release()
        self.model = self.decoder = self.embed_tokens = self.lm_head = None

    # ----------------------------------------------------------------------------- slots
    def add_request(self, request: Request) -> None:
        """A request got a slot: write its known tokens and upload its prompt embeddings."""
        slot = request.slot
        n = request.num_tokens
        self.token_table[slot, : request.num_prompt_tokens] = request.prompt_token_ids
        if request.output_token_ids:
            self.token_table[slot, request.num_prompt_tokens : n] = request.output_token_ids
        self.num_blocks_known[slot] = 0
        if request.prompt_embeds is not None:
            # A device tensor here is the engine's own copy (PromptProcessor kept its upload).
            self.prompt_embeds_state.add_request(slot, request.request_id, request.prompt_embeds,
                                                 request.is_token_ids,
                                                 owned=request.prompt_embeds.device.type != "cpu")
        if self.mm is not None:
            self.mm.add_request(request)

    def remove_request(self, request: Request) -> None:
        """Called before the slot goes back to the free list: its model state must be gone first.
        Safe after a failed `add_request` too (removal is by id and ignores what is not there)."""
        if request.prompt_embeds is not None:
            self.prompt_embeds_state.remove_request(request.request_id)
        if self.mm is not None:
            self.mm.remove_request(request)
        self.num_blocks_known[request.slot] = 0

    # ----------------------------------------------------------------------------- forward
    @property
    def head_dtype(self) -> torch.dtype:
        """The dtype the LM head computes its logits in (the decode graphs' `head_logits`)."""
        return self.lm_head.weight.dtype

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor | None, *, to_float: bool = True,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder + LM head; fp32 logits, or the head's dtype (`to_float=False`), or written into
        `logits_out` (a plain bias-free head writes there directly, with no temporary)."""
        # positions: (T,) or, on M-RoPE models, (3, T) -> position_ids (3, 1, T).
        with batch_invariant_ops(self.batch_invariant):
            with set_forward_context(ForwardContext(meta, self.kv_caches, self.batch_invariant)):
                hidden = self.decoder(
                    inputs_embeds=embeds.unsqueeze(0), position_ids=positions.unsqueeze(-2), use_cache=False
                ).last_hidden_state[0]
            if logits_indices is not None:
                hidden = hidden.index_select(0, logits_indices)
            head = self.lm_head
            if logits_out is not None:
                if (type(head) is torch.nn.Linear and head.bias is None and hidden.dtype == logits_out.dtype
                        and head.weight.dtype == logits_out.dtype):
                    return torch.mm(hidden, head.weight.t(), out=logits_out)
                return logits_out.copy_(head(hidden))
            logits = head(hidden)
            return logits.float() if to_float else logits

    def can_replay(self, num_reqs: int) -> bool:
        """Whether a decode step of `num_reqs` requests has a captured graph bucket."""
        return self.decode_graphs.bucket(num_reqs) is not None

    def stage(self, so: SchedulerOutput) -> StagedStep:
        """Write the step's inputs into the pinned staging buffers and start their upload."""
        reqs = so.requests
        r = len(reqs)
        t = so.total_num_tokens
        bs = self.block_size
        st = self.staging
        st.next_host()

        # Host tables: new blocks of each request.
        for req in reqs:
            s, known, nb = req.slot, self.num_blocks_known[req.slot], len(req.block_ids)
            if nb > known:
                self.block_table[s, known:nb] = req.block_ids[known:]
                self.num_blocks_known[s] = nb

        nsched = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
        slots = np.fromiter((q.slot for q in reqs), dtype=np.int64, count=r)
        nc = np.fromiter((q.num_computed_tokens for q in reqs), dtype=np.int64, count=r)
        cu = np.cumsum(nsched)
        seq_lens = nc + nsched
        single_token = so.is_single_token
        if single_token:
            positions, tok_slots = nc, slots
        else:
            req_of_tok = np.repeat(np.arange(r), nsched)
            positions = np.arange(t) - (cu - nsched)[req_of_tok] + nc[req_of_tok]
            tok_slots = slots[req_of_tok]

        # Rows whose logits are needed: sampled rows first, then prompt-logprob rows.
        sample_rows = [int(cu[i]) - 1 for i in range(r) if so.samples[i]]
        plp_rows, plp_spans = prompt_logprob_rows(so, nc, cu - nsched)
        logit_rows = sample_rows + plp_rows

        # M-RoPE prefill rows need their 3-D prompt positions: never a graph (it feeds 1-D ones).
        decode_only = so.is_decode_only
        mrope = self.mm is not None and self.mm.uses_mrope
        graphable = single_token and not plp_rows and (decode_only or not mrope)
        bucket = self.decode_graphs.bucket(r) if graphable else None
        # Any other step without prompt-logprob rows or 3-D positions replays a mixed-step graph
        # when one holds its tokens.
        mixed = self.mixed_graphs.bucket(t) if bucket is None and not plp_rows and not mrope else None
        if bucket:
            tp, rp, w, n_logits = bucket, bucket, self.max_blocks_per_req, 0
        elif mixed:
            tp, w = mixed, self.max_blocks_per_req
            rp = n_logits = self.mixed_graph_rows(mixed)
        else:
            tp, rp, w, n_logits = t, r, max(1, int(-(-seq_lens.max() // bs))), len(logit_rows)
        o64, o32 = st.offsets(tp, rp, w, n_logits)
        h64, h32 = st.np64, st.np32
        h64[o64[0] : o64[0] + t] = self.token_table[tok_slots, positions]
        h64[o64[1] : o64[1] + t] = positions
        h64[o64[2] : o64[2] + t] = self.block_table[tok_slots, positions // bs] * bs + positions % bs
        if n_logits:
            h64[o64[3] : o64[3] + len(logit_rows)] = logit_rows
        self.num_computed_by_slot[slots] = nc
        h32[o32[0] : o32[0] + len(self.num_computed_by_slot)] = self.num_computed_by_slot
        h32[o32[1]] = 0
        h32[o32[1] + 1 : o32[1] + 1 + r] = cu
        h32[o32[2] : o32[2] + r] = seq_lens
        h32[o32[3] : o32[3] + r] = slots
        h32[o32[4] : o32[4] + r * w] = self.block_table[slots, :w].reshape(-1)
        if bucket or mixed:  # a graph's padding: tokens with no KV write and no context, requests
            h64[o64[0] + t : o64[0] + tp] = 0  # with one query row each (decode) or none (mixed)
            h64[o64[1] + t : o64[1] + tp] = 0
            h64[o64[2] + t : o64[2] + tp] = -1
            h64[o64[3] + len(logit_rows) : o64[3] + n_logits] = 0
            h32[o32[1] + 1 + r : o32[1] + 1 + rp] = t if mixed else np.arange(t + 1, bucket + 1)
            h32[o32[2] + r : o32[2] + rp] = 0
            h32[o32[3] + r : o32[3] + rp] = 0
            h32[o32[4] + r * w : o32[4] + rp * w] = 0
        st.upload(tp, rp, w, n_logits)
        v = st.views(st.dev64, st.dev32, tp, rp, w, n_logits)
        return StagedStep(v, t, r, bucket, nsched, cu, seq_lens, single_token, decode_only, sample_rows,
                          plp_rows, plp_spans, mixed=mixed)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, token_mask: StepTokenMask | None = None) -> StepResult:
        return self.finish(self.launch(so, token_mask=token_mask))  # one step; one host sync reads it

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: LaunchedStep | None = None, *,
               token_mask: StepTokenMask | None = None, defer_sampling: bool = False,
               before_reading_prev: Callable[[], None] | None = None) -> LaunchedStep:
        """Enqueue one step's forward and sampling on the device without waiting for them.

        `prev` is the step still in flight (async scheduling): a request whose last token is one
        `prev` sampled (`num_pending_outputs`) gets that token's id copied on the device from
        `prev`'s sampled ids into this step's input ids. The sampled ids (and logprobs) start
        their copy to the host; `finish` waits for it. `token_mask`: the constrained rows' masks;
        `defer_sampling`: the forward only (`step_sampling.sample_deferred`). `before_reading_prev` runs
        once the inputs are staged, before anything that reads `prev`'s sampled ids is enqueued (a
        deferred `prev` samples there, so its token masks had the staging's time to fill)."""
        sd = self.stage(so)
        v, t, r, bucket, sample_rows = sd.views, sd.t, sd.r, sd.bucket, sd.sample_rows
        if before_reading_prev is not None:
            before_reading_prev()
        self.token_feed.feed(so, sd, prev)
        positions = v.positions
        items = self.mm.gather_step(so.requests, so.num_scheduled_tokens) if self.mm is not None else None
        embeds = self.embeds_builder.build(self.embed_tokens, v.input_ids)
        if items is not None:  # item rows (media, passthrough) over the token rows, gathered on the device
            items.apply(embeds[:t], v.idx_mapping[:r], v.query_start_loc[: r + 1], v.num_computed_by_slot)
        if self.mm is not None and self.mm.uses_mrope:
            if sd.decode_only:  # decode position = index + delta in all three rows
                deltas = self.mm.decode_deltas(so.requests)
                if deltas is not None:
                    v.positions[:r] += deltas
            else:
                positions = self.mm.step_positions(so.requests, so.num_scheduled_tokens)
        pe = self.prompt_embeds_state
        if pe is not None and pe.num_requests_with_embeds:
            pe.apply(embeds[:t], v.idx_mapping[:r], v.query_start_loc[: r + 1], v.num_computed_by_slot)
        if bucket:
            self.decode_graphs.graphs[bucket].replay()
            self.num_graph_replays += 1
            head_logits = self.decode_graphs.head_logits[:r]  # the sampler works in fp32
            if len(sample_rows) != r:  # cast only the rows that sample
                keep = torch.tensor([i for i in range(r) if so.samples[i]]).to(self.device, non_blocking=True)
                logits = head_logits.index_select(0, keep).float()
            else:
                logits = self.decode_graphs.logits[:r]
                logits.copy_(head_logits)
        elif sd.mixed:
            self.mixed_graphs.graphs[sd.mixed].replay()
            self.num_mixed_graph_replays += 1
            logits = self.decode_graphs.logits[: len(sample_rows)]  # the sampled rows come first
        else:
            meta = AttentionMetadata(
                v.slot_mapping, v.query_start_loc, v.seq_lens, v.block_tables,
                max_query_len=int(sd.nsched.max()), max_seq_len=int(sd.seq_lens.max()), num_reqs=r,
                is_decode_only=sd.single_token,
                fresh_prefill=bool(((sd.seq_lens == sd.nsched) | (sd.nsched <= 1)).all()),
                query_start_loc_cpu=[0, *sd.cu.tolist()], seq_lens_cpu=sd.seq_lens.tolist(),
            )
            logits = self.forward(embeds, positions, meta, v.logits_indices)
        self.num_forward_steps += 1

        step = new_step(so, logits[: len(sample_rows)] if defer_sampling else None)
        if not defer_sampling:
            sample_on_device(self.sampler, step, logits[: len(sample_rows)], self.eos_token_ids, token_mask)
        if sd.plp_rows:  # read in `finish` (never a graph step, so these logits are not overwritten)
            step.plp_logits, step.plp_spans = logits[len(sample_rows) :], sd.plp_spans
        return step

    @torch.inference_mode()
    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's sampled tokens (the one host sync) and return them.

        Each sampled token also goes into the token table at the request's next position,
        except for requests that finished meanwhile (async scheduling: their slot may be gone).
        """
        so = step.so
        result = sampled_result(step)
        if step.plp_spans:
            with batch_invariant_ops(self.batch_invariant):
                result.prompt_logprobs = compute_prompt_logprobs(so, step.plp_logits, step.plp_spans)
        for i, req in enumerate(so.requests):
            token = result.sampled_token_ids[i]
            if token is None or req.is_finished:
                continue
            pos = req.num_prompt_tokens + req.num_output_tokens  # the oldest pending token's position
            if pos <= self.max_model_len:
                self.token_table[req.slot, pos] = token
        return result

    def execute_decode_window(self, so: SchedulerOutput, k: int) -> list[list[int]]:
        """Run `k` greedy decode steps back to back on the device (`runner.worker.decode_window`);
        the `k` tokens of each request."""
        return run_decode_window(self, so, k)

    def launch_decode_window(self, so: SchedulerOutput, k: int,
                             prev: LaunchedWindow | LaunchedStep | None = None) -> LaunchedWindow:
        """Queue a decode window without waiting for it; `prev` is the window or step still in flight,
        whose last tokens are this one's first inputs (`runner.worker.decode_window.launch_decode_window`)."""
        return launch_decode_window(self, so, k, prev)

    def finish_decode_window(self, window: LaunchedWindow) -> list[list[int]]:
        """Wait for a launched window's tokens; the `k` tokens of each request."""
        return finish_decode_window(self, window)

    # ----------------------------------------------------------------------------- CUDA graphs
    def capture_cuda_graphs(self, *, emulate: bool = False) -> None:
        """Capture the mixed-step graphs, then the decode graphs (`runner.worker.step_graphs`); on the
        CPU only with `emulate=True` (tests), where "replay" runs the same body eagerly."""
        capture_step_graphs(self, emulate=emulate)
