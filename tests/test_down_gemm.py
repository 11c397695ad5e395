"""The one-kernel down projection (`runner.layers.down_gemm`) and the decode window's argmax
(`runner.layers.greedy_argmax`): against the launches they replace, on the CPU under TRITON_INTERPRET and
on W1's shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_norm_gemm import assert_close_ulps

from runner.layers import fused_layers
from runner.layers.down_gemm import DownConfig, down_residual_, down_residual_supported, new_counters
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
    equal those of the same engine with cuBLAS's addmm (BRIDGE_DOWN_GEMM=0 is the switch)."""
    from bridge.tiny_models import build_tiny_model
    from runner.layers import fused_linear
    from runner.llm import LLM
    from runner.sampling_params import SamplingParams

    path = build_tiny_model(tiny_model_root / "down_gemm_qwen3", "qwen3", seed=7, head_dim=32)
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42]]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    calls = []
    original = fused_layers.down_residual_

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_layers, "down_residual_", counting)
    monkeypatch.setattr(fused_layers, "NORM_GEMM_ON_CPU", True)

    def run(down: bool, max_rows: int | None = None) -> list[list[int]]:
        monkeypatch.setattr(fused_layers, "DOWN_GEMM", down)
        llm = LLM(path, dtype="bfloat16", device="cpu", num_kv_blocks=32, max_num_seqs=4)
        fused_linear.fuse_linears(llm.runner.model)
        assert fused_layers.fuse_decoder_layers(llm.runner.model) == 2
        if max_rows is not None:  # counters sized for fewer rows than a step brings: cuBLAS for that step
            for layer in llm.runner.model.model.layers:
                layer.mlp.bridge_down_max_rows = max_rows
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    got = run(True)
    assert calls and max(calls) <= fused_layers.NORM_GATE_UP_MAX_ROWS
    assert max(calls) == 8  # the prefill step (5 + 3 tokens) took the kernel too
    n_calls = len(calls)
    want = run(False)
    assert len(calls) == n_calls  # without counters the layer keeps cuBLAS
    assert got == want
    assert run(True, max_rows=4) == want
    assert max(calls[n_calls:]) <= 4 and len(calls) > n_calls


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
