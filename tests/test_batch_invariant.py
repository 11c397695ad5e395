"""`EngineConfig.batch_invariant`: a prompt's greedy tokens and logprobs are the same bits whatever else runs.

The pieces first: the invariant matmul (Triton under TRITON_INTERPRET and the CPU tiles) gives each row the
same bits at every M and both of its forms (split over K segments or not) agree; both invariant attention
paths give a query row the same bits in a whole prompt, a chunk or a decode step beside other requests,
with sliding windows and soft-capping, while the default paths do not; the TorchFunctionMode routes
products and reductions there. Then the engine, a tiny fp32 qwen3: a mixed set of prompts (token ids,
whole-prompt embeds, `<embeds>` items, media items through a batching encoder, some asking prompt
logprobs) run alone, all in one batch, under a 5-token chunk budget, with prefix caching (cold and warm),
under preemption by recompute, and on emulated CUDA graphs with decode windows, must give identical tokens
and logprob floats; without
the flag the same comparison differs (MKL answers the rows of a 1-row product with another kernel than a
64-row one). Last, the GPU code path on the CPU (Triton matmul, attention and norms under the
interpreter, graphs emulated) against itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bridge.tiny_models import build_tiny_model
from runner.config import EngineConfig
from runner.layers import fused_ops, invariant_matmul
from runner.layers.attention_metadata import AttentionMetadata
from runner.layers.batch_invariant import batch_invariant_active, batch_invariant_ops
from runner.layers.hf_attention import set_attention_backend
from runner.layers.invariant_matmul import invariant_mm_cpu, invariant_mm_triton
from runner.layers.invariant_rows import row_mean, row_softmax
from runner.layers.paged_attention import paged_attention
from runner.llm import LLM
from runner.multimodal.encoder_protocol import tensor_content_hash
from runner.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.filterwarnings("ignore:async scheduling turned off"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

HIDDEN = 64
FEATURES = 16


# ------------------------------------------------------------------------------------------------ matmul

@pytest.mark.parametrize("form", ["triton", "cpu"])
def test_matmul_rows_do_not_depend_on_their_batch(form):
    g = torch.Generator().manual_seed(0)
    for k, n in [(64, 96), (300, 130), (5, 7)]:
        w, x = torch.randn(n, k, generator=g), torch.randn(70, k, generator=g)
        bias = torch.randn(n, generator=g)
        if form == "triton":
            full = invariant_mm_triton(x, w.t(), bias, split=False)
            assert torch.equal(invariant_mm_triton(x, w.t(), bias, split=True), full)  # split-K: same bits
        else:
            full = invariant_mm_cpu(x, w.t(), bias)
        torch.testing.assert_close(full, x @ w.t() + bias, atol=1e-4, rtol=1e-4)
        for m in (1, 2, 3, 17, 64):
            for offset in (0, 5):
                rows = x[offset : offset + m]
                got = (invariant_mm_triton(rows, w.t(), bias) if form == "triton"
                       else invariant_mm_cpu(rows, w.t(), bias))
                assert torch.equal(got, full[offset : offset + m]), (k, n, m, offset)


def test_row_reductions_match_torch_and_ignore_the_row_count():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2500, generator=g) * 4  # more than one 1024-column block per row
    torch.testing.assert_close(row_mean(x, keepdim=True), x.mean(-1, keepdim=True))
    torch.testing.assert_close(row_softmax(x, log=True), torch.log_softmax(x, -1))
    torch.testing.assert_close(row_softmax(x, log=False), torch.softmax(x, -1))
    assert torch.equal(row_softmax(x[3:4], log=True), row_softmax(x, log=True)[3:4])
    assert torch.equal(row_mean(x[2:3]), row_mean(x)[2:3])
    assert row_softmax(x.to(torch.bfloat16), log=True, dtype=torch.float32).dtype == torch.float32


def test_the_mode_routes_products_and_leaves_the_rest(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    with batch_invariant_ops():
        assert batch_invariant_active()
        with batch_invariant_ops():  # re-entering changes nothing
            assert batch_invariant_active()
        lin = F.linear(x, w, b)
        mm = torch.mm(x[0], w.t())
        mat = x @ w.t()
        add = torch.addmm(b, x[0], w.t())
        bmm = torch.bmm(x, w.t().expand(3, 8, 6))
        outer = torch.arange(4.0)[:, None] @ torch.arange(3.0)[None, :]  # K = 1: torch's own
    assert not batch_invariant_active()
    flat = x.reshape(-1, 8)
    assert torch.equal(lin, invariant_mm_cpu(flat, w.t(), b).reshape(3, 5, 6))
    assert torch.equal(mm, invariant_mm_cpu(x[0], w.t()))
    assert torch.equal(mat, invariant_mm_cpu(flat, w.t()).reshape(3, 5, 6))
    assert torch.equal(add, invariant_mm_cpu(x[0], w.t(), b))
    assert torch.equal(bmm, torch.stack([invariant_mm_cpu(x[i], w.t()) for i in range(3)]))
    assert torch.equal(outer, torch.arange(4.0)[:, None] * torch.arange(3.0)[None, :])
    # Under the interpreter the CPU can take the Triton forms, reductions included.
    monkeypatch.setattr(invariant_matmul, "TRITON_ON_CPU", True)
    with batch_invariant_ops():
        lin = F.linear(x, w, b)
        mean = x.pow(2).mean(-1, keepdim=True)
        lsm = torch.log_softmax(x, dim=-1)
    assert torch.equal(lin, invariant_mm_triton(flat, w.t(), b).reshape(3, 5, 6))
    assert torch.equal(mean, row_mean(x.pow(2), keepdim=True))
    assert torch.equal(lsm, row_softmax(x, log=True))


def test_grouped_moe_rows_do_not_depend_on_the_other_tokens():
    """Bridge's grouped expert kernel in its invariant form (one block size, top-k rows added in slot
    order): a token's output alone equals its row among 40 tokens."""
    from runner.layers.moe_grouped import grouped_moe

    g = torch.Generator().manual_seed(4)
    experts, hidden, inter, top_k = 4, 32, 48, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(experts, hidden, inter, generator=g) * 0.2
    x = torch.randn(40, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(40)])
    weights = torch.rand(40, top_k, generator=g)
    full = grouped_moe(x, index, weights, gate_up, down, invariant=True)
    for t in (0, 17, 39):
        alone = grouped_moe(x[t : t + 1], index[t : t + 1], weights[t : t + 1], gate_up, down, invariant=True)
        assert torch.equal(alone, full[t : t + 1])


