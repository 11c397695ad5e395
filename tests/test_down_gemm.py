"""The one-kernel down projection (`runner.layers.down_gemm`) and the decode window's argmax
(`runner.layers.greedy_argmax`): against the launches they replace, on the CPU under TRITON_INTERPRET and
on W1's shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_norm_gemm import assert_close_ulps

from runner.layers import fused_layers, pdl
from runner.layers.down_gemm import (
    DownConfig,
    down_residual_,
    down_residual_supported,
    new_counters,
    residual_gemm,
)
from runner.layers.fused_linear import silu_mul_triton
from runner.layers.greedy_argmax import greedy_argmax

CPU_CONFIGS = [
    DownConfig(block_m=16, block_n=32, block_k=32, splits=4),
    DownConfig(block_m=16, block_n=64, block_k=64, splits=3, swap_ab=True),  # K=200: uneven last split
    DownConfig(block_m=16, block_n=32, block_k=32, splits=1),  # no split: the epilogue without counters
]


def _case(m: int, n: int, k: int, silu: bool, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    act = torch.randn(m, 2 * k if silu else k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, n, generator=g).to(torch.bfloat16)
    return x.to(device), act.to(device), w.to(device)


def _unfused(x, act, w, silu):
    a = silu_mul_triton(act) if silu else act
    return x.clone().addmm_(a, w.t())


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_down_residual_matches_silu_mul_and_addmm(m, silu):
    """N = 80 and K = 200 sit off every tile (masked edges); every call leaves the counters at zero, so
    the same buffer serves the next call (as a replayed CUDA graph needs)."""
    x, act, w = _case(m, 80, 200, silu, seed=m)
    want = _unfused(x, act, w, silu)
    counters = new_counters(80, m, "cpu")
    for cfg in CPU_CONFIGS:
        got = down_residual_(x.clone(), act, w, counters, silu=silu, config=cfg)
        assert_close_ulps(got, want, torch.bfloat16, ulps=2)
        assert torch.count_nonzero(counters) == 0
        again = down_residual_(x.clone(), act, w, counters, silu=silu, config=cfg)
        assert torch.equal(got, again)


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_weights_first_form_matches_and_leaves_the_residual(m, silu):
    """`residual_gemm(pdl=True)`, one K step per split with the weight tile read first (K = 200 over tiles
    of 64: an uneven last split), out of place: `x` is left as it was, `out` equals the unfused launches,
    and the counters are zero again. On the CPU the wait is compiled out (no PDL without a GPU)."""
    x, act, w = _case(m, 80, 200, silu, seed=10 + m)
    want = _unfused(x, act, w, silu)
    counters = new_counters(80, m, "cpu")
    for cfg in (DownConfig(block_m=16, block_n=32, block_k=64), DownConfig(block_m=16, block_n=64, block_k=64,
                                                                          swap_ab=True)):
        before = x.clone()
        got = residual_gemm(x, act, w, counters, silu=silu, config=cfg, pdl=True)
        assert torch.equal(x, before)
        assert_close_ulps(got, want, torch.bfloat16, ulps=2)
        assert torch.count_nonzero(counters) == 0
        into = torch.empty_like(x)
        assert residual_gemm(x, act, w, counters, silu=silu, config=cfg, pdl=True, out=into) is into
        assert torch.equal(into, got)
    assert not pdl.pdl_supported(torch.device("cpu"))
    with pytest.raises(ValueError, match="out must be like x"):
        residual_gemm(x, act, w, counters, silu=silu, out=torch.empty(m, 81, dtype=torch.bfloat16))


def test_down_residual_updates_x_in_place_and_rejects_bad_input():
    x, act, w = _case(3, 128, 128, silu=False)
    counters = new_counters(128, 3, "cpu")
    target = x.clone()
    out = down_residual_(target, act, w, counters, silu=False)
    assert out is target and not torch.equal(target, x)
    assert not down_residual_supported(x, act, w, silu=True)  # act is (M, K), not gate|up (M, 2K)
    with pytest.raises(ValueError, match="agree"):
        down_residual_(x.clone(), act, w, counters, silu=True)
    with pytest.raises(ValueError, match="agree"):
        down_residual_(x.float(), act.float(), w.float(), counters, silu=False)  # fp32 would run tf32
    with pytest.raises(ValueError, match="counters"):
        down_residual_(x.clone(), act, w, torch.zeros(1, dtype=torch.int32), silu=False)  # 2 tiles
    with pytest.raises(ValueError, match="power-of-two"):
        down_residual_(x.clone(), act, w, counters, silu=False, config=DownConfig(block_n=48))


def test_engine_steps_run_the_down_kernel(tiny_model_root, fused_on_cpu, monkeypatch):
    """A bf16 tiny Qwen3 with the norm-GEMM path: decode steps run the down kernel, and the greedy tokens
    equal those of the same engine with cuBLAS's addmm (fused_layers.DOWN_GEMM off)."""
    from helpers import fused_cpu_llm, greedy_token_ids

    from bridge.tiny_models import build_tiny_model
    from runner.sampling_params import SamplingParams

    path = build_tiny_model(tiny_model_root / "down_gemm_qwen3", "qwen3", seed=7, head_dim=32)
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42]]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    calls = []
    original = fused_layers.residual_gemm

    def counting(*args, **kwargs):
        assert kwargs["out"] is args[0] and not kwargs["pdl"]  # in place, ordinary launches
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_layers, "residual_gemm", counting)
    monkeypatch.setattr(fused_layers, "NORM_GEMM_ON_CPU", True)

    def run(down: bool, max_rows: int | None = None) -> list[list[int]]:
        monkeypatch.setattr(fused_layers, "DOWN_GEMM", down)
        llm = fused_cpu_llm(path)
        if max_rows is not None:  # counters sized for fewer rows than a step brings: cuBLAS for that step
            for layer in llm.runner.model.model.layers:
                layer.mlp.bridge_down_max_rows = max_rows
        return greedy_token_ids(llm, prompts, params)

    got = run(True)
    assert calls and max(calls) <= fused_layers.NORM_GATE_UP_MAX_ROWS
    assert max(calls) == 8  # the prefill step (5 + 3 tokens) took the kernel too
    n_calls = len(calls)
    want = run(False)
    assert len(calls) == n_calls  # without counters the layer keeps cuBLAS
    assert got == want
    assert run(True, max_rows=4) == want
    assert max(calls[n_calls:]) <= 4 and len(calls) > n_calls


