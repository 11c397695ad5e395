"""The norm-GEMM kernels (runner.layers.norm_gemm) compute what the three-launch sequences they replace
compute: rms_norm -> F.linear -> qkv_norm_rope_write, and rms_norm -> F.linear -> silu_mul.

On the CPU both sides run their Triton kernels under TRITON_INTERPRET (F.linear is torch's CPU GEMM).
The GEMMs sum in different orders, so a value may land one bf16/fp16 rounding step away; the tests
bound the difference by a few ulps of the values' scale and check that most elements agree bitwise (a
wrong rounding point would break that). The engine test runs a tiny bf16 Qwen3 with the fused layers
and checks the norm-GEMM path against the same engine without it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.layers import fused_layers, fused_linear
from runner.layers.fused_layers import qkv_norm_rope_write
from runner.layers.fused_linear import silu_mul_triton
from runner.layers.fused_ops import rms_norm
from runner.layers.norm_gemm import (
    GATE_UP_CONFIGS,
    QKV_CONFIGS,
    NormGemmConfig,
    default_config,
    norm_gate_up_silu,
    norm_qkv_rope_write,
    qkv_counters,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SENTINEL = 7.0
EPS = 1e-6


def _qkv_case(m, hq, hkv, d, k, dtype, *, bias, qk_norm, device="cpu", seed=0, pad_rows=(1,)):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    n = (hq + 2 * hkv) * d
    angles = torch.rand(m, d // 2, generator=g) * 6.0
    block_size = 4
    num_blocks = (m + 3) // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:m]
    for r in pad_rows:
        if r < m:
            slots[r] = -1  # a padding row writes nothing
    case = dict(
        x=rnd(m, k, scale=2.0), norm_weight=(torch.rand(k, generator=g) + 0.5).to(dtype).to(device), eps=EPS,
        qkv_weight=rnd(n, k, scale=k**-0.5), qkv_bias=rnd(n, scale=0.5) if bias else None,
        num_q_heads=hq, num_kv_heads=hkv,
        cos=torch.cat([angles.cos(), angles.cos()], -1).to(dtype).to(device),
        sin=torch.cat([angles.sin(), angles.sin()], -1).to(dtype).to(device),
        key_cache=torch.full((num_blocks, block_size, hkv, d), SENTINEL, dtype=dtype, device=device),
        slot_mapping=slots.to(device),
        q_norm=((torch.rand(d, generator=g) + 0.5).to(dtype).to(device),
                (torch.rand(d, generator=g) + 0.5).to(dtype).to(device), 1e-5) if qk_norm else None,
    )
    case["value_cache"] = torch.full_like(case["key_cache"], SENTINEL)
    return case


def unfused_qkv(c):
    """The engine's three launches (fused_layers without the norm-GEMM path)."""
    h = rms_norm(c["x"], c["norm_weight"], c["eps"])
    qkv = F.linear(h, c["qkv_weight"], c["qkv_bias"])
    return qkv_norm_rope_write(qkv, c["num_q_heads"], c["num_kv_heads"], c["cos"], c["sin"], c["key_cache"],
                               c["value_cache"], c["slot_mapping"], c["q_norm"])


def _with_fresh_caches(c):
    return {**c, "key_cache": c["key_cache"].clone(), "value_cache": c["value_cache"].clone()}


def assert_close_ulps(got, want, dtype, *, ulps=4, min_exact=0.95):
    """Within `ulps` rounding steps of the values' scale, and mostly bitwise equal."""
    got, want = got.float(), want.float()
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # one ulp at magnitude 1
    scale = max(want.abs().max().item(), 1.0)
    err = (got - want).abs().max().item()
    assert err <= ulps * step * scale, f"max abs diff {err} > {ulps} ulps of {scale}"
    exact = (got == want).float().mean().item()
    assert exact >= min_exact, f"only {exact:.1%} of the elements equal bitwise"


