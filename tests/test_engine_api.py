"""The `LLM` API: prompt validation before scheduling, fail-fast model states, sampling options.

Everything runs on one tiny fp32 qwen3 model on the CPU. Expected values are derived from the
engine's own greedy run or from the Hugging Face model's logits, never hard-coded.
"""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_models import build_tiny_model, write_config_only_model
from runner.llm import LLM
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams

MAX_MODEL_LEN = 128


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("api_model") / "qwen3", "qwen3", seed=5)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=128,
               max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_all_free(llm: LLM) -> None:
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    assert llm.stats().num_free_slots == llm.stats().num_total_slots


# ----------------------------------------------------------------------------- validation

HIDDEN = 64
BAD_EMBEDS = {
    "1-D": lambda: {"prompt_embeds": torch.randn(HIDDEN)},
    "3-D": lambda: {"prompt_embeds": torch.randn(1, 4, HIDDEN)},
    "integer": lambda: {"prompt_embeds": torch.ones(4, HIDDEN, dtype=torch.int64)},
    "wrong hidden": lambda: {"prompt_embeds": torch.randn(4, HIDDEN + 1)},
    "NaN": lambda: {"prompt_embeds": torch.randn(4, HIDDEN).index_fill_(0, torch.tensor([2]), float("nan"))},
    "Inf": lambda: {"prompt_embeds": torch.randn(4, HIDDEN).index_fill_(0, torch.tensor([1]), float("inf"))},
    "too long": lambda: {"prompt_embeds": torch.randn(MAX_MODEL_LEN + 1, HIDDEN)},
    "empty": lambda: {"prompt_embeds": torch.randn(0, HIDDEN)},
    "mask length": lambda: {"prompt_embeds": torch.randn(4, HIDDEN),
                            "prompt_is_token_ids": torch.tensor([True, False, False])},
    "mask dtype": lambda: {"prompt_embeds": torch.randn(4, HIDDEN), "prompt_is_token_ids": torch.ones(4)},
    "mask without ids": lambda: {"prompt_embeds": torch.randn(4, HIDDEN),
                                 "prompt_is_token_ids": torch.tensor([True, False, False, False])},
    "not a tensor": lambda: {"prompt_embeds": [[0.0] * HIDDEN]},
    "token ids out of vocab": lambda: {"prompt_token_ids": [1, 10**7]},
    "too many tokens": lambda: {"prompt_token_ids": [5] * (MAX_MODEL_LEN + 1)},
    "empty token ids": lambda: {"prompt_token_ids": []},
    "unknown key": lambda: {"prompt": "hi", "images": [1]},
}


