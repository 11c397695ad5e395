"""`LLM(async_scheduling=...)` (issue 4): step n+1 is planned and launched while step n runs, with the
same outputs as the synchronous loop (tokens, text, finish and stop reasons, logprobs) over a mixed batch,
chunked prefill, a pool small enough to preempt, and the context limit; all blocks and slots free after.
With multimodal input an explicit request is a ValueError and the default turns it off with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import IdentityEncoder

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("async") / "qwen3", "qwen3", seed=2)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [
        {"prompt_token_ids": torch.randint(10, 200, (n,), generator=g).tolist()} for n in (3, 9, 17)
    ] + [{"prompt_embeds": torch.randn(n, 64, generator=g) * 0.5} for n in (5, 12)]


def test_async_on_for_token_and_embeds_prompts_same_tokens(model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on = LLM(model_dir, enable_prompt_embeds=True, async_scheduling=True, device="cpu", num_kv_blocks=64)
        default = LLM(model_dir, enable_prompt_embeds=True, device="cpu", num_kv_blocks=64)
    off = LLM(model_dir, enable_prompt_embeds=True, async_scheduling=False, device="cpu", num_kv_blocks=64)
    assert on.async_scheduling and default.async_scheduling and not off.async_scheduling
    got = [o.outputs[0].token_ids for o in on.generate(_prompts(), GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in off.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert got == want


def test_async_with_encoders_explicit_is_error_default_warns(model_dir):
    with pytest.raises(ValueError, match="async scheduling"):
        LLM(model_dir, encoders={"image": IdentityEncoder("image")}, async_scheduling=True, device="cpu",
            num_kv_blocks=16)
    with pytest.warns(UserWarning, match="async scheduling turned off"):
        llm = LLM(model_dir, encoders={"image": IdentityEncoder("image")}, device="cpu", num_kv_blocks=16)
    assert llm.async_scheduling is False


def test_async_then_multimodal_prompt(model_dir):
    item = {"prompt": "red <embeds>", "multi_modal_data": {"prompt_embeds": [torch.ones(2, 64)]}}
    explicit = LLM(model_dir, enable_prompt_embeds=True,
                   async_scheduling=True, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="async scheduling"):
        explicit.generate(["text", item], GREEDY, use_tqdm=False)
    assert explicit.stats().num_steps == 0
    with pytest.raises(ValueError, match="async scheduling"):
        explicit.register_encoder(IdentityEncoder("image"))
    default = LLM(model_dir, enable_prompt_embeds=True, device="cpu", num_kv_blocks=16)
    with pytest.warns(UserWarning, match="async scheduling turned off"):
        out = default.generate(item, GREEDY, use_tqdm=False)
    assert default.async_scheduling is False and len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


# ------------------------------------------------------------------------------- async == sync


def _mixed_prompts():
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(11, 260, (n,), generator=g).tolist() for n in (3, 9, 17, 6, 12, 5, 40, 8, 21, 4, 47)]
    embeds = [torch.randn(n, 64, generator=g) * 0.5 for n in (5, 14)]
    return [{"prompt_token_ids": i} for i in ids] + [{"prompt_embeds": e} for e in embeds]


def _mixed_params(stop_string: str, stop_id: int) -> list[SamplingParams]:
    """One entry per prompt of `_mixed_prompts`: every feature async scheduling must keep."""
    sp = SamplingParams
    return [
        sp(max_tokens=12, temperature=0.0, ignore_eos=True),                       # greedy
        sp(max_tokens=10, temperature=0.9, seed=7),                                # seeded sampling
        sp(max_tokens=10, temperature=1.2, top_k=5, top_p=0.8, seed=11),           # top-k / top-p
        sp(max_tokens=12, temperature=0.0, stop=[stop_string]),                    # stop string
        sp(max_tokens=10, temperature=0.9, seed=5, stop_token_ids=[stop_id]),      # stop id
        sp(max_tokens=1, temperature=0.0),                                         # one token
        sp(max_tokens=12, temperature=1.0, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
           frequency_penalty=0.4, logprobs=2),                                     # penalties, sampled
        sp(max_tokens=9, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),  # penalties, greedy
        sp(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=2),          # logprobs
        sp(max_tokens=8, temperature=0.8, seed=9, min_tokens=4, stop_token_ids=[stop_id], logprobs=0),
        sp(max_tokens=12, temperature=0.0, ignore_eos=True),                       # fills the context
        sp(max_tokens=10, temperature=0.0, ignore_eos=True),                       # prompt embeds
        sp(max_tokens=10, temperature=0.7, seed=13, stop=[stop_string]),           # prompt embeds, seeded
    ]


@pytest.fixture(scope="module")
def stops(model_dir, one_cpu_thread):
    """A stop string and a stop id that the batch's requests really produce (read off a probe run)."""
    llm = LLM(model_dir, enable_prompt_embeds=True, async_scheduling=False, device="cpu", num_kv_blocks=128)
    probe = _mixed_params("\x00never", -1)
    outs = llm.generate(_mixed_prompts(), probe, use_tqdm=False)
    text = outs[3].outputs[0].text
    # A printable character first seen after the start, so the stop hits mid-generation.
    later = [c for i, c in enumerate(text) if i and c.isascii() and c.isprintable() and c not in text[:i]]
    assert later, f"the probe's greedy text has no printable character after its first: {text!r}"
    return later[0], outs[4].outputs[0].token_ids[3]