def compare_qkv(c, config=None, counters=None):
    ref, got = _with_fresh_caches(c), _with_fresh_caches(c)
    want_q = unfused_qkv(ref)
    q = norm_qkv_rope_write(**got, config=config, counters=counters)
    dtype = c["x"].dtype
    assert q.shape == want_q.shape and q.dtype == want_q.dtype
    assert_close_ulps(q, want_q, dtype)
    assert_close_ulps(got["key_cache"], ref["key_cache"], dtype)
    assert_close_ulps(got["value_cache"], ref["value_cache"], dtype)
    # padding rows (slot -1) and unused slots keep the sentinel
    hkv, d = c["num_kv_heads"], c["key_cache"].shape[-1]
    written = torch.zeros(c["key_cache"].numel() // (hkv * d), dtype=torch.bool)
    slots = c["slot_mapping"].cpu()
    written[slots[slots >= 0]] = True
    for cache in (got["key_cache"], got["value_cache"]):
        flat = cache.view(-1, hkv, d).cpu()
        assert (flat[~written] == SENTINEL).all()
        assert (flat[written] != SENTINEL).any()


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("head_dim,groups", [(64, 1), (128, 2), (64, 2)])
@pytest.mark.parametrize("bias,qk_norm", [(False, True), (True, False), (False, False)])
def test_norm_qkv_rope_write_matches_unfused_bf16(m, head_dim, groups, bias, qk_norm):
    hkv = 2
    c = _qkv_case(m, hkv * groups, hkv, head_dim, 64, torch.bfloat16, bias=bias, qk_norm=qk_norm,
                  seed=m + head_dim + groups, pad_rows=(1, 3))
    compare_qkv(c)


@pytest.mark.parametrize("m,k,config", [
    (17, 96, NormGemmConfig(block_m=8, block_k=32)),  # three K steps, three M blocks
    (5, 80, NormGemmConfig(block_m=16, block_k=32)),  # K not a multiple of the K step: masked
    (17, 80, None),  # one masked K step (the default K step clamped to 128)
])
def test_norm_qkv_rope_write_k_loop_and_fp16(m, k, config):
    for dtype, bias in ((torch.bfloat16, True), (torch.float16, False)):
        c = _qkv_case(m, 4, 2, 64, k, dtype, bias=bias, qk_norm=True, seed=k)
        compare_qkv(c, config)


@pytest.mark.parametrize("m,k,config", [
    (17, 96, NormGemmConfig(block_m=8, block_k=32, splits=2)),  # splits of 64 and 32 columns, three M blocks
    (5, 80, NormGemmConfig(block_m=16, block_k=32, splits=3)),  # the last split's K step masked
    (1, 64, NormGemmConfig(block_m=16, block_k=16, splits=4)),
])
def test_norm_qkv_rope_write_split_k(m, k, config):
    """The K range split over programs per head (the last to arrive reduces and runs the epilogue): the
    same results as the unfused launches, counters back at zero after every call, and without counters
    the same config runs unsplit."""
    counters = qkv_counters(4 + 2 * 2, m, "cpu")
    for dtype, bias, qk_norm in ((torch.bfloat16, True, True), (torch.float16, False, False)):
        c = _qkv_case(m, 4, 2, 64, k, dtype, bias=bias, qk_norm=qk_norm, seed=k + m)
        compare_qkv(c, config, counters)
        assert torch.count_nonzero(counters) == 0
        compare_qkv(c, config, counters)  # the same buffer serves the next call
        compare_qkv(c, config)
    with pytest.raises(ValueError, match="counters"):
        compare_qkv(c, config, torch.zeros(1, dtype=torch.int32))


def _gate_up_case(m, k, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    norm_weight = (torch.rand(k, generator=g) + 0.5).to(dtype)
    weight = (torch.randn(2 * inter, k, generator=g) * k**-0.5 * 2).to(dtype)
    return x, norm_weight, weight


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,inter,config", [
    (64, 64, None),
    (80, 48, NormGemmConfig(block_m=8, block_n=32, block_k=32)),  # masked K and a partial column tile
])
def test_norm_gate_up_silu_matches_unfused(m, dtype, k, inter, config):
    x, nw, w = _gate_up_case(m, k, inter, dtype, seed=m)
    want = silu_mul_triton(F.linear(rms_norm(x, nw, EPS), w))
    got = norm_gate_up_silu(x, nw, EPS, w, config=config)
    assert got.shape == (m, inter) and got.dtype == dtype
    assert_close_ulps(got, want, dtype)