_KERNELS_FOR_SM90 = r"""
import torch
from runner.layers import invariant_matmul as im, invariant_rows as ir, paged_attention_triton as pat
c = im.CONFIGS[torch.bfloat16]
mm = build_sm90(im._matmul_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16",
                                        part_ptr="*fp32"),
                dict(HAS_BIAS=False, IS_FP32=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                     SEGMENT_K=c.segment_k, GROUP_M=c.group_m), ["a_ptr", "b_ptr", "c_ptr", "part_ptr"],
                num_warps=c.num_warps, num_stages=c.num_stages)
build_sm90(im._reduce_kernel, dict(part_ptr="*fp32", c_ptr="*bf16", bias_ptr="*bf16"),
           dict(HAS_BIAS=True, BLOCK=1024), num_warps=4)
build_sm90(ir._row_mean_kernel, dict(x_ptr="*bf16", out_ptr="*bf16"), dict(BLOCK=1024), num_warps=4)
build_sm90(ir._row_softmax_kernel, dict(x_ptr="*fp32", out_ptr="*fp32"), dict(LOG=True, BLOCK=1024),
           num_warps=4)
cfg = pat.invariant_prefill_config(128, torch.bfloat16)
types = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
types.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", qk_scale="fp32",
             softcap_l2="fp32")
att = build_sm90(pat._prefill_kernel, types, dict(
    BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // 2, G_PAD=2, TILE_N=cfg.tile_n,
    SEARCH_BLOCK=pat.PREFILL_SEARCH_BLOCK, IS_FP32=False, SLIDING=True, SOFTCAP=False, PAD_D=False,
    ALL_ROWS=True), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
print("wgmma", "wgmma" in mm.asm["ptx"], "wgmma" in att.asm["ptx"])
"""