def _summary(out):
    c = out.outputs[0]
    return (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob,
            out.prompt_logprobs)


def _same_logprobs(a, b) -> bool:
    """Same token ids everywhere; values equal up to float noise (a request may share its steps
    with other requests under async scheduling, and a matmul's rows may round differently)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, float):
        return b == pytest.approx(a, abs=1e-4)
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and x.keys() == y.keys()
                                      and all(y[k] == pytest.approx(x[k], abs=1e-5) for k in x))
        for x, y in zip(a, b))


CONFIGS = {
    "roomy": dict(num_kv_blocks=128),
    "chunked_prefill": dict(num_kv_blocks=128, max_num_batched_tokens=16),
    "preempting": dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=32),
    "context_limit": dict(num_kv_blocks=128, max_model_len=47),
}


def _compare(model_dir, stops, device, **engine):
    params = _mixed_params(*stops)
    outs, llms = {}, {}
    for mode in (False, True):
        llm = LLM(model_dir, enable_prompt_embeds=True, async_scheduling=mode, device=device, **engine)
        outs[mode] = [_summary(o) for o in llm.generate(_mixed_prompts(), params, use_tqdm=False)]
        assert llm.stats().all_free
        llms[mode] = llm
    for i, (want, got) in enumerate(zip(outs[False], outs[True])):
        assert got[:4] == want[:4], f"request {i} ({params[i]}): tokens, text or finish differ under async"
        assert all(_same_logprobs(w, g) for w, g in zip(want[4:], got[4:])), f"request {i}: logprobs differ"
    return outs[False], llms[False], llms[True]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_async_matches_sync(model_dir, stops, name, one_cpu_thread):
    want, sync, llm = _compare(model_dir, stops, "cpu", **CONFIGS[name])
    # The steps really overlapped: launched with a step in flight, input ids fed on the device.
    assert llm.stats().num_async_steps > 0 and llm.runner.num_fed_tokens > 0
    assert sync.stats().num_async_steps == 0 and sync.runner.num_fed_tokens == 0
    # The batch exercises what it claims to.
    reasons = {r[3] for r in want}
    assert stops[0] in reasons and stops[1] in reasons
    if name == "preempting":
        assert llm.stats().num_preemptions > 0 and sync.stats().num_preemptions > 0
    if name == "chunked_prefill":
        assert llm.scheduler.num_partial_prefills > 0
    if name == "context_limit":
        assert len(want[6][0]) == 47 - 40 and want[6][2] == "length" and len(want[10][0]) == 1
    if name == "roomy":  # a stop at step n discarded the request's step n+1 output
        assert llm.scheduler.num_discarded_tokens > 0


def test_async_default_runs_overlapped(model_dir, one_cpu_thread):
    llm = LLM(model_dir, enable_prompt_embeds=True, device="cpu", num_kv_blocks=64)
    llm.generate(_prompts(), SamplingParams(max_tokens=6, temperature=0.8, seed=1), use_tqdm=False)
    assert llm.async_scheduling and llm.stats().num_async_steps > 0
    assert llm.stats().all_free


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_async_matches_sync_cuda(model_dir, stops, enforce_eager):
    for engine in CONFIGS.values():
        _, _, llm = _compare(model_dir, stops, "cuda", dtype="float32", enforce_eager=enforce_eager, **engine)
        assert llm.stats().num_async_steps > 0 and llm.runner.num_fed_tokens > 0
