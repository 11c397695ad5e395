"""Runs one scheduled step on the model: inputs, forward over the paged KV cache, logits, sampling.

The model is an unmodified Hugging Face causal LM loaded with `attn_implementation="bridge_paged"`
(see `runner.hf_attention`). A step's batch is packed as one sequence `(1, T)`: `position_ids`
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

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from runner.attention_metadata import AttentionMetadata, ForwardContext, set_forward_context
from runner.hf_attention import ATTN_IMPLEMENTATION, register_bridge_attention
from runner.inputs_embeds import InputsEmbedsBuilder
from runner.kv_cache import KVCacheSpec, allocate_kv_caches
from runner.logits_head import wrap_lm_head
from runner.request import Request
from runner.sampler import Sampler, SamplingBatch
from runner.sampling_params import SamplingParams
from runner.scheduler import SchedulerOutput, StepResult

logger = logging.getLogger(__name__)


# Most greedy decode steps run back to back without a host sync (see `execute_decode_window`).
MAX_DECODE_WINDOW = 32
# Measured on an H200 (W1 of benchmarks/generate.py): 8 -> 35%, 16 -> 39%, 32 -> 40% of the roofline.
DEFAULT_DECODE_WINDOW = 32


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch-size buckets: 1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond."""
    sizes = [1, 2, 4]
    b = 8
    while b <= max_num_seqs:
        sizes.append(b)
        b += 8 if b < 64 else (16 if b < 256 else 32)
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return [s for s in sizes if s <= max_num_seqs]