@pytest.mark.parametrize("kind", list(BAD_EMBEDS))
def test_bad_prompt_rejected_before_anything_is_scheduled(llm, kind):
    steps = llm.stats().num_steps
    good = {"prompt_embeds": torch.randn(3, HIDDEN)}
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([good, BAD_EMBEDS[kind](), good], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats().num_steps == steps  # not even the valid prompt 0 ran
    assert not llm.scheduler.has_unfinished()
    _assert_all_free(llm)


def test_embeds_rejected_without_enable_prompt_embeds(model_dir):
    plain = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        plain.generate([{"prompt_embeds": torch.randn(3, HIDDEN)}], use_tqdm=False)
    assert plain.stats().num_steps == 0


def test_prompt_logprobs_rejected_for_embeds_prompts(llm):
    steps = llm.stats().num_steps
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([{"prompt_token_ids": _ids(4)}, {"prompt_embeds": torch.randn(3, HIDDEN)}],
                     SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert llm.stats().num_steps == steps


@pytest.mark.parametrize("kind", ["t5", "bamba", "qwen3_next", "bert"])
def test_unsupported_model_kinds_fail_fast(tmp_path, kind):
    path = write_config_only_model(tmp_path / kind, kind)
    assert not any(path.glob("*.safetensors"))  # the check cannot have read weights: there are none
    with pytest.raises(ValueError, match="prompt embeddings") as info:
        LLM(path, enable_prompt_embeds=True)
    model_type = __import__("json").loads((path / "config.json").read_text())["model_type"]
    assert model_type in str(info.value)


# ----------------------------------------------------------------------------- API shape

def test_outputs_in_order_and_all_prompt_kinds(llm):
    prompts = ["hello world", {"prompt": "abc"}, {"prompt_token_ids": _ids(9, 1)},
               {"prompt_embeds": torch.randn(5, HIDDEN)}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=True)
    assert len(outs) == 4 and all(isinstance(o, RequestOutput) for o in outs)
    assert outs[0].prompt == "hello world"
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("hello world")
    assert outs[2].prompt_token_ids == _ids(9, 1)
    assert outs[3].prompt_token_ids == [0] * 5
    assert len({o.request_id for o in outs}) == 4
    for o in outs:
        assert o.finished and 1 <= len(o.outputs[0].token_ids) <= 3
        assert o.outputs[0].finish_reason in ("stop", "length")
    single = llm.generate("hello world", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    _assert_all_free(llm)


def test_per_prompt_sampling_params(llm):
    ids = _ids(6, 2)
    outs = llm.generate([{"prompt_token_ids": ids}] * 2,
                        [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                         SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    assert outs[1].outputs[0].token_ids[:2] == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([{"prompt_token_ids": ids}] * 2, [SamplingParams()], use_tqdm=False)


# ----------------------------------------------------------------------------- sampling

def test_max_tokens_and_ignore_eos(llm):
    ids = _ids(7, 3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    greedy = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert len(greedy.token_ids) == 6 and greedy.finish_reason == "length"

    # Make the first greedy token the EOS: without ignore_eos the request stops right there.
    saved = llm.eos_token_ids
    llm.eos_token_ids = [greedy.token_ids[0]]
    try:
        stopped = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=6, temperature=0),
                               use_tqdm=False)[0].outputs[0]
        ignored = llm.generate({"prompt_token_ids": ids},
                               SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    finally:
        llm.eos_token_ids = saved
    assert stopped.token_ids == greedy.token_ids[:1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == greedy.token_ids and ignored.finish_reason == "length"
    _assert_all_free(llm)


def test_stop_token_ids(llm):
    ids = _ids(8, 4)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    full = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[3]
    first = full.index(stop_id)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[: first + 1]  # the stop token is kept, like vLLM
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_stop_strings_trim_text(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": _ids(5, 6)}
    full = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    text = full.text
    # A two-character stop string from the middle of the generated text.
    candidates = [text[i : i + 2] for i in range(2, len(text) - 2)
                  if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]]
    assert candidates, f"generated text too short to pick a stop string from: {text!r}"
    stop = candidates[len(candidates) // 2]
    cut = text.index(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: cut + len(stop)] and kept.token_ids == out.token_ids  # vLLM's field
    _assert_all_free(llm)


def test_seeded_sampling_is_reproducible(llm):
    ids = _ids(6, 7)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": ids}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    # Same seed, other requests around it and at another batch position: the same tokens.
    crowd = llm.generate(
        [{"prompt_token_ids": _ids(11, 8)}, {"prompt_token_ids": ids}, {"prompt_token_ids": _ids(3, 9)}],
        [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), seeded,
         SamplingParams(max_tokens=8, temperature=0.7, seed=5, ignore_eos=True)],
        use_tqdm=False,
    )
    assert crowd[1].outputs[0].token_ids == alone
    others = [
        llm.generate({"prompt_token_ids": ids},
                     SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
        for s in (1, 2, 3)
    ]
    assert any(o != alone for o in others)  # the seed matters


def test_sampled_logprobs_match_hf(llm, hf_model):
    ids = _ids(10, 10)
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    seq = ids + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), dim=-1)
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + step]
        assert tok in entry and len(entry) >= 3
        assert entry[tok] == pytest.approx(row[tok].item(), abs=1e-4)
        top = row.topk(3)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[tid] == pytest.approx(lp, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_prompt_logprobs_for_token_prompts_across_chunks(llm, hf_model):
    ids = _ids(100, 11)  # longer than the 64-token step budget: computed over two chunks
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        assert out.prompt_logprobs[p][ids[p]] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
    _assert_all_free(llm)


def test_abort_frees_blocks_and_slots(llm):
    from runner.request import Request

    for i in range(3):
        llm.scheduler.add_request(Request(f"abort-{i}", i, _ids(40, i), SamplingParams(max_tokens=4)))
    out = llm.scheduler.schedule()  # admits the requests and gives them blocks and slots
    assert out.num_reqs > 0 and llm.stats().num_free_blocks < llm.stats().num_total_blocks
    for i in range(3):
        llm.scheduler.abort_request(f"abort-{i}")
    assert not llm.scheduler.has_unfinished()
    _assert_all_free(llm)


def test_failed_admission_frees_blocks_and_slots(llm, monkeypatch):
    """If the runner fails while admitting a request (say, out of device memory uploading its
    embeddings), `generate` raises that error and leaves every block and slot free."""
    state = llm.runner.prompt_embeds_state
    real_add = state.add_request

    def failing_add(slot, req_id, *args, **kwargs):
        real_add(slot, req_id, None)  # the slot is taken for the id, the upload then fails
        raise RuntimeError("simulated out of memory")

    monkeypatch.setattr(state, "add_request", failing_add)
    prompts = [{"prompt_token_ids": _ids(6, 1)}, {"prompt_embeds": torch.randn(5, HIDDEN)}]
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    _assert_all_free(llm)
    assert state.num_requests_with_embeds == 0
    monkeypatch.undo()
    out = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    _assert_all_free(llm)


def test_profile_step_leaves_the_engine_clean(llm):
    """The memory-profiling step (run at construction on the GPU) goes through `execute` with more
    tokens than one context holds; afterwards the engine generates exactly as before."""
    prompt = {"prompt_token_ids": _ids(12, 12)}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    steps = llm.stats().num_steps
    assert llm.runner.profile_peak_memory(force=True) == 0  # measured on CUDA only
    assert llm.stats().num_steps == steps
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before
    _assert_all_free(llm)


def test_window_tokens_stop_exactly_as_token_by_token():
    """`Request.append_window_tokens` (a decode window's tokens in one call) against append + check_stop per
    token: same tokens kept, same status and stop reason, over EOS, ignore_eos, stop ids, min_tokens,
    max_tokens and the context limit, with the stop anywhere in the window or past it."""
    import random

    from runner.request import Request

    rng = random.Random(0)
    for case in range(600):
        max_tokens = rng.randint(1, 12)
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(6), rng.randint(0, 2)),
            min_tokens=rng.randint(0, min(3, max_tokens)),
        )
        prompt = list(range(rng.randint(1, 5)))
        max_len = rng.choice([None, len(prompt) + rng.randint(1, 14)])
        kept_before = rng.randint(0, 2)
        window = [rng.randrange(8) for _ in range(rng.randint(1, 8))]

        slow, fast = (Request(f"r{case}", 0, prompt, params, eos_token_ids=frozenset({0, 7}),
                              max_model_len=max_len) for _ in range(2))
        for r in (slow, fast):
            r.output_token_ids.extend([6] * kept_before)  # 6 stops nothing
            r.num_tokens += kept_before
        if kept_before >= params.max_tokens or (max_len and len(prompt) + kept_before >= max_len):
            continue  # such a request finished before; it is never in a window
        n_slow = len(window)
        for n, token in enumerate(window, 1):
            slow.append_output_token(token)
            if slow.check_stop():
                n_slow = n
                break
        n_fast = fast.append_window_tokens(window)
        got = (n_fast, fast.output_token_ids, fast.status, fast.stop_reason, fast.num_tokens)
        want = (n_slow, slow.output_token_ids, slow.status, slow.stop_reason, slow.num_tokens)
        assert got == want, (case, params, window)


def test_output_texts_equal_the_tokenizers_decode(llm):
    """`generate`'s output texts (and the streamed ones) go through `fast_decode`, which skips HF's
    per-id input walk; each text equals the tokenizer's own `decode`."""
    from runner.request import fast_decode

    params = [SamplingParams(max_tokens=6, temperature=0.0, skip_special_tokens=i % 2 == 0) for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": _ids(9, i)} for i in range(4)], params, use_tqdm=False)
    for o, p in zip(outs, params):
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids,
                                                         skip_special_tokens=p.skip_special_tokens)
    assert fast_decode(llm.tokenizer)([], skip_special_tokens=True) == llm.tokenizer.decode(
        [], skip_special_tokens=True)


def test_requests_are_entities_equal_only_to_themselves():
    """The scheduler removes finished requests from its running list by `==`: a field-wise dataclass
    comparison cost ~1 us a compare (256 retirements from the back of W2's list: 39 ms of host time, the
    GPU idle). Two requests with the same fields are different requests."""
    from runner.request import Request
    from runner.sampling_params import SamplingParams

    def make():
        return Request(request_id="same", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(),
                       index=0)

    a, b = make(), make()
    assert a == a and a != b and len({a, b}) == 2
    running = [make() for _ in range(3)] + [a]
    running.remove(a)
    assert all(r is not a for r in running) and len(running) == 3


def test_engine_options_are_the_engine_configs_fields(model_dir):
    """`LLM(model, **options)` takes exactly EngineConfig's fields: a misspelt option is a TypeError naming
    the nearest field, before anything loads; `stats()` reports the resolved pool and slots."""
    import dataclasses

    from runner.config import EngineConfig

    with pytest.raises(TypeError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        LLM(model_dir, device="cpu", max_num_seq=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        LLM(model_dir, device="cpu", colour="blue")
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=3, num_kv_blocks=24)
    assert llm.engine_config.max_num_seqs == 3
    stats = llm.stats()
    assert (stats.num_total_slots, stats.num_total_blocks, stats.num_steps) == (3, 24, 0) and stats.all_free
    assert all(f.metadata.get("help") for f in dataclasses.fields(EngineConfig))
