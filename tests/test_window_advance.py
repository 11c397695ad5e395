"""A decode window's step advance as one kernel (runner.worker.window_advance) equals the torch ops.

The kernel against `advance_window_step_reference` under TRITON_INTERPRET on the staging buffers' dtypes and
views (with M-RoPE deltas, inert rows, several programs), then a CPU engine whose decode windows advance
with the kernel against one that advances with the torch ops: the same tokens and finish reasons.
"""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.sampling_params import SamplingParams
from runner.worker import window_advance

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _step_inputs(r: int, width: int, block_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    buf64 = torch.zeros(4 * r + 8, dtype=torch.int64)  # views at offsets, as `StagingBuffers.views` makes
    buf32 = torch.zeros(r * width + r + 8, dtype=torch.int32)
    input_ids, positions, slots = buf64[1 : r + 1], buf64[r + 2 : 2 * r + 2], buf64[2 * r + 3 : 3 * r + 3]
    seq_lens = buf32[3 : r + 3]
    tables = buf32[r + 5 : r + 5 + r * width].view(r, width)
    positions.copy_(torch.randint(0, width * block_size - 5, (r,), generator=g))  # room for +1 - delta
    seq_lens.copy_((positions + 1).to(torch.int32))
    tables.copy_(torch.randint(0, 5000, (r, width), generator=g, dtype=torch.int32))
    input_ids.copy_(torch.randint(0, 100, (r,), generator=g))
    prev = torch.randint(0, 150_000, (3, r), generator=g)[1]  # a row of the window's token table
    return prev, input_ids, positions, seq_lens, tables, slots


@pytest.mark.parametrize("r", [1, 5, 64, 1500])
@pytest.mark.parametrize("with_deltas", [False, True])
@pytest.mark.parametrize("with_alive", [False, True])
def test_kernel_equals_the_torch_ops(monkeypatch, r, with_deltas, with_alive):
    monkeypatch.setattr(window_advance, "ON_CPU", True)
    block_size, width = 16, 9
    got = _step_inputs(r, width, block_size, seed=r)
    want = _step_inputs(r, width, block_size, seed=r)
    g = torch.Generator().manual_seed(7)
    deltas = None
    if with_deltas:  # M-RoPE: positions carry a per-request delta; the KV position is positions - delta
        deltas = -torch.randint(0, 3, (r,), generator=g)
    alive = (torch.rand(r, generator=g) > 0.3).to(torch.int32) if with_alive else None
    calls = []
    original = window_advance.launch

    def counting(kernel, grid):
        calls.append(grid)
        return original(kernel, grid)

    monkeypatch.setattr(window_advance, "launch", counting)
    window_advance.advance_window_step(*got, block_size, deltas, alive)
    window_advance.advance_window_step_reference(*want, block_size, deltas, alive)
    assert len(calls) == 1  # the kernel ran, in one launch
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if with_alive:
        assert torch.equal(got[3] == 0, alive == 0) and torch.equal(got[5] == -1, alive == 0)


def test_strided_rows_take_the_torch_ops(monkeypatch):
    monkeypatch.setattr(window_advance, "ON_CPU", True)
    monkeypatch.setattr(window_advance, "launch", lambda *a: pytest.fail("the kernel must not run"))
    prev, ids, pos, seq, tables, slots = _step_inputs(8, 4, 16, seed=1)
    strided = torch.zeros(16, dtype=torch.int64)[::2]
    strided.copy_(prev)
    window_advance.advance_window_step(strided, ids, pos, seq, tables, slots, 16)
    assert torch.equal(ids, prev)


def test_engine_windows_with_the_kernel_match_the_torch_ops(tiny_model_root, monkeypatch):
    """Decode windows (graphs emulated on the CPU) with requests of different max_tokens, so rows go inert
    inside windows: the kernel's engine gives the tokens of the torch-ops engine."""
    path = build_tiny_model(tiny_model_root / "window_advance_qwen3", "qwen3", seed=5, num_layers=2)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 90 + 3 for j in range(3 + i)]} for i in range(6)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 2, 5, 7, 9, 12)]
    results = {}
    for on in (True, False):
        monkeypatch.setattr(window_advance, "ON_CPU", on)
        launches: list = []
        original = window_advance.launch
        monkeypatch.setattr(window_advance, "launch",
                            lambda k, g, o=original, seen=launches: seen.append(g) or o(k, g))
        llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8, decode_window=4)
        llm.runner.capture_cuda_graphs(emulate=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.runner.num_decode_windows > 0
        assert bool(launches) == on
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    assert results[True] == results[False]
    assert [len(t) for t, _ in results[True]] == [1, 2, 5, 7, 9, 12]


@pytest.mark.gpu
def test_gpu_windows_build_no_advance_kernel_after_construction(tiny_model_root):
    """Start-up builds the kernel's specialisations (with and without inert rows) ahead: a first generate
    whose windows meet both builds none of them, and its tokens equal the torch ops' engine."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = build_tiny_model(tiny_model_root / "window_advance_gpu_qwen3", "qwen3", seed=5, num_layers=2)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 90 + 3 for j in range(3 + i)]} for i in range(6)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 20, 33, 40, 41)]
    results = {}
    for on in (True, False):
        window_advance.KERNEL = on
        try:
            llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_memory=64 << 20)
            before = llm.kernel_compiles.count
            outs = llm.generate(prompts, params, use_tqdm=False)
            new = llm.kernel_compiles.count - before
            built = llm.kernel_compiles.recent[-new:] if new else []
            assert not any("_advance_kernel" in str(b) for b in built), built
            assert llm.runner.num_decode_windows > 0
            results[on] = [o.outputs[0].token_ids for o in outs]
            llm.shutdown()
        finally:
            window_advance.KERNEL = True
    assert results[True] == results[False]