def test_wrappers_reject_bad_inputs():
    c = _qkv_case(3, 4, 2, 64, 64, torch.bfloat16, bias=False, qk_norm=False)
    with pytest.raises(ValueError, match="qkv_weight"):
        norm_qkv_rope_write(**{**c, "qkv_weight": c["qkv_weight"][:-1]})
    with pytest.raises(ValueError, match="norm_weight"):
        norm_qkv_rope_write(**{**c, "norm_weight": c["norm_weight"][:-1]})
    with pytest.raises(ValueError, match="x must be"):
        norm_qkv_rope_write(**{**c, "x": c["x"].t().contiguous().t()})  # not unit last stride
    with pytest.raises(ValueError, match="bf16 or fp16"):
        norm_qkv_rope_write(**{**c, "x": c["x"].float()})
    with pytest.raises(ValueError, match="cos"):
        norm_qkv_rope_write(**{**c, "cos": c["cos"][:2]})
    with pytest.raises(ValueError, match="slot_mapping"):
        norm_qkv_rope_write(**{**c, "slot_mapping": c["slot_mapping"][:2]})
    with pytest.raises(ValueError, match="key_cache"):
        norm_qkv_rope_write(**{**c, "num_kv_heads": 1, "num_q_heads": 6})
    with pytest.raises(ValueError, match="config"):
        norm_qkv_rope_write(**c, config=NormGemmConfig(block_k=48))
    x, nw, w = _gate_up_case(3, 64, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="gate_up_weight"):
        norm_gate_up_silu(x, nw, EPS, w[:-1])
    with pytest.raises(ValueError, match="gate_up_weight"):
        norm_gate_up_silu(x, nw, EPS, w[:, :-1])
    with pytest.raises(ValueError, match="norm_weight"):
        norm_gate_up_silu(x, nw.float(), EPS, w)


def test_default_configs_cover_every_batch_size():
    for table in (QKV_CONFIGS, GATE_UP_CONFIGS):
        assert table[-1][0] is None
        for m in (1, 7, 16, 33, 64, 65, 4096):
            assert isinstance(default_config(table, m), NormGemmConfig)


# ------------------------------------------------------------------------------------------- engine

def test_engine_bf16_greedy_with_norm_gemm_matches_without(tiny_model_root, fused_on_cpu, monkeypatch):
    """A tiny bf16 Qwen3 (q/k norms) through the engine with fused layers: greedy tokens with the
    norm-GEMM path equal those without it. With NORM_GEMM_MAX_ROWS at 16 the first step (three prompts,
    22 tokens) keeps the unfused path and every later step of every layer takes the fused one."""
    from bridge.tiny_models import build_tiny_model
    from runner.llm import LLM
    from runner.sampling_params import SamplingParams

    path = build_tiny_model(tiny_model_root / "norm_gemm_qwen3", "qwen3", seed=5, head_dim=32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 200, (n,), generator=g).tolist() for n in (4, 11, 7)]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
    calls = []
    original = fused_layers.norm_qkv_rope_write

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_layers, "norm_qkv_rope_write", counting)
    monkeypatch.setattr(fused_layers, "NORM_GEMM_MAX_ROWS", 16)

    def run(norm_gemm: bool):
        fused_layers.NORM_GEMM_ON_CPU = norm_gemm
        llm = LLM(path, dtype="bfloat16", device="cpu", num_kv_blocks=32, max_num_seqs=4)
        model = llm.runner.model
        fused_linear.fuse_linears(model)
        assert fused_layers.fuse_decoder_layers(model) == 2
        llm.runner.capture_cuda_graphs(emulate=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return outs, llm.runner.num_forward_steps

    got, steps = run(True)
    assert max(calls) <= 16 and len(calls) >= 2 * (steps - 1)
    n_calls = len(calls)
    want, _ = run(False)
    assert len(calls) == n_calls
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        first_a = a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]]
        first_b = b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]]
        assert abs(first_a - first_b) < 0.05


def test_engine_with_split_k_qkv_matches_unsplit(tiny_model_root, fused_on_cpu, monkeypatch):
    """With split-K q/k/v configured (a QKV_CONFIGS entry with splits > 1) every layer gets its arrival
    counters at fuse time and every norm-GEMM step passes them: greedy tokens equal the unsplit engine's."""
    from helpers import fused_cpu_llm, greedy_token_ids

    from bridge.tiny_models import build_tiny_model
    from runner.layers import norm_gemm
    from runner.sampling_params import SamplingParams

    path = build_tiny_model(tiny_model_root / "qkv_split_qwen3", "qwen3", seed=6, head_dim=32)
    prompts = [[5, 6, 7, 8], list(range(20, 31)), [90, 91, 92]]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    passed = []
    original = fused_layers.norm_qkv_rope_write

    def recording(*args, **kwargs):
        passed.append(kwargs.get("counters") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_layers, "norm_qkv_rope_write", recording)
    monkeypatch.setattr(fused_layers, "NORM_GEMM_ON_CPU", True)

    def run(splits: int):
        table = tuple((b, NormGemmConfig(block_m=16, block_k=32, splits=splits)) for b, _ in QKV_CONFIGS)
        monkeypatch.setattr(norm_gemm, "QKV_CONFIGS", table)
        return greedy_token_ids(fused_cpu_llm(path), prompts, params)

    got = run(2)
    assert passed and all(passed)
    passed.clear()
    assert run(1) == got
    assert passed and not any(passed)