def test_engine_steps_with_pdl_run_o_proj_and_down_weights_first(tiny_model_root, fused_on_cpu, monkeypatch):
    """With the PDL switch on (`runner.layers.pdl`), every step of up to PDL_MAX_ROWS tokens runs o_proj out
    of place and the down projection in place through the weights-first kernel, on either side of the
    norm-GEMM cut-off (PDL_MAX_ROWS raised past it here, to cover a larger cut-off; the CPU runs the
    kernels with ordinary launches); the greedy tokens equal the engine's without it."""
    from helpers import fused_cpu_llm, greedy_token_ids

    from bridge.tiny_models import build_tiny_model
    from runner.sampling_params import SamplingParams

    path = build_tiny_model(tiny_model_root / "pdl_qwen3", "qwen3", seed=8, head_dim=32)
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42], list(range(50, 90))]  # a 48-token prefill step too
    params = SamplingParams(max_tokens=4, temperature=0.0)
    calls, o_proj_weights = [], set()
    original = fused_layers.residual_gemm

    def counting(x, act, weight, counters, **kwargs):
        calls.append((x.shape[0], weight.data_ptr() in o_proj_weights, kwargs.get("out") is x,
                      kwargs.get("pdl", False)))
        return original(x, act, weight, counters, **kwargs)

    monkeypatch.setattr(fused_layers, "residual_gemm", counting)
    monkeypatch.setattr(fused_layers, "NORM_GEMM_ON_CPU", True)
    monkeypatch.setattr(fused_layers, "PDL_ON_CPU", True)
    monkeypatch.setattr(fused_layers, "PDL_MAX_ROWS", 64)

    def run(enabled: bool) -> list[list[int]]:
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        llm = fused_cpu_llm(path)
        o_proj_weights.clear()  # this engine's o_proj weights (an earlier engine's memory may be reused)
        layers = llm.runner.model.model.layers
        o_proj_weights.update(layer.self_attn.o_proj.weight.data_ptr() for layer in layers)
        return greedy_token_ids(llm, prompts, params)

    got = run(True)
    o_calls = [c for c in calls if c[1]]
    down_calls = [c for c in calls if not c[1]]
    assert o_calls and len(o_calls) == len(down_calls)
    assert all(in_place for _, _, in_place, _ in down_calls)  # down: into the o_proj sum
    # o_proj: layer 0 out of place (its residual is the embeddings), layer 1 into layer 0's output
    assert [in_place for _, _, in_place, _ in o_calls] == [False, True] * (len(o_calls) // 2)
    assert all(pdl_on for *_, pdl_on in calls)
    rows = {m for m, *_ in calls}
    assert max(rows) > fused_layers.NORM_GATE_UP_MAX_ROWS and min(rows) <= 3  # both sides of the cut-off
    calls.clear()
    want = run(False)
    assert all(not pdl_on for *_, pdl_on in calls) and max(m for m, *_ in calls) <= 32
    assert got == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_argmax_matches_torch_ties_nan_and_inf(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3000, generator=g).to(dtype)
    x[0, 1500] = x[0, 2999] = 50  # a tie across chunks: the first wins
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 2000] = x[2, 10] = float("nan")  # NaN beats every number; the first NaN wins
    x[3, 7] = float("inf")
    x[4, 33] = x[4, 34] = 60  # a tie inside one chunk
    out = torch.empty(5, dtype=torch.int64)
    assert greedy_argmax(x, out) is out
    assert out.tolist() == torch.argmax(x, dim=-1).tolist()
    tokens = torch.zeros(3, 5, dtype=torch.int64)  # a strided output row, as the window's token table
    greedy_argmax(x[:, :7], tokens[1])
    assert tokens[1].tolist() == torch.argmax(x[:, :7], dim=-1).tolist()
    with pytest.raises(ValueError, match="int64"):
        greedy_argmax(x, torch.empty(5, dtype=torch.int32))


