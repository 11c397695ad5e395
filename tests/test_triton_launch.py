"""Start-up kernel builds side by side (`runner.layers.triton_launch`).

The engine test builds real sm_90 kernels on the CPU: Triton compiles for a GPU target without one,
given a driver that names the target (`_FakeDriver`). It runs in a child process without
TRITON_INTERPRET (this suite's processes interpret kernels, and an interpreted kernel builds nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from runner.layers import triton_launch
from runner.layers.triton_launch import build_ahead, launch


class _Kernel:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append(("launch", grid, a, k))

    def warmup(self, *a, grid, **k):
        self.calls.append(("build", grid, a, k))


def test_launch_is_the_plain_launch_outside_build_ahead():
    kernel = _Kernel()
    launch(kernel, (3,))(1, 2, BLOCK=4)
    assert kernel.calls == [("launch", (3,), (1, 2), {"BLOCK": 4})]
    assert not triton_launch._BUILD_ONLY.get()


def test_build_ahead_stays_off_where_it_cannot_help(monkeypatch):
    kernel = _Kernel()
    for threads in (0, 1):
        with build_ahead(threads) as on:
            assert on is False and not triton_launch._BUILD_ONLY.get()
            launch(kernel, (1,))(7)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with build_ahead(4) as on:
        assert on is False
        launch(kernel, (1,))(8)
    monkeypatch.setattr(triton_launch, "_async_compile_mode", lambda: None)
    monkeypatch.delenv("TRITON_INTERPRET")
    with build_ahead(4) as on:
        assert on is False
    assert [c[0] for c in kernel.calls] == ["launch", "launch", "launch"]


def test_kernel_build_threads_default_to_the_usable_cores(monkeypatch, tiny_model_root):
    """`kernel_build_threads` (an engine option) defaults to the cores this process may run on, up to 8;
    a negative count is refused naming the option."""
    from bridge.tiny_models import build_tiny_model
    from runner.config import EngineConfig, usable_cores
    from runner.worker.model_states import load_hf_config

    path = build_tiny_model(tiny_model_root / "build_threads_qwen3", "qwen3", seed=5)
    hf = load_hf_config(path)
    assert EngineConfig(path, device="cpu").resolve(hf).kernel_build_threads == min(8, usable_cores())
    monkeypatch.setattr("runner.config.os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert EngineConfig(path, device="cpu").resolve(hf).kernel_build_threads == 2  # the affinity mask
    assert EngineConfig(path, device="cpu", kernel_build_threads=0).resolve(hf).kernel_build_threads == 0
    with pytest.raises(ValueError, match="kernel_build_threads"):
        EngineConfig(path, device="cpu", kernel_build_threads=-1).resolve(hf)


class _Param:
    def __init__(self, is_constexpr: bool) -> None:
        self.is_constexpr = is_constexpr


def test_build_ahead_hands_each_specialisation_to_triton_once(monkeypatch):
    """Triton files a build ahead only when the block ends, so a repeated launch (28 layers, every bucket)
    would pay its whole key computation again: `launch` skips what the block already handed over. Its
    key is finer than Triton's, never coarser: constexprs by value, other ints by width class, == 1 and
    divisibility by 16, tensors by dtype and 16-byte alignment."""
    import torch

    kernel = _Kernel()
    kernel.params = [_Param(False), _Param(False), _Param(True)]  # (x_ptr, n, BLOCK: constexpr)
    monkeypatch.setattr(triton_launch, "_async_compile_mode", lambda: _NoAsync)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(64)
    with build_ahead(2) as on:
        assert on
        for n in (32, 48, 64, 32):  # one class: not 1, divisible by 16
            launch(kernel, (n,))(x, n, 128)
        launch(kernel, (1,))(x, 1, 128)  # == 1: its own specialisation
        launch(kernel, (1,))(x, 33, 128)  # not divisible by 16
        launch(kernel, (1,))(x, 32, 64)  # another constexpr value
        launch(kernel, (1,))(x[1:], 32, 128)  # a misaligned pointer
        launch(kernel, (1,))(x.half(), 32, 128)  # another dtype
        launch(kernel, (1,))(x, 32, 128, num_warps=8)  # another launch option
        launch(kernel, (1,))(x, 32, 128, num_warps=8)
        launch(kernel, (1,))(x, 2**40, 128)  # a 64-bit int
    builds = [(c[2][1:], c[3]) for c in kernel.calls if c[0] == "build"]
    assert builds == [((32, 128), {}), ((1, 128), {}), ((33, 128), {}), ((32, 64), {}), ((32, 128), {}),
                      ((32, 128), {}), ((32, 128), {"num_warps": 8}), ((2**40, 128), {})]
    plain = _Kernel()  # parameters unknown: every argument by value
    with build_ahead(2):
        launch(plain, (1,))(x, 32)
        launch(plain, (1,))(x, 48)
        launch(plain, (1,))(x, 48)
        launch(plain, (1,))(x, {"unhashable": 1})  # not describable: always handed to Triton
        launch(plain, (1,))(x, {"unhashable": 1})
    assert [c[2][1] for c in plain.calls] == [32, 48, {"unhashable": 1}, {"unhashable": 1}]
    with build_ahead(2):  # a new block starts with nothing handed over
        launch(plain, (1,))(x, 32)
    assert len(plain.calls) == 5


class _NoAsync:
    """Stands in for Triton's AsyncCompileMode (its pool is not used by `_Kernel.warmup`)."""

    def __init__(self, pool, ignore_errors=False) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import torch, triton, triton.compiler
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class _FakeDriver:  # what Triton asks of a driver to bind and build (never to launch)
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self): return torch.device("cpu")

    driver.set_active(_FakeDriver())
    builds, names, running, peak, lock = [], [], [0], [0], threading.Lock()
    real_compile = triton.compiler.compile

    def counted_compile(*args, **kwargs):  # the binders pick this up: none exists yet
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return real_compile(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1
                builds.append(threading.current_thread().name)
                names.append(getattr(args[0] if args else kwargs.get("src"), "name", "?"))

    triton.compiler.compile = counted_compile

    from runner.layers import fused_layers, fused_linear, fused_ops, triton_launch
    from runner.layers.hf_attention import set_attention_backend
    from runner.llm import LLM
    from runner.worker import memory_profile
    from runner.worker.kernel_builds_ahead import build_startup_kernels
    from runner.worker.step_graphs import decode_graph_body, decode_graph_sizes, mixed_graph_body
    from runner.worker.cuda_graphs import mixed_graph_token_sizes

    torch.set_num_threads(1)
    llm = LLM(sys.argv[1], dtype="bfloat16", device="cpu", num_kv_blocks=32, max_num_seqs=4,
              max_num_batched_tokens=64, enable_prompt_embeds=True)
    runner = llm.runner
    from runner.layers.overlay_kernel import launch_overlay
    runner.prompt_embeds_state.use_triton, runner.prompt_embeds_state._launch = True, launch_overlay
    fused_layers.FUSED_LAYERS_ON_CPU = fused_layers.NORM_GEMM_ON_CPU = True
    fused_linear.SILU_MUL_ON_CPU = fused_ops.ROTARY_ON_CPU = True
    fused_linear.fuse_linears(runner.model)
    fused_layers.fuse_decoder_layers(runner.model)
    fused_ops.fuse_rmsnorms(runner.model)
    set_attention_backend("triton")
    runner.kernel_build_threads = 2
    from runner.worker.kernel_compiles import kernel_compiles
    compiles = kernel_compiles()
    started = time.perf_counter()
    on = build_startup_kernels(runner, graphs=True)
    ahead_s = time.perf_counter() - started
    ahead = list(builds)
    decode_sizes = decode_graph_sizes(runner)
    mixed_sizes = mixed_graph_token_sizes(runner.mixed_graph_max_tokens)

    # The same work again, building in place (no thread pool): every key is already in its
    # kernel's cache, so nothing more is built: the keys are the ones a launch looks up.
    runner.decode_graphs.allocate(decode_sizes, runner.vocab_size, 4, runner.device)
    token = triton_launch._BUILD_ONLY.set(set())
    with memory_profile.largest_step_on_scratch_cache(runner) as largest_step:
        runner.execute(largest_step())
    for tokens in mixed_sizes:
        mixed_graph_body(runner, tokens)()
    for b in decode_sizes:
        decode_graph_body(runner, b)()
    runner.prompt_embeds_state.build_kernel()
    triton_launch._BUILD_ONLY.reset(token)
    print("RESULT " + json.dumps({"on": on, "ahead": ahead, "after": builds[len(ahead):], "peak": peak[0],
                                  "names": names,
                                  "seconds": ahead_s, "buckets": [mixed_sizes, decode_sizes],
                                  "counted": compiles.count, "disk_cache_hits": compiles.disk_cache_hits}))
""")


def _child_result(script: str, model_dir, env: dict, tmp_path) -> dict:
    """Run `script` on `model_dir` in a child process with an empty Triton cache; its RESULT line's JSON."""
    env = {**env, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", script, str(model_dir)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"child failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def test_start_up_kernels_build_side_by_side_and_fill_the_launch_caches(tiny_model_root, tmp_path):
    from bridge.tiny_models import build_tiny_model

    path = build_tiny_model(tiny_model_root / "build_ahead_qwen3", "qwen3", seed=5, head_dim=32)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = _child_result(_CHILD, path, env, tmp_path)
    assert res["on"] is True
    # decode and prefill attention, the fused q/k/v + norm + rotary + KV write, gate/up + SiLU, ...
    assert len(res["ahead"]) >= 4, res
    assert all(name.startswith("triton-build") for name in res["ahead"]), res["ahead"]
    assert res["peak"] >= 2, res  # two builds ran at once
    assert res["buckets"] == [[16, 32, 64], [1, 2, 4]], res
    assert res["after"] == [], res  # nothing left for the profile step, the captures or the overlay to build
    assert "_overlay_kernel" in res["names"], res["names"]  # a step skips it while no request has embeds
    assert res["counted"] == len(res["ahead"]) and res["disk_cache_hits"] == 0, res  # all compiled
    again = _child_result(_CHILD, path, env, tmp_path)  # the same Triton cache, now filled
    assert again["counted"] == again["disk_cache_hits"] == len(again["ahead"]), again  # all loaded


_GPU_CHILD = textwrap.dedent("""
    import json, sys
    from runner.llm import LLM
    from runner.sampling_params import SamplingParams

    prompts = [[5 + i, 17, 3 * i + 2, 40, 9][: 3 + i % 3] for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(sys.argv[1], dtype="float32", device="cuda", kv_cache_memory=64 << 20, kernel_build_threads=4)
    phases = {k: list(v) for k, v in llm.runner.startup_phases.items()}
    graphed = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                            params, use_tqdm=False)]
    replays = llm.runner.num_graph_replays + llm.runner.num_mixed_graph_replays
    llm.shutdown()
    eager = LLM(sys.argv[1], dtype="float32", device="cuda", kv_cache_memory=64 << 20, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts],
                                                           params, use_tqdm=False)]
    print("RESULT " + json.dumps({"phases": phases, "graphed": graphed, "eager": want, "replays": replays}))
""")


@pytest.mark.gpu
def test_engine_with_kernels_built_ahead_captures_without_building_and_matches_eager(
    tiny_model_root, tmp_path
):
    """On a cold Triton cache with kernel_build_threads=4: the build-ahead phase builds the kernels
    of the profile step and the graph bodies, the profile and the captures (one warm-up each) build none,
    and greedy tokens equal eager ones."""
    from bridge.tiny_models import build_tiny_model

    path = build_tiny_model(tiny_model_root / "build_ahead_gpu_qwen3", "qwen3", seed=5, head_dim=32)
    res = _child_result(_GPU_CHILD, path, dict(os.environ), tmp_path)
    phases = res["phases"]
    assert phases["kernel_builds"][1] > 0, phases
    # the profile step and the captures met only kernels built ahead
    assert phases["profile"][1] == 0 and phases["decode_graphs"][1] == 0, phases
    assert phases.get("mixed_graphs", [0, 0])[1] == 0, phases
    assert res["replays"] > 0
    assert res["graphed"] == res["eager"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's case")
def test_build_startup_kernels_is_off_under_the_interpreter_and_leaves_the_runner_as_it_was(tiny_model_root):
    """Where build-ahead cannot run (here: TRITON_INTERPRET), the pass reports False and puts back what
    it borrowed: the KV cache, the step counter, the graph buffers."""
    from bridge.tiny_models import build_tiny_model
    from runner.llm import LLM
    from runner.worker.kernel_builds_ahead import build_startup_kernels

    path = build_tiny_model(tiny_model_root / "build_ahead_off_qwen3", "qwen3", seed=5)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=32, max_num_seqs=4,
              max_num_batched_tokens=64)
    runner = llm.runner
    runner.kernel_build_threads = 4
    caches, steps = runner.kv_caches, runner.num_forward_steps
    assert build_startup_kernels(runner, graphs=True) is False
    assert runner.kv_caches is caches and runner.num_forward_steps == steps
    assert runner.decode_graphs.logits is None and not runner.decode_graphs.graphs
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