_SPLIT_QKV_FOR_SM90 = r"""
import runner.layers.norm_gemm as ng

fn = ng._norm_qkv_rope_write_kernel
types = dict(x_ptr="*bf16", nw_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", q_out_ptr="*bf16", cos_ptr="*bf16",
             sin_ptr="*bf16", q_norm_ptr="*bf16", k_norm_ptr="*bf16", slot_ptr="*i64", k_cache_ptr="*bf16",
             v_cache_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32", eps="fp32", head_eps="fp32")
for splits in (1, 4):
    consts = dict(HALF=64, HAS_BIAS=False, HAS_NORM=True, BLOCK_M=16, BLOCK_K=256, EVEN_K=True, SWAP_AB=True,
                  STATS_K=256, STATS_CHUNKS=4, EVEN_STATS=True, INTERPRET=False, SPLITS=splits,
                  K_PER_SPLIT=1024 // splits, RELEASE=splits > 1)
    aligned = [n for n in fn.arg_names if n.endswith("_ptr")]
    ptx = build_sm90(fn, types, consts, aligned, num_warps=4, num_stages=3).asm["ptx"]
    print("qkv splits", splits, "atomics" if "atom" in ptx else "none",
          "release" if "griddepcontrol.launch_dependents" in ptx else "-")
"""


def test_split_k_qkv_kernel_compiles_for_sm90():
    """Split and unsplit q/k/v kernels build for Hopper without a GPU (only the split one has atomics), and
    with RELEASE the PDL trigger is in the code."""
    from helpers import compile_for_sm90

    lines = compile_for_sm90(_SPLIT_QKV_FOR_SM90).splitlines()
    assert "qkv splits 1 none -" in lines and "qkv splits 4 atomics release" in lines, lines


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_w1_shapes_match_unfused(m):
    """W1's shapes (Qwen3-0.6B: hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072) in bf16."""
    c = _qkv_case(m, 16, 8, 128, 1024, torch.bfloat16, bias=False, qk_norm=True, device="cuda",
                  seed=m, pad_rows=(1, 40))
    compare_qkv(c)
    x, nw, w = (t.cuda() for t in _gate_up_case(m, 1024, 3072, torch.bfloat16, seed=m))
    want = silu_mul_triton(F.linear(rms_norm(x, nw, EPS), w))
    assert_close_ulps(norm_gate_up_silu(x, nw, EPS, w), want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_split_k_qkv_w1_shapes_in_a_graph(m):
    """Split-K q/k/v on W1's shapes: within a few ulps of the unfused launches, and a CUDA graph of it
    replays to the same bits with the counters back at zero."""
    c = _qkv_case(m, 16, 8, 128, 1024, torch.bfloat16, bias=False, qk_norm=True, device="cuda",
                  seed=m, pad_rows=(1, 40))
    cfg = NormGemmConfig(block_m=16, block_k=128, splits=4)
    counters = qkv_counters(32, 64, "cuda")
    compare_qkv(c, cfg, counters)
    assert torch.count_nonzero(counters) == 0
    got = _with_fresh_caches(c)
    eager = norm_qkv_rope_write(**got, config=cfg, counters=counters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = norm_qkv_rope_write(**got, config=cfg, counters=counters)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q, eager)
    assert torch.count_nonzero(counters) == 0


@pytest.mark.gpu
def test_gpu_new_batch_sizes_build_no_kernels():
    """After a first call, every batch size up to 64 finds its kernels built (M is not specialised and
    the first call builds every default config)."""
    from runner.layers import norm_gemm

    c = _qkv_case(64, 4, 2, 128, 256, torch.bfloat16, bias=True, qk_norm=True, device="cuda", seed=1)
    x, nw, w = (t.cuda() for t in _gate_up_case(64, 256, 256, torch.bfloat16))

    def cached():
        return sum(len(k.device_caches[torch.cuda.current_device()][0])
                   for k in (norm_gemm._norm_qkv_rope_write_kernel, norm_gemm._norm_gate_up_silu_kernel))

    def call(m):
        sub = {**c, "x": c["x"][:m], "cos": c["cos"][:m], "sin": c["sin"][:m],
               "slot_mapping": c["slot_mapping"][:m]}
        norm_qkv_rope_write(**sub)
        norm_gate_up_silu(x[:m], nw, EPS, w)

    call(3)
    before = cached()
    for m in (1, 2, 8, 16, 17, 31, 32, 48, 63, 64):
        call(m)
    torch.cuda.synchronize()
    assert cached() == before
