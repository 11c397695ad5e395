"""Realtime input on the GPU gives the CPU's tokens and chunk positions (issue 35): one request, a chunk
appended after the 3rd and the 7th `step()`, under the GPU defaults (CUDA graphs, 32-step decode windows
pipelined and behind steps), async scheduling off and forced on (multimodal input turns it off by
default, and `async_scheduling=True` with an encoder is refused, so the engine's flag is set directly),
chunked prefill, prefix caching and enforce_eager. Both engines run in fp32 on the same tiny model, so
greedy tokens compare exactly (tests/test_engine_correctness.py holds the GPU's fp32 tokens, graphs and
fused kernels included, equal to Hugging Face's on the CPU). Then an input closed after the 7th call
finishes in decode windows with the CPU's tokens. Skipped without CUDA."""

from __future__ import annotations

import pytest
from realtime_scenario import CHUNKS, PROMPT_IDS, build, drive

from bridge.tiny_models import build_tiny_model
from runner.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:async scheduling turned off"),
]

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
GPU_OPTIONS = {
    "defaults": dict(),
    "async_off": dict(async_scheduling=False),
    "async_forced": dict(force_async=True),
    "chunked_prefill": dict(max_num_batched_tokens=4),
    "prefix_caching": dict(enable_prefix_caching=True, block_size=4),
    "enforce_eager": dict(enforce_eager=True),
    "everything": dict(force_async=True, max_num_batched_tokens=4, enable_prefix_caching=True, block_size=4),
}
#: options that change how the CPU's plain loop schedules the request (not only how fast it runs)
SCHEDULING = ("max_num_batched_tokens", "enable_prefix_caching", "block_size")


#: where the engine under test runs (a CPU smoke run of this file sets "cpu" and emulates the graphs)
DEVICE = "cuda"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("rt_gpu") / "qwen2", "qwen2", seed=8)


def _cpu_traces(model_dir, options: dict, runs: int, params: SamplingParams = PARAMS,
                close_after: int | None = None) -> list:
    """The CPU's plain loop (fp32, no graphs, no windows, synchronous) with the scheduling options only."""
    scheduling = {k: v for k, v in options.items() if k in SCHEDULING}
    cpu = build(model_dir, "cpu", dtype="float32", num_kv_blocks=64, **scheduling)
    return [drive(cpu, params, close_after=close_after) for _ in range(runs)]


@pytest.mark.parametrize("name", list(GPU_OPTIONS))
def test_gpu_realtime_tokens_and_chunk_positions_equal_the_cpus(name, model_dir):
    options = GPU_OPTIONS[name]
    runs = 2 if options.get("enable_prefix_caching") else 1  # the second run reads cached prompt blocks
    gpu = build(model_dir, DEVICE, dtype="float32", num_kv_blocks=64, **options)
    graphs = not options.get("enforce_eager")
    if graphs:
        assert gpu.runner.graphs and gpu.decode_window == 32
    for got, want in zip([drive(gpu, PARAMS) for _ in range(runs)], _cpu_traces(model_dir, options, runs)):
        assert got.idle_between_calls
        assert len(got.offsets) == len(CHUNKS) and want.offsets[0] > len(PROMPT_IDS)
        assert (got.counts, got.offsets) == (want.counts, want.offsets)
        assert got.tokens == want.tokens
    assert gpu.core.num_async_steps == 0 and gpu.runner.num_decode_windows == 0
    assert gpu.mm.num_decode_gathers > 0
    assert (gpu.runner.num_graph_replays > 0) == graphs
    if options.get("enable_prefix_caching"):
        assert gpu.block_manager.num_hit_blocks > 0
    assert gpu.stats().all_free


def test_gpu_input_closed_mid_run_finishes_in_windows_with_the_cpus_tokens(model_dir):
    """With the GPU defaults (async scheduling stays off with an encoder: forced on, it would overlap the
    closed request's remaining chunk gathers, which the runner does not support with multimodal input)."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    gpu = build(model_dir, DEVICE, dtype="float32", num_kv_blocks=64)
    got = drive(gpu, params, close_after=7)
    (want,) = _cpu_traces(model_dir, {}, 1, params, close_after=7)
    assert got.counts[:7] == want.counts[:7] == list(range(1, 8))
    assert got.offsets == want.offsets and got.tokens == want.tokens
    assert max(b - a for a, b in zip(got.counts, got.counts[1:])) > 1  # full speed after the close
    assert gpu.runner.num_decode_windows > 0 and not gpu.core.has_open_inputs