@dataclass
class _StepViews:
    """Device (and host) views of one step's inputs inside the staging buffers."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    idx_mapping: torch.Tensor
    block_tables: torch.Tensor
    num_computed_by_slot: torch.Tensor


class _StagingBuffers:
    """Pinned host buffers mirrored by device buffers; a step's tensors are views at fixed offsets.

    Layout for a step of `t` token rows, `r` request rows, `w` block-table columns and `l` logits rows:
      int64: [input_ids t][positions t][slot_mapping t][logits_indices l]
      int32: [num_computed_by_slot S][query_start_loc r+1][seq_lens r][idx_mapping r][block_tables r*w]
    Offsets depend only on (t, r, w), so the views a CUDA graph captured for a bucket are the views
    every replay of that bucket writes.

    On a GPU there are two pinned host pairs, used in turn (`next_host`): under async scheduling
    step n+1 is staged while step n's upload may still be queued behind step n-1 on the device,
    so it must not write the pinned memory that upload reads. Each pair's upload records an event
    and `next_host` waits for it before the pair is written again (already done in practice: the
    loop read step n-1's tokens, which come after step n-1's upload, before staging step n+1).
    """

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device) -> None:
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        self.device = device
        pin = device.type == "cuda"
        n64 = 4 * max_tokens
        n32 = max_reqs + (max_reqs + 1) + 2 * max_reqs + max_reqs * max_blocks
        pairs = 2 if pin else 1
        self._hosts = [(torch.zeros(n64, dtype=torch.int64, pin_memory=pin),
                        torch.zeros(n32, dtype=torch.int32, pin_memory=pin)) for _ in range(pairs)]
        self._events: list = [None] * pairs
        self._turn = 0
        self.host64, self.host32 = self._hosts[0]
        self.np64 = self.host64.numpy()
        self.np32 = self.host32.numpy()
        if device.type == "cpu":
            self.dev64, self.dev32 = self.host64, self.host32
        else:
            self.dev64 = torch.zeros(n64, dtype=torch.int64, device=device)
            self.dev32 = torch.zeros(n32, dtype=torch.int32, device=device)

    def next_host(self) -> None:
        """Switch to the other pinned host pair (GPU only), once its last upload has run."""
        if len(self._hosts) == 1:
            return
        self._turn = (self._turn + 1) % len(self._hosts)
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        self.host64, self.host32 = self._hosts[self._turn]
        self.np64 = self.host64.numpy()
        self.np32 = self.host32.numpy()

    def offsets(self, t: int, r: int, w: int, n_logits: int) -> tuple[list[int], list[int]]:
        o64 = [0, t, 2 * t, 3 * t, 3 * t + n_logits]
        s = self.max_reqs
        o32 = [0, s, s + r + 1, s + 2 * r + 1, s + 3 * r + 1, s + 3 * r + 1 + r * w]
        return o64, o32

    def views(self, buf64: torch.Tensor, buf32: torch.Tensor, t: int, r: int, w: int,
              n_logits: int) -> _StepViews:
        o64, o32 = self.offsets(t, r, w, n_logits)
        return _StepViews(
            input_ids=buf64[o64[0] : o64[1]],
            positions=buf64[o64[1] : o64[2]],
            slot_mapping=buf64[o64[2] : o64[3]],
            logits_indices=buf64[o64[3] : o64[4]],
            num_computed_by_slot=buf32[o32[0] : o32[1]],
            query_start_loc=buf32[o32[1] : o32[2]],
            seq_lens=buf32[o32[2] : o32[3]],
            idx_mapping=buf32[o32[3] : o32[4]],
            block_tables=buf32[o32[4] : o32[5]].view(r, w),
        )

    def upload(self, t: int, r: int, w: int, n_logits: int) -> None:
        if self.dev64 is self.host64:
            return
        o64, o32 = self.offsets(t, r, w, n_logits)
        self.dev64[: o64[-1]].copy_(self.host64[: o64[-1]], non_blocking=True)
        self.dev32[: o32[-1]].copy_(self.host32[: o32[-1]], non_blocking=True)
        if self._events[self._turn] is None:
            self._events[self._turn] = torch.cuda.Event()
        self._events[self._turn].record()


@dataclass
class _Staged:
    """One step's staged inputs: device views plus the host-side numbers the step needs later."""

    views: _StepViews
    t: int
    r: int
    bucket: int | None
    nsched: np.ndarray
    cu: np.ndarray
    seq_lens: np.ndarray
    decode_only: bool
    sample_rows: list[int]
    plp_rows: list[int]
    plp_spans: list[tuple[int, int, int]]


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are enqueued on the device; `ModelRunner.finish` reads it.

    `rows` are the batch rows that sampled, `sample_index` maps their request ids to positions in
    `token_ids` (the device tensor the next step's pending input ids are copied from). `host`
    holds the host copies of token ids, logprobs, top-k ids and top-k logprobs (None: nothing
    sampled), complete once `event` (CUDA only) has fired.
    """

    so: SchedulerOutput
    rows: list[int]
    sample_index: dict[str, int]
    params: list[SamplingParams] = field(default_factory=list)
    token_ids: torch.Tensor | None = None
    host: list[torch.Tensor | None] | None = None
    event: torch.cuda.Event | None = None
    plp_logits: torch.Tensor | None = None
    plp_spans: list[tuple[int, int, int]] = field(default_factory=list)


class ModelRunner:
    """Owns the model, the KV cache, the per-slot host tables and the CUDA graphs."""

    def __init__(
        self,
        model_dir: str,
        config,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        enable_prompt_embeds: bool,
        eos_token_ids: tuple[int, ...] = (),
        fused_ops: bool | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        register_bridge_attention()
        self.device = device
        self.dtype = dtype
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.eos_token_ids = tuple(eos_token_ids)

        model_cls = AutoModelForCausalLM
        if getattr(config, "model_type", None) in ("qwen2_vl", "qwen2_5_vl"):
            # No causal-LM class for these in transformers 5: load the full model and run its text
            # model + LM head (the vision tower is Bridge's encoders' business, not the runner's).
            from transformers import AutoModelForImageTextToText as model_cls
        model = model_cls.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
        )
        self.model = model.to(device).eval().requires_grad_(False)
        # One-kernel RMSNorm and rotary (runner.fused_ops): on the GPU by default; BRIDGE_FUSED_OPS=0
        # turns them off (A/B runs).
        if fused_ops is None:
            fused_ops = device.type == "cuda" and os.environ.get("BRIDGE_FUSED_OPS", "1") != "0"
        self.num_fused_norms, self.fused_rotary, self.num_fused_linears = 0, False, (0, 0)
        self.num_fused_layers = 0
        self.num_grouped_moe = 0
        if fused_ops:
            from runner.fused_ops import fuse_rmsnorms, fuse_rotary
            from runner.moe_grouped import install_grouped_moe

            self.num_grouped_moe = install_grouped_moe(self.model)  # MoE experts: one grouped GEMM pair

            self.num_fused_norms = fuse_rmsnorms(self.model)
            self.fused_rotary = fuse_rotary(self.model)
            # One q/k/v GEMM and one gate/up GEMM + SiLU*mul (runner.fused_linear); BRIDGE_FUSED_LINEAR=0 A/B.
            if os.environ.get("BRIDGE_FUSED_LINEAR", "1") != "0":
                from runner.fused_linear import fuse_linears

                self.num_fused_linears = fuse_linears(self.model)
                # The whole decoder layer on fused kernels (runner.fused_layers); BRIDGE_FUSED_LAYERS=0 A/B.
                if os.environ.get("BRIDGE_FUSED_LAYERS", "1") != "0":
                    from runner.fused_layers import fuse_decoder_layers

                    self.num_fused_layers = fuse_decoder_layers(self.model)
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = wrap_lm_head(model.get_output_embeddings(), config)  # + final logit scaling/capping
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.hidden_size = text.hidden_size
        self.vocab_size = self.embed_tokens.weight.shape[0]
        self.kv_spec = KVCacheSpec.from_config(config, dtype, block_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

        self.set_max_model_len(max_model_len)
        self.embeds_builder = InputsEmbedsBuilder(max_num_batched_tokens, self.hidden_size, dtype, device)
        self.prompt_embeds_state = None
        if enable_prompt_embeds:
            from runner.prompt_embeds import PromptEmbedsState

            self.prompt_embeds_state = PromptEmbedsState(max_num_seqs, self.hidden_size, dtype, device)
        # runner.mm_state.MultimodalState, set by the LLM: encoders, encoder cache, M-RoPE positions.
        self.mm = None
        self.sampler = Sampler()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: torch.Tensor | None = None
        self.num_graph_replays = 0
        self.num_decode_windows = 0
        self.num_forward_steps = 0
        # Async scheduling: input ids copied on the device from the step in flight (pinned index
        # buffers used in turn on a GPU, like the staging buffers).
        self.num_fed_tokens = 0
        self._feed_turn = 0
        if device.type == "cuda":
            self._feed_host = [torch.zeros(2 * max_num_seqs, dtype=torch.int64, pin_memory=True)
                               for _ in range(2)]
            self._feed_dev = torch.zeros(2 * max_num_seqs, dtype=torch.int64, device=device)
            self._feed_events = [torch.cuda.Event(), torch.cuda.Event()]

    # ----------------------------------------------------------------------------- setup
    def set_max_model_len(self, max_model_len: int) -> None:
        """(Re)size the per-slot host tables and staging buffers for sequences up to `max_model_len`."""
        self.max_model_len = max_model_len
        self.max_blocks_per_req = -(-max_model_len // self.block_size)
        # +1: a request whose prompt fills the context still records its one sampled token.
        self.token_table = np.zeros((self.max_num_seqs, max_model_len + 1), dtype=np.int64)
        self.block_table = np.zeros((self.max_num_seqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks_known = np.zeros(self.max_num_seqs, dtype=np.int64)
        self.num_computed_by_slot = np.zeros(self.max_num_seqs, dtype=np.int32)
        self.staging = _StagingBuffers(self.max_num_batched_tokens, self.max_num_seqs,
                                       self.max_blocks_per_req, self.device)

    @torch.inference_mode()
    def profile_peak_memory(self, *, force: bool = False) -> int:
        """Activation peak of the largest step (CUDA): sizes the KV cache under a memory budget.

        Runs one full step through the normal path (`execute`): `max_num_batched_tokens` prompt
        tokens split over as few requests as the context allows, on a temporary KV cache just big
        enough, then the sampler's worst case (softmax and sort of every slot's logits). `force`
        runs it on the CPU too (tests); the measurement itself is CUDA-only.
        """
        if self.device.type != "cuda" and not force:
            return 0
        bs = self.block_size
        lens: list[int] = []
        left = self.max_num_batched_tokens
        while left > 0 and len(lens) < self.max_num_seqs:
            lens.append(min(left, self.max_model_len))
            left -= lens[-1]
        n_blocks = sum(-(-n // bs) for n in lens)
        saved_caches, saved_steps = self.kv_caches, self.num_forward_steps
        self.kv_caches = allocate_kv_caches(self.kv_spec, n_blocks, self.device)
        reqs: list[Request] = []
        next_block = 0
        for i, n in enumerate(lens):
            req = Request(f"profile-{i}", i, [0] * n, SamplingParams(max_tokens=1, temperature=0.0))
            req.slot = i
            req.block_ids = list(range(next_block, next_block + -(-n // bs)))
            next_block += len(req.block_ids)
            reqs.append(req)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device) if cuda else 0
        self.execute(SchedulerOutput(reqs, lens, [True] * len(lens)))
        worst = torch.zeros(self.max_num_seqs, self.vocab_size, dtype=torch.float32, device=self.device)
        worst = torch.softmax(worst, dim=-1).sort(dim=-1)
        del worst
        peak = 0
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_caches = saved_caches
        self.num_blocks_known[:] = 0
        self.num_forward_steps = saved_steps
        if cuda:
            torch.cuda.empty_cache()
        return int(peak)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)

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
            self.prompt_embeds_state.add_request(slot, request.request_id, request.prompt_embeds,
                                                 request.is_token_ids)
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
    def _forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor | None, to_float: bool = True) -> torch.Tensor:
        # positions: (T,) or, on M-RoPE models, (3, T) -> position_ids (3, 1, T).
        with set_forward_context(ForwardContext(meta, self.kv_caches)):
            hidden = self.decoder(
                inputs_embeds=embeds.unsqueeze(0), position_ids=positions.unsqueeze(-2), use_cache=False
            ).last_hidden_state[0]
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        logits = self.lm_head(hidden)
        return logits.float() if to_float else logits

    def can_replay(self, num_reqs: int) -> bool:
        """Whether a decode step of `num_reqs` requests has a captured graph bucket."""
        return self._graph_bucket(num_reqs) is not None

    def _graph_bucket(self, num_reqs: int) -> int | None:
        for b in self.graph_sizes if self.graphs else ():
            if b >= num_reqs:
                return b
        return None

    def _stage(self, so: SchedulerOutput) -> _Staged:
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
        decode_only = so.is_decode_only
        if decode_only:
            positions, tok_slots = nc, slots
        else:
            req_of_tok = np.repeat(np.arange(r), nsched)
            positions = np.arange(t) - (cu - nsched)[req_of_tok] + nc[req_of_tok]
            tok_slots = slots[req_of_tok]

        # Rows whose logits are needed: sampled rows first, then prompt-logprob rows.
        sample_rows = [int(cu[i]) - 1 for i in range(r) if so.samples[i]]
        plp_rows, plp_spans = self._prompt_logprob_rows(so, nc, cu - nsched)
        logit_rows = sample_rows + plp_rows

        bucket = self._graph_bucket(r) if decode_only and not plp_rows else None
        tp, rp = (bucket, bucket) if bucket else (t, r)
        w = self.max_blocks_per_req if bucket else max(1, int(-(-seq_lens.max() // bs)))
        n_logits = 0 if bucket else len(logit_rows)
        o64, o32 = st.offsets(tp, rp, w, n_logits)
        h64, h32 = st.np64, st.np32
        h64[o64[0] : o64[0] + t] = self.token_table[tok_slots, positions]
        h64[o64[1] : o64[1] + t] = positions
        h64[o64[2] : o64[2] + t] = self.block_table[tok_slots, positions // bs] * bs + positions % bs
        if n_logits:
            h64[o64[3] : o64[4]] = logit_rows
        self.num_computed_by_slot[slots] = nc
        h32[o32[0] : o32[1]] = self.num_computed_by_slot
        h32[o32[1]] = 0
        h32[o32[1] + 1 : o32[1] + 1 + r] = cu
        h32[o32[2] : o32[2] + r] = seq_lens
        h32[o32[3] : o32[3] + r] = slots
        h32[o32[4] : o32[4] + r * w] = self.block_table[slots, :w].reshape(-1)
        if bucket and bucket > r:  # padding rows: no KV write, no context, one query row each
            h64[o64[0] + t : o64[1]] = 0
            h64[o64[1] + t : o64[2]] = 0
            h64[o64[2] + t : o64[3]] = -1
            h32[o32[1] + 1 + r : o32[2]] = np.arange(t + 1, bucket + 1)
            h32[o32[2] + r : o32[3]] = 0
            h32[o32[3] + r : o32[4]] = 0
            h32[o32[4] + r * w : o32[5]] = 0
        st.upload(tp, rp, w, n_logits)
        v = st.views(st.dev64, st.dev32, tp, rp, w, n_logits)
        return _Staged(v, t, r, bucket, nsched, cu, seq_lens, decode_only, sample_rows, plp_rows, plp_spans)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> StepResult:
        """Run one scheduled step and sample; the one host sync reads the sampled tokens."""
        return self.finish(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue one step's forward and sampling on the device without waiting for them.

        `prev` is the step still in flight (async scheduling): a request whose last token is one
        `prev` sampled (`num_pending_outputs`) gets that token's id copied on the device from
        `prev`'s sampled ids into this step's input ids. The sampled ids (and logprobs) start
        their copy to the host; `finish` waits for it.
        """
        sd = self._stage(so)
        v, t, r, bucket, sample_rows = sd.views, sd.t, sd.r, sd.bucket, sd.sample_rows
        self._feed_pending_tokens(so, sd, prev)
        positions = v.positions
        mm = self.mm.gather_step(so.requests, so.num_scheduled_tokens) if self.mm is not None else None
        if mm is None:
            embeds = self.embeds_builder.build(self.embed_tokens, v.input_ids)
        else:  # media rows scattered where is_mm_embed (padding rows of a graph bucket never are)
            embeds = self.embeds_builder.build(self.embed_tokens, v.input_ids[:t], None, mm.mm_embeds,
                                               mm.is_mm_embed)
            if v.input_ids.shape[0] > t:
                self.embeds_builder.build(self.embed_tokens, v.input_ids[t:], out=self.embeds_builder.buffer[
                    t : v.input_ids.shape[0]])
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
            self.graphs[bucket].replay()
            self.num_graph_replays += 1
            logits = self.graph_logits[:r]
            if len(sample_rows) != r:
                keep = torch.tensor([i for i in range(r) if so.samples[i]]).to(self.device, non_blocking=True)
                logits = logits.index_select(0, keep)
        else:
            meta = AttentionMetadata(
                v.slot_mapping, v.query_start_loc, v.seq_lens, v.block_tables,
                max_query_len=int(sd.nsched.max()), max_seq_len=int(sd.seq_lens.max()), num_reqs=r,
                is_decode_only=sd.decode_only,
                query_start_loc_cpu=[0, *sd.cu.tolist()], seq_lens_cpu=sd.seq_lens.tolist(),
            )
            logits = self._forward(embeds, positions, meta, v.logits_indices)
        self.num_forward_steps += 1

        step = self._sample_on_device(so, logits[: len(sample_rows)])
        if sd.plp_rows:  # read in `finish` (never a graph step, so these logits are not overwritten)
            step.plp_logits, step.plp_spans = logits[len(sample_rows) :], sd.plp_spans
        return step

    def _feed_pending_tokens(self, so: SchedulerOutput, sd: _Staged, prev: LaunchedStep | None) -> None:
        """Input ids the host does not know yet: copied on the device from `prev`'s sampled ids."""
        dst: list[int] = []
        src: list[int] = []
        for i, req in enumerate(so.requests):
            if not req.num_pending_outputs:
                continue
            if req.num_pending_outputs > 1 or prev is None or req.request_id not in prev.sample_index:
                raise RuntimeError(f"request {req.request_id}: its pending token is not from the step in "
                                   "flight (async scheduling must finish older steps first)")
            pos = req.num_tokens - 1  # the pending token is the request's last one
            start = int(sd.cu[i] - sd.nsched[i])
            nc = req.num_computed_tokens
            if nc <= pos < nc + int(sd.nsched[i]):
                dst.append(start + pos - nc)
                src.append(prev.sample_index[req.request_id])
        if not dst:
            return
        n = len(dst)
        if self.device.type == "cuda":  # pinned, used in turn like the staging buffers
            self._feed_turn ^= 1
            host, event = self._feed_host[self._feed_turn], self._feed_events[self._feed_turn]
            event.synchronize()  # its previous upload has run (in practice long ago)
            host[:n] = torch.tensor(dst)
            host[n : 2 * n] = torch.tensor(src)
            idx = self._feed_dev[: 2 * n]
            idx.copy_(host[: 2 * n], non_blocking=True)
            event.record()
        else:
            idx = torch.tensor(dst + src, dtype=torch.int64)
        sd.views.input_ids.index_copy_(0, idx[:n], prev.token_ids.index_select(0, idx[n:]))
        self.num_fed_tokens += n

    @torch.inference_mode()
    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's sampled tokens (the one host sync) and return them.

        Each sampled token also goes into the token table at the request's next position,
        except for requests that finished meanwhile (async scheduling: their slot may be gone).
        """
        so = step.so
        result = self._sampled_result(step)
        if step.plp_spans:
            result.prompt_logprobs = self._prompt_logprobs(so, step.plp_logits, step.plp_spans)
        for i, req in enumerate(so.requests):
            token = result.sampled_token_ids[i]
            if token is None or req.is_finished:
                continue
            pos = req.num_prompt_tokens + req.num_output_tokens  # the oldest pending token's position
            if pos <= self.max_model_len:
                self.token_table[req.slot, pos] = token
        return result

    @torch.inference_mode()
    def execute_decode_window(self, so: SchedulerOutput, k: int) -> list[list[int]]:
        """Run `k` greedy decode steps back to back on the device; one host sync for all of them.

        Step j's input token is step j-1's argmax, fed on the device; positions, context lengths
        and KV slots advance on the device from the block tables the scheduler already extended
        for `k` more tokens. Every step replays the decode graph of the batch's bucket. Returns
        the `k` tokens of each request; the caller drops those after a stop.
        """
        sd = self._stage(so)
        v, r, bucket, bs = sd.views, sd.r, sd.bucket, self.block_size
        assert bucket is not None and sd.decode_only and len(sd.sample_rows) == r
        deltas = self.mm.decode_deltas(so.requests) if self.mm is not None and self.mm.uses_mrope else None
        if deltas is not None:  # M-RoPE: positions carry the delta; KV slots come from the index
            v.positions[:r] += deltas
        tokens = self.window_tokens
        for j in range(k):
            if j:
                v.input_ids[:r].copy_(tokens[j - 1, :r])
                v.positions[:r] += 1
                v.seq_lens[:r] += 1
                pos = v.positions[:r] if deltas is None else v.positions[:r] - deltas
                block = v.block_tables[:r].gather(1, torch.div(pos, bs, rounding_mode="floor").unsqueeze(1))
                v.slot_mapping[:r].copy_(block.squeeze(1).long() * bs + pos % bs)
            self.embeds_builder.build(self.embed_tokens, v.input_ids)
            self.graphs[bucket].replay()
            torch.argmax(self.graph_logits[:r], dim=-1, out=tokens[j, :r])
        self.num_graph_replays += k
        self.num_forward_steps += k
        self.num_decode_windows += 1
        out = tokens[:k, :r].t().tolist()
        for req, toks in zip(so.requests, out):
            n = req.num_tokens
            self.token_table[req.slot, n : n + k] = toks[: self.max_model_len + 1 - n]
        return out

    # ----------------------------------------------------------------------------- sampling
    def _sample_on_device(self, so: SchedulerOutput, logits: torch.Tensor) -> LaunchedStep:
        """Sample the rows that need a token; the results start their copy to the host."""
        rows = [i for i in range(so.num_reqs) if so.samples[i]]
        step = LaunchedStep(so, rows, {so.requests[i].request_id: j for j, i in enumerate(rows)})
        if logits.shape[0] == 0:
            return step
        reqs = [so.requests[i] for i in rows]
        params = [q.sampling_params for q in reqs]
        penalties = any(p.uses_penalties for p in params)
        need_outputs = penalties or any(p.min_tokens > 0 for p in params)
        if penalties and any(q.num_pending_outputs and q.sampling_params.uses_penalties for q in reqs):
            raise RuntimeError("penalties need every output token on the host: finish the step in flight "
                               "before launching this one")
        batch = SamplingBatch(
            params=params,
            generators=[q.generator for q in reqs],
            penalty_prompt_ids=[q.real_prompt_token_ids() for q in reqs] if penalties else None,
            # min_tokens counts outputs only: a token in flight is a -1 here (penalties ignore it).
            output_ids=[q.output_token_ids + [-1] * q.num_pending_outputs if q.num_pending_outputs
                        else q.output_token_ids for q in reqs] if need_outputs else None,
            eos_token_ids=self.eos_token_ids,
        )
        out = self.sampler(logits, batch)
        step.params = params
        step.token_ids = out.token_ids
        host = [out.token_ids, out.logprobs, out.topk_ids, out.topk_logprobs]
        if self.device.type == "cuda":
            host = [x.to("cpu", non_blocking=True) if x is not None else None for x in host]
            step.event = torch.cuda.Event()
            step.event.record()
        step.host = host
        return step

    @staticmethod
    def _sampled_result(step: LaunchedStep) -> StepResult:
        r = step.so.num_reqs
        sampled: list[int | None] = [None] * r
        if step.host is None:
            return StepResult(sampled)
        if step.event is not None:
            step.event.synchronize()
        token_ids, logprobs, topk_ids, topk_logprobs = step.host
        for row, tok in zip(step.rows, token_ids.tolist()):
            sampled[row] = tok
        result = StepResult(sampled)
        if logprobs is not None:
            lps = logprobs.tolist()
            result.logprobs = [None] * r
            result.top_logprobs = [None] * r
            top_ids = topk_ids.tolist() if topk_ids is not None else None
            top_lps = topk_logprobs.tolist() if topk_logprobs is not None else None
            for j, row in enumerate(step.rows):
                k = step.params[j].logprobs
                if k is None:
                    continue
                result.logprobs[row] = lps[j]
                if k and top_ids is not None:
                    result.top_logprobs[row] = dict(zip(top_ids[j][:k], top_lps[j][:k]))
        return result

    def _prompt_logprob_rows(self, so: SchedulerOutput, nc: np.ndarray,
                             starts: np.ndarray) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Rows of prompt positions p (predicting prompt token p+1) for requests asking prompt logprobs.

        Returns the rows and, per such request, (batch index, first position, count).
        """
        rows: list[int] = []
        spans: list[tuple[int, int, int]] = []
        for i, req in enumerate(so.requests):
            if req.sampling_params.prompt_logprobs is None:
                continue
            first = int(nc[i])
            last = min(first + so.num_scheduled_tokens[i], req.num_prompt_tokens - 1)
            if last <= first:
                continue
            base = int(starts[i])
            rows.extend(range(base, base + last - first))
            spans.append((i, first, last - first))
        return rows, spans

    def _prompt_logprobs(self, so: SchedulerOutput, logits: torch.Tensor,
                         spans: list[tuple[int, int, int]]) -> dict[str, tuple[int, list[dict[int, float]]]]:
        logprobs = torch.log_softmax(logits, dim=-1)
        out: dict[str, tuple[int, list[dict[int, float]]]] = {}
        offset = 0
        for i, first, count in spans:
            req = so.requests[i]
            k = req.sampling_params.prompt_logprobs
            targets = torch.tensor(req.prompt_token_ids[first + 1 : first + 1 + count], device=logits.device)
            lp = logprobs[offset : offset + count]
            chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            entries: list[dict[int, float]] = []
            if k:
                top_lp, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1)
                for tid, c, ids, vals in zip(targets.tolist(), chosen, top_ids.tolist(), top_lp.tolist()):
                    entry = dict(zip(ids, vals))
                    entry[tid] = c
                    entries.append(entry)
            else:
                entries = [{tid: c} for tid, c in zip(targets.tolist(), chosen)]
            out[req.request_id] = (first + 1, entries)
            offset += count
        return out

    # ----------------------------------------------------------------------------- CUDA graphs
    def _decode_graph_body(self, b: int):
        """The work a decode graph of bucket `b` replays, on the fixed views of that bucket."""
        st = self.staging
        v = st.views(st.dev64, st.dev32, b, b, self.max_blocks_per_req, 0)
        v.input_ids.zero_()
        v.positions.zero_()
        v.slot_mapping.fill_(-1)
        v.query_start_loc.copy_(torch.arange(b + 1, dtype=torch.int32))
        v.seq_lens.zero_()
        v.block_tables.zero_()
        meta = AttentionMetadata(v.slot_mapping, v.query_start_loc, v.seq_lens, v.block_tables,
                                 max_query_len=1, max_seq_len=self.max_model_len, num_reqs=b,
                                 is_decode_only=True)
        embeds = self.embeds_builder.dummy_inputs_embeds(b)

        def body() -> None:
            # The fp32 buffer takes the model-dtype logits in one casting copy (no fp32 temporary).
            self.graph_logits[:b].copy_(self._forward(embeds, v.positions, meta, None, to_float=False))

        return body

    @torch.inference_mode()
    def capture_cuda_graphs(self, *, emulate: bool = False) -> None:
        """Capture decode-only steps for each batch-size bucket, largest first (one shared memory pool).

        The graph covers the decoder and the LM head; its input is the persistent inputs_embeds
        buffer (`dummy_inputs_embeds`), so the assembly (token lookup, prompt-embeds overlay) runs
        eagerly right before each replay and no encoder ever runs at capture. Padding rows of a
        bucket write no KV (slot -1) and attend to nothing (seq_len 0).

        `emulate=True` (tests, CPU): no capture; "replay" runs the same body eagerly on the same
        fixed views, which exercises the bucket, padding and fixed-offset logic without a GPU.
        """
        if self.device.type != "cuda" and not emulate:
            return
        self.graph_sizes = cuda_graph_batch_sizes(min(self.max_num_seqs, self.max_num_batched_tokens))
        self.graph_logits = torch.zeros(self.graph_sizes[-1], self.vocab_size, dtype=torch.float32,
                                        device=self.device)
        self.window_tokens = torch.zeros(MAX_DECODE_WINDOW, self.graph_sizes[-1], dtype=torch.int64,
                                         device=self.device)
        if emulate:
            self.graphs = {b: _EagerReplay(self._decode_graph_body(b)) for b in self.graph_sizes}
            return
        pool = None
        for b in reversed(self.graph_sizes):
            body = self._decode_graph_body(b)
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                body()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                body()
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.graph_sizes)


class _EagerReplay:
    """Stands in for a CUDA graph where none can be captured: replay runs the body eagerly."""

    def __init__(self, body) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()