def test_greedy_argmax_chunks_of_several_blocks():
    """40,000 columns: chunks of two whole 1,024-column blocks (loaded unmasked), a partial block in the
    last non-empty chunk and empty chunks after it; maxima placed in each kind of place."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 40000, generator=g).to(torch.bfloat16)
    x[0, 2047] = 30  # the last column of the first chunk
    x[1, 39999] = 30  # the last column of the row, in the partial block
    x[2, 2048] = x[2, 4095] = 30  # a tie between two blocks of one chunk: the first wins
    x[3, 12345] = float("nan")
    out = torch.empty(4, dtype=torch.int64)
    greedy_argmax(x, out)
    assert out.tolist() == torch.argmax(x, dim=-1).tolist() == [2047, 39999, 2048, 12345]


_ARGMAX_FOR_SM90 = r"""
from runner.layers import greedy_argmax as ga

ptx = build_sm90(ga._argmax_chunks_kernel, dict(x_ptr="*bf16", val_ptr="*fp32", idx_ptr="*i32"),
                 dict(CHUNKS=ga.CHUNKS, BLOCK=ga.BLOCK), ["x_ptr", "stride_x"], num_warps=4).asm["ptx"]
print("vector loads:", "ld.global.v4.b32" in ptx or "ld.global.nc.v4.b32" in ptx)
"""


def test_greedy_argmax_full_blocks_load_as_vectors_on_sm90():
    """The whole blocks of a chunk compile to 16-byte loads for Hopper (no GPU needed)."""
    from helpers import compile_for_sm90

    assert "vector loads: True" in compile_for_sm90(_ARGMAX_FOR_SM90)


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 64])
def test_gpu_down_residual_w1_shapes_in_a_graph(m):
    """W1's down projection (3072 -> 1024, bf16) with both prologues, eager and replayed from a CUDA graph
    (the counters reset on every replay, so replays agree)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for silu in (True, False):
        x, act, w = _case(m, 1024, 3072, silu, device="cuda", seed=m)
        want = _unfused(x, act, w, silu)
        counters = new_counters(1024, m, "cuda")
        got = down_residual_(x.clone(), act, w, counters, silu=silu)
        assert_close_ulps(got, want, torch.bfloat16, ulps=2)
        target = x.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            down_residual_(target, act, w, counters, silu=silu)  # built outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            down_residual_(target, act, w, counters, silu=silu)
        for _ in range(3):
            target.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(target, got)
        assert torch.count_nonzero(counters) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_greedy_argmax_matches_torch(rows):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.randn(rows, 151936, device="cuda", dtype=torch.bfloat16)
    x[0, 100] = x[0, 150000] = 30
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    assert torch.equal(greedy_argmax(x, out), torch.argmax(x, dim=-1))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 64])
def test_gpu_pdl_chain_equals_ordinary_launches_in_a_graph(m, monkeypatch):
    """28 layers of SiLU*mul (releasing its dependents early) then the weights-first down projection
    launched with PDL, and the o_proj shape out of place after it, in one CUDA graph: bitwise equal to the
    same kernels launched normally (`pdl.LAUNCH_PDL = False`), replay after replay. A wait in the wrong
    place reads a predecessor's output half-written, which shows up here as a difference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not pdl.pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")
    monkeypatch.setattr(pdl, "ENABLED", True)
    layers = 28
    g = torch.Generator().manual_seed(m)

    def weight(n, k):
        return (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16).cuda()

    downs = [weight(1024, 3072) for _ in range(layers)]
    oprojs = [weight(1024, 2048) for _ in range(layers)]
    gate_up = torch.randn(m, 6144, generator=g).to(torch.bfloat16).cuda()
    o_in = torch.randn(m, 2048, generator=g).to(torch.bfloat16).cuda()
    x0 = torch.randn(m, 1024, generator=g).to(torch.bfloat16).cuda()
    counters = [new_counters(1024, 64, "cuda") for _ in range(2 * layers)]

    def chain(x):
        for i in range(layers):
            act = silu_mul_triton(gate_up)
            x = residual_gemm(x, act, downs[i], counters[2 * i], pdl=True)
            x = residual_gemm(x, o_in, oprojs[i], counters[2 * i + 1], pdl=True)
        return x

    results = {}
    for launched in (False, True):
        monkeypatch.setattr(pdl, "LAUNCH_PDL", launched)
        x = x0.clone()
        chain(x)  # builds outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x)
        outs = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            outs.append(out.clone())
        assert all(torch.equal(o, outs[0]) for o in outs)
        results[launched] = outs[0]
    assert torch.equal(results[True], results[False])
    assert all(torch.count_nonzero(c) == 0 for c in counters)


_PDL_FOR_SM90 = r"""
import re
import runner.layers.down_gemm as dg
import runner.layers.fused_linear as fl