def test_the_invariant_kernels_build_for_hopper():
    """Every new kernel (and the attention kernel's all-rows form) compiles for sm_90 outside the
    interpreter, the matmul and the attention on wgmma (no GPU needed)."""
    from helpers import compile_for_sm90

    assert "wgmma True True" in compile_for_sm90(_KERNELS_FOR_SM90)


# --------------------------------------------------------------------------------------------- attention

def _attention_case(backend: str, invariant: bool, window: int | None, softcap: float | None):
    """One request's 30 query rows as a whole prompt, as three chunks, and as decode steps beside two
    other requests; returns the three outputs."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    key_cache = torch.randn(64, block, kv_heads, dim, generator=g)
    value_cache = torch.randn(64, block, kv_heads, dim, generator=g)
    order = torch.randperm(64, generator=g)
    tables = [order[i * 16 : (i + 1) * 16] for i in range(3)]
    queries = torch.randn(3, 30, heads, dim, generator=g)

    def attend(parts):  # (request, first row, end row) per request of the step
        qsl = [0]
        for _, s, e in parts:
            qsl.append(qsl[-1] + e - s)
        seq_lens = [e for _, _, e in parts]
        meta = AttentionMetadata(
            torch.zeros(qsl[-1], dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), torch.stack([tables[r] for r, _, _ in parts]).int(),
            max_query_len=max(e - s for _, s, e in parts), max_seq_len=max(seq_lens), num_reqs=len(parts),
            is_decode_only=all(e - s == 1 for _, s, e in parts), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens)
        q = torch.cat([queries[r, s:e] for r, s, e in parts])
        return paged_attention(q, key_cache, value_cache, meta, 0.3, backend=backend, sliding_window=window,
                               softcap=softcap, batch_invariant=invariant)

    whole = attend([(0, 0, 30)])
    chunks = torch.cat([attend([(0, 0, 10)]), attend([(0, 10, 23)]), attend([(0, 23, 30)])])
    decodes = torch.cat([attend([(1, 0, 5), (0, p, p + 1), (2, 3, 20)])[5:6] for p in range(30)])
    return whole, chunks, decodes


@pytest.mark.parametrize(("backend", "window", "softcap"), [
    ("torch", None, None), ("torch", 7, None), ("torch", 25, 2.0), ("triton", 7, 2.0)])
def test_attention_rows_are_the_same_bits_in_any_step(backend, window, softcap):
    whole, chunks, decodes = _attention_case(backend, True, window, softcap)
    assert torch.equal(chunks, whole) and torch.equal(decodes, whole)
    reference, _, _ = _attention_case("torch", False, window, softcap)
    torch.testing.assert_close(whole, reference, atol=1e-5, rtol=1e-5)


def test_the_default_cpu_attention_depends_on_the_step():
    """What the invariant path fixes on the CPU: the reference path gives some row other bits in another
    step. (The Triton kernels' default launches differ by step on a GPU, where decode and prefill take
    other tiles and the decode kernel splits the keys by the grid; under the interpreter in fp32 they
    happen to agree.)"""
    whole, chunks, decodes = _attention_case("torch", False, None, None)
    assert not (torch.equal(chunks, whole) and torch.equal(decodes, whole))


# ------------------------------------------------------------------------------------------------ engine

class BatchingEncoder:
    """An encoder that runs its whole batch as one product, as real towers do: with more items its
    matmul has more rows (and so other kernels), which the engine's one-item-per-call avoids."""

    modality = "image"
    is_realtime = False

    def __init__(self) -> None:
        self.proj = torch.randn(FEATURES, HIDDEN, generator=torch.Generator().manual_seed(5)) * 0.3
        self.calls: list[int] = []

    def num_rows(self, item: torch.Tensor) -> int:
        return int(item.shape[0])

    def content_hash(self, item: torch.Tensor) -> str:
        return tensor_content_hash(item)

    def encode(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls.append(len(items))
        rows = torch.cat(items) @ self.proj
        return list(rows.split([int(i.shape[0]) for i in items]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("batch_invariant") / "qwen3", "qwen3", seed=7)


def _prompts(n: int = 16) -> list:
    """Token ids (a shared prefix on some, for the prefix cache), whole-prompt embeds, `<embeds>` items
    and images, in turn."""
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(20, 200, (9,), generator=g).tolist()
    out = []
    for i in range(n):
        length = int(torch.randint(1, 30, (1,), generator=g))
        ids = torch.randint(20, 200, (length,), generator=g).tolist()
        kind = i % 4
        if kind == 0:
            out.append({"prompt_token_ids": (prefix if i % 8 == 0 else []) + ids})
        elif kind == 1:
            out.append({"prompt_embeds": torch.randn(length + 2, HIDDEN, generator=g) * 0.5})
        elif kind == 2:
            item = torch.randn(int(torch.randint(1, 6, (1,), generator=g)), HIDDEN, generator=g) * 0.5
            out.append({"prompt": "red blue <embeds> green", "multi_modal_data": {"prompt_embeds": [item]}})
        else:
            image = torch.randn(int(torch.randint(2, 7, (1,), generator=g)), FEATURES, generator=g)
            out.append({"prompt": "<image> yellow " * (1 + i % 3), "multi_modal_data": {"image": [image]}})
            if i % 3:  # a prompt with several placeholders takes that many items
                out[-1]["multi_modal_data"]["image"] = [image] * (1 + i % 3)
    return out


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2,
                          prompt_logprobs=1 if i % 4 == 0 else None)


def _llm(model_dir, invariant: bool, **kw) -> tuple[LLM, BatchingEncoder]:
    encoder = BatchingEncoder()
    kw.setdefault("num_kv_blocks", 256)
    llm = LLM(model_dir, enable_prompt_embeds=True, encoders={"image": encoder}, device="cpu",
              dtype="float32", batch_invariant=invariant, **kw)
    return llm, encoder


def _results(outs) -> list:
    """Per prompt: the tokens, each step's logprob dict and the prompt logprobs (floats, compared as bits)."""
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def _alone(llm, prompts) -> list:
    return [_results(llm.generate([p], _params(i), use_tqdm=False))[0] for i, p in enumerate(prompts)]


def _batch(llm, prompts, order: list[int] | None = None) -> list:
    """All prompts in one call (in `order`, results given back in prompt order)."""
    order = order if order is not None else list(range(len(prompts)))
    got = _results(llm.generate([prompts[i] for i in order], [_params(i) for i in order], use_tqdm=False))
    return [got[order.index(i)] for i in range(len(prompts))]


def test_greedy_tokens_and_logprobs_are_the_same_bits_alone_batched_chunked_cached_preempted_graphed(
        model_dir):
    prompts = _prompts()
    llm, _ = _llm(model_dir, True)
    alone = _alone(llm, prompts)
    llm.shutdown()

    llm, encoder = _llm(model_dir, True)
    assert _batch(llm, prompts) == alone
    assert encoder.calls == [1] * 4  # one item per encode call, whatever the batch (4 distinct images)
    llm.shutdown()

    llm, _ = _llm(model_dir, True, max_num_batched_tokens=5, max_num_seqs=4)
    assert _batch(llm, prompts) == alone
    assert llm.scheduler.num_partial_prefills > 0 and llm.scheduler.num_mixed_steps > 0
    llm.shutdown()

    llm, _ = _llm(model_dir, True, enable_prefix_caching=True, block_size=4, max_num_batched_tokens=40)
    assert _batch(llm, prompts) == alone  # cold: shared prefixes hit within the batch
    assert _batch(llm, prompts, order=list(range(len(prompts)))[::-1]) == alone  # warm: most prompts hit
    assert llm.block_manager.num_hit_blocks > 0
    llm.shutdown()

    llm, _ = _llm(model_dir, True, num_kv_blocks=24, block_size=4, max_num_batched_tokens=32)
    assert _batch(llm, prompts) == alone  # preempted requests recompute their tokens as a prefill
    assert llm.stats().num_preemptions > 0
    llm.shutdown()

    llm, _ = _llm(model_dir, True, max_num_seqs=8, max_num_batched_tokens=64)
    llm.runner.capture_cuda_graphs(emulate=True)  # padded decode and mixed buckets
    llm.decode_window = 3
    assert _batch(llm, prompts) == alone
    assert llm.runner.num_graph_replays > 0 and llm.runner.num_mixed_graph_replays > 0
    # Without logprobs the decodes run in windows (argmax on the device, tokens fed back there).
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [a[0] for a in alone]
    assert llm.runner.num_decode_windows > 0
    llm.shutdown()


def test_without_the_flag_the_same_comparison_differs(model_dir):
    """The test above is not vacuous: by default a prompt's logprobs alone and in a batch differ in bits."""
    prompts = _prompts(8)
    llm, _ = _llm(model_dir, False)
    alone = _alone(llm, prompts)
    llm.shutdown()
    llm, encoder = _llm(model_dir, False)
    batch = _batch(llm, prompts)
    assert [a[0] for a in alone] == [b[0] for b in batch]  # tokens agree here: tiny random models have margin
    assert alone != batch
    assert encoder.calls == [2]  # and media items are encoded together
    llm.shutdown()


def test_the_gpu_code_path_on_the_cpu_against_itself(model_dir, monkeypatch):
    """The attention kernel for every row, the fused norms and rotary under the interpreter, on emulated
    graphs (decode and mixed buckets) with decode windows and an 8-token budget: two prompts alone and
    the same two in a batch of three, chunked another way, agree. (The Triton matmul's forms are checked
    above; here it would only make the interpreter slower.)"""
    monkeypatch.setattr(fused_ops, "ROTARY_ON_CPU", True)
    previous = set_attention_backend("triton")
    prompts = [_prompts(4)[i] for i in (1, 2, 0)]  # embeds, an <embeds> item, ids (with the shared prefix)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    try:
        llm, _ = _llm(model_dir, True, max_num_batched_tokens=8, max_num_seqs=4, mixed_graph_max_tokens=8)
        assert fused_ops.fuse_rmsnorms(llm.runner.model) > 0
        llm.runner.capture_cuda_graphs(emulate=True)  # few buckets: each capture runs the interpreter
        llm.decode_window = 2
        alone = [_results(llm.generate([p], params, use_tqdm=False))[0] for p in prompts[:2]]
        batch = _results(llm.generate(prompts, params, use_tqdm=False))
        assert llm.runner.num_graph_replays > 0 and llm.runner.num_mixed_graph_replays > 0
        llm.shutdown()
    finally:
        set_attention_backend(previous)
    assert batch[:2] == alone


def test_mixture_of_experts_alone_and_chunked_agree(tmp_path):
    """Hugging Face's experts on the CPU (`grouped_mm`, caught by the mode: one product per expert)."""
    from bridge.tiny_families import build_family_model

    path = build_family_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=11, init_std=0.1)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(12, 200, (n,), generator=g).tolist()}
               for n in (3, 11, 20, 7)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(path, device="cpu", dtype="float32", batch_invariant=True, num_kv_blocks=128)
    alone = [_results(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    llm.shutdown()
    llm = LLM(path, device="cpu", dtype="float32", batch_invariant=True, num_kv_blocks=128,
              max_num_batched_tokens=7)
    assert _results(llm.generate(prompts, params, use_tqdm=False)) == alone
    llm.shutdown()


# ------------------------------------------------------------------------------------------------ config

def test_the_option_turns_fused_layers_off_and_is_a_serve_flag(model_dir):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    on = EngineConfig(model=str(model_dir), batch_invariant=True, fused_ops=True, device="cpu").resolve(hf)
    assert on.fused_linear and not on.fused_layers
    assert EngineConfig(model=str(model_dir), fused_ops=True, device="cpu").resolve(hf).fused_layers
    with pytest.raises(ValueError, match="fused_layers=True cannot run batch_invariant"):
        EngineConfig(model=str(model_dir), batch_invariant=True, fused_layers=True, device="cpu").resolve(hf)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        EngineConfig(model=str(model_dir), batch_invariant="yes", device="cpu").resolve(hf)

    import argparse

    from bridge.serve.engine_flags import add_engine_flags, engine_options

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_options(parser.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert engine_options(parser.parse_args([]))["batch_invariant"] is False
    assert "--batch-invariant" in parser.format_help()
