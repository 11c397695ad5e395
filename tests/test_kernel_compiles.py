"""The Triton build counter (runner/worker/kernel_compiles.py): counts and times builds through
Triton's runtime hooks, and keeps hooks installed before it working.

Triton under TRITON_INTERPRET (the CPU suite) builds nothing, so the hooks are driven here the way
`JITFunction._do_compile` drives them: the cache hook before a build, the post-compile hook after."""

from __future__ import annotations

import time

import pytest
import torch

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from runner.worker import kernel_compiles as kc  # noqa: E402


def test_builds_are_counted_timed_and_earlier_hooks_still_run(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("cache", kw["key"])))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("post", kw["key"])))
    monkeypatch.setattr(kc, "_COMPILES", None)
    counter = kc.kernel_compiles()
    assert counter is not None and kc.kernel_compiles() is counter  # installed once

    class Fn:
        name = "my_kernel"

    for key in ("a", "b"):
        assert knobs.runtime.jit_cache_hook(key=key, fn=Fn()) is None  # None: build it
        time.sleep(0.01)
        knobs.runtime.jit_post_compile_hook(key=key, fn=Fn())
    assert counter.count == 2 and counter.seconds >= 0.02
    assert [name for name, _ in counter.recent] == ["my_kernel", "my_kernel"]
    assert seen == [("cache", "a"), ("post", "a"), ("cache", "b"), ("post", "b")]


def test_a_cpu_engine_does_not_install_it(tiny_model_root):
    from bridge.tiny_models import build_tiny_model
    from runner.llm import LLM

    model = build_tiny_model(tiny_model_root / "compiles_qwen3", "qwen3", seed=3)
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=32)
    assert llm.kernel_compiles is None and llm.kernel_compiles_at_ready == 0
    llm.shutdown()


@pytest.mark.gpu
def test_gpu_varied_batches_after_a_first_one_build_no_kernels(tiny_model_root):
    """What a server meets: batches of every size and mix of prefill lengths. After one such batch,
    another with other sizes must not build kernels (a build stalls a step for up to seconds). The
    batch-size-dependent constexprs (the prefill search block, the decode split count) are gone or
    powers of two for this; a failure lists the kernels built."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from bridge.tiny_models import build_tiny_model
    from runner.llm import LLM
    from runner.sampling_params import SamplingParams

    model = build_tiny_model(tiny_model_root / "compiles_gpu_qwen3", "qwen3", seed=4,
                             max_position_embeddings=1024)
    llm = LLM(model, dtype="bfloat16", enable_prompt_embeds=True, num_kv_blocks=1024, max_num_seqs=64,
              max_num_batched_tokens=2048)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def batch(n: int, low: int, high: int) -> list:
        lens = torch.randint(low, high, (n,), generator=g).tolist()
        return [{"prompt_token_ids": torch.randint(3, 100, (k,), generator=g).tolist()} for k in lens]

    llm.generate(batch(40, 20, 600), params, use_tqdm=False)
    before = llm.kernel_compiles.count
    for n in (3, 7, 13, 29, 50):
        llm.generate(batch(n, 5, 700), params, use_tqdm=False)
    built = llm.kernel_compiles.count - before
    assert built == 0, f"{built} kernels built: {llm.kernel_compiles.recent[-built:]}"
    llm.shutdown()