types = dict(act_ptr="*bf16", w_ptr="*bf16", x_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32",
             count_ptr="*i32")
aligned = [*types, "K", "N", "stride_am", "stride_wn", "stride_xm", "stride_om"]
for cfg in (dg.default_pdl_config(64), dg.default_pdl_config(1)):
    kernel = build_sm90(dg._down_residual_kernel, types, dict(
        K_PER_SPLIT=cfg.block_k, SPLITS=12, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=True, EVEN_N=True, SILU=False, SWAP_AB=cfg.swap_ab, INTERPRET=False, WEIGHTS_FIRST=True,
        PDL=True), aligned, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=True)
    ptx = kernel.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    loads = [m.start() for m in re.finditer(r"ld\.global", ptx)]
    before, after = sum(at < wait for at in loads), sum(at > wait for at in loads)
    print("down", cfg.block_m, before, after, kernel.metadata.launch_pdl)
silu = build_sm90(fl._silu_mul_kernel, dict(x_ptr="*bf16", out_ptr="*bf16"),
                  dict(BLOCK=1024, RELEASE=True), ["x_ptr", "out_ptr"], num_warps=4)
print("silu", "griddepcontrol.launch_dependents" in silu.asm["ptx"])
rownorm = build_sm90(fl._silu_mul_rownorm_kernel, dict(gu_ptr="*bf16", x_ptr="*bf16", out_ptr="*bf16",
                     eps="fp32"), dict(BLOCK=1024, BLOCK_H=1024, RELEASE=True),
                     ["gu_ptr", "x_ptr", "out_ptr"], num_warps=4)
print("rownorm", "griddepcontrol.launch_dependents" in rownorm.asm["ptx"])
import runner.layers.fused_layers as fls
qkv = build_sm90(fls._qkv_norm_rope_write_kernel, dict(
    qkv_ptr="*bf16", q_out_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", q_norm_ptr="*bf16",
    k_norm_ptr="*bf16", slot_ptr="*i64", k_cache_ptr="*bf16", v_cache_ptr="*bf16", eps="fp32", x_ptr="*bf16",
    row_eps="fp32"), dict(HALF=64, BLOCK_Q=16, BLOCK_KV=8, HAS_NORM=True, ROW_SCALE=True, BLOCK_H=1024,
    RELEASE=True), [], num_warps=4)
print("qkv", "griddepcontrol.launch_dependents" in qkv.asm["ptx"])
"""


def test_pdl_kernels_compile_for_sm90_with_the_weights_read_before_the_wait():
    """Compiled for Hopper without a GPU: the weights-first down kernel issues its weight loads before
    `griddepcontrol.wait` and its activation loads after it (the compiler could have sunk them past the
    wait, which would leave nothing to overlap), and is marked for PDL launches; SiLU*mul (both forms) and
    the q/k/v epilogue (with its row scale) release their dependents."""
    from helpers import compile_for_sm90

    lines = compile_for_sm90(_PDL_FOR_SM90).splitlines()
    downs = [ln.split() for ln in lines if ln.startswith("down ")]
    assert len(downs) == 2, lines
    for _, _, before, after, marked in downs:
        assert int(before) > 0 and int(after) > 0 and marked == "True", lines
    assert "silu True" in lines and "rownorm True" in lines and "qkv True" in lines


@pytest.mark.gpu
def test_gpu_engine_with_pdl_equals_the_same_kernels_launched_normally(tiny_model_root, monkeypatch):
    """The engine with PDL on (CUDA graphs, decode windows, PDL_MAX_ROWS
    requests) gives bitwise the tokens and
    logprobs of the same engine whose weights-first kernels launch normally: PDL changes when a kernel
    starts, never what it computes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not pdl.pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")
    from helpers import gpu_tokens_and_logprobs

    from bridge.tiny_models import build_tiny_model
    from runner.sampling_params import SamplingParams

    path = build_tiny_model(tiny_model_root / "pdl_gpu_qwen3", "qwen3", seed=9, head_dim=64)
    n = fused_layers.PDL_MAX_ROWS  # decode steps of the whole batch take the PDL kernels
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(5 + i % 40)]} for i in range(n)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)
    monkeypatch.setattr(pdl, "ENABLED", True)
    runs = {}

    def has_pdl_counters(llm):
        assert hasattr(llm.runner.model.model.layers[0].self_attn, "bridge_o_counters")

    for launched in (True, False):
        monkeypatch.setattr(pdl, "LAUNCH_PDL", launched)
        runs[launched] = gpu_tokens_and_logprobs(path, prompts, params, check=has_pdl_counters)
    assert runs[True] == runs[False]
