"""Structured outputs (`SamplingParams(structured_outputs=StructuredOutputsParams(...))`) on the CPU.

A tiny random fp32 model samples at temperature 1, so nothing but the token masks keeps its outputs in
the grammar: 1,000 generations over twenty constraints (tests/structured_cases.py) must all finish by
the grammar and pass an independent check, from token-id, prompt-embeds and `<embeds>`-item prompts,
through the async path (sampling deferred until the token in flight is read) and the synchronous one.
Then: the same seeded tokens with async scheduling on and off, with decode windows and (emulated) graph
buckets, and for unconstrained neighbours; a bad constraint is a ValueError before anything is
scheduled; a grammar that cannot finish in max_tokens ends by length; EOS only once the grammar allows it.
"""

from __future__ import annotations

import time

import pytest
import torch
import xgrammar
from structured_cases import MAX_TOKENS, VOCAB_WORDS, cases, failures, run_suite

from bridge.tiny_models import build_tiny_model
from runner import StructuredOutputsParams
from runner.engine.structured_outputs import check_structured_outputs, choice_grammar
from runner.layers.token_mask import apply_token_mask, unpack_token_mask
from runner.llm import LLM
from runner.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
OPTIONS = dict(enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=1024,
               max_model_len=256, max_num_batched_tokens=512, max_num_seqs=128)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("structured") / "qwen3", "qwen3", seed=7,
                            vocab_words=VOCAB_WORDS)


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(model_dir, async_scheduling=True, **OPTIONS)
    yield engine
    engine.shutdown()


def _special_ids(llm) -> set[int]:
    return set(llm.tokenizer.all_special_ids)


def _assert_all_free(llm) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_free_slots == stats.num_total_slots


# ----------------------------------------------------------------------------- validity: 1,000 outputs
def test_a_thousand_sampled_outputs_are_all_valid(llm, model_dir):
    """20 constraints x 50 seeded samples at temperature 1: 680 from token-id and prompt-embeds prompts
    in one call with async scheduling (constrained steps defer their sampling), 320 from `<embeds>`-item
    prompts in one call of a synchronous engine."""
    start = time.perf_counter()
    eos = set(llm.eos_token_ids)
    results = run_suite(llm, ("ids", "embeds", "ids", "embeds", "ids", "embeds", "ids", "embeds", "ids",
                              "embeds", "ids", "embeds", "ids", "embeds", "ids", "embeds", "ids"), 34)
    assert llm.core.num_async_steps > 0 and llm.core.token_masks.num_filled_rows > 0
    sync = LLM(model_dir, async_scheduling=False, **OPTIONS)
    try:
        results += run_suite(sync, ("item",), 16, seed0=10_000)
        _assert_all_free(sync)
    finally:
        sync.shutdown()
    assert len(results) == 1000
    bad = failures(results, eos, _special_ids(llm))
    assert not bad, f"{len(bad)} invalid outputs, e.g. {bad[:5]}"
    assert {kind for _, kind, _ in results} == {"ids", "embeds", "item"}
    # Random weights still give varied outputs: the masks constrain, they do not fix the answer.
    texts = {name: set() for name, _, _ in cases()}
    for name, _, out in results:
        texts[name].add(out.text)
    assert all(len(t) > 1 for t in texts.values()), {k: v for k, v in texts.items() if len(v) <= 1}
    _assert_all_free(llm)
    print(f"1000 structured generations in {time.perf_counter() - start:.1f} s")


# ----------------------------------------------------------------------------- same tokens on every path
def _mixed_batch(llm, n: int = 12) -> tuple[list, list]:
    prompts, params = [], []
    g = torch.Generator().manual_seed(3)
    constraints = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                   StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{2}"),
                   StructuredOutputsParams(choice=["cat", "dog", "bird"]), None]
    for j in range(n):
        ids = torch.randint(20, 250, (4 + j,), generator=g).tolist()
        embeds = torch.randn(4 + j, 64, generator=g)
        prompts.append({"prompt_token_ids": ids} if j % 2 else {"prompt_embeds": embeds})
        so = constraints[j % len(constraints)]
        params.append(SamplingParams(max_tokens=24, temperature=0.0 if j % 3 == 0 else 1.0, seed=j,
                                     structured_outputs=so, ignore_eos=so is None))
    return prompts, params


def _tokens(llm, prompts, params) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]


def test_async_sync_windows_and_graphs_give_the_same_tokens(llm, model_dir):
    """Seeded and greedy requests, constrained and not, in one batch: the deferred-sampling async path,
    the synchronous one, and an engine with (emulated) graph buckets and decode windows agree; a
    constrained request never rides a window, an unconstrained batch still does; unconstrained requests
    get the tokens they get alone (the masks land on their own rows only)."""
    prompts, params = _mixed_batch(llm)
    deferred, background = llm.core.num_deferred_samples, llm.core.token_masks.num_background_fills
    want = _tokens(llm, prompts, params)
    assert llm.core.num_deferred_samples > deferred  # async steps sampled once their masks were filled
    # ... filled on the fill thread while the engine thread went on
    assert llm.core.token_masks.num_background_fills > background
    sync = LLM(model_dir, async_scheduling=False, **OPTIONS)
    graphed = LLM(model_dir, async_scheduling=True, decode_window=4,
                  **{**OPTIONS, "max_num_seqs": 16, "max_num_batched_tokens": 128})  # few buckets
    graphed.runner.capture_cuda_graphs(emulate=True)
    try:
        assert _tokens(sync, prompts, params) == want and sync.core.num_deferred_samples == 0
        windows = graphed.runner.num_decode_windows
        replays = graphed.runner.num_graph_replays
        assert _tokens(graphed, prompts, params) == want
        assert graphed.runner.num_graph_replays > replays  # single constrained steps still replay graphs
        alone = [(p, q) for p, q in zip(prompts, params) if q.structured_outputs is None]
        free = _tokens(graphed, [p for p, _ in alone], [q for _, q in alone])
        assert free == [w for w, q in zip(want, params) if q.structured_outputs is None]
        greedy = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)] * 2
        graphed.generate(prompts[:2], greedy)
        assert graphed.runner.num_decode_windows > windows  # unconstrained batches keep their windows
        _assert_all_free(graphed)
    finally:
        sync.shutdown()
        graphed.shutdown()


def test_preempted_constrained_request_resumes_its_grammar(model_dir, llm):
    """A pool so small that requests are preempted by recompute: the matchers keep their state (the
    tokens stay), and the outputs equal an unpreempted run's."""
    prompts, params = _mixed_batch(llm, 8)
    want = _tokens(llm, prompts, params)
    small = LLM(model_dir, **{**OPTIONS, "num_kv_blocks": 6, "max_num_batched_tokens": 64})
    try:
        assert _tokens(small, prompts, params) == want
        assert small.stats().num_preemptions > 0
        _assert_all_free(small)
    finally:
        small.shutdown()


def test_streaming_requests_are_constrained_too(llm):
    so = StructuredOutputsParams(choice=["yes", "no"])
    rid = llm.add_request({"prompt_token_ids": [30, 31, 32]}, SamplingParams(max_tokens=10, seed=4,
                                                                            structured_outputs=so))
    final = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final.outputs[0].text in ("yes", "no") and final.outputs[0].finish_reason == "stop"


# ----------------------------------------------------------------------------- ends
def test_max_tokens_too_small_ends_by_length(llm):
    so = StructuredOutputsParams(regex=r"[a-z]{12}")
    (out,) = llm.generate([{"prompt_token_ids": [40, 41]}], SamplingParams(max_tokens=3, seed=1,
                                                                           structured_outputs=so))
    comp = out.outputs[0]
    assert comp.finish_reason == "length" and len(comp.token_ids) == 3
    assert comp.text and comp.text.isalpha() and comp.text.islower()  # a prefix of the language


def test_eos_only_when_the_grammar_allows_it_and_the_grammar_ends_even_with_ignore_eos(llm):
    eos = set(llm.eos_token_ids)
    so = StructuredOutputsParams(choice=["cat", "dog"])
    outs = llm.generate([{"prompt_token_ids": [50 + j]} for j in range(16)],
                        [SamplingParams(max_tokens=20, seed=j, ignore_eos=True, structured_outputs=so)
                         for j in range(16)])
    for out in outs:
        comp = out.outputs[0]
        assert comp.text in ("cat", "dog") and comp.finish_reason == "stop" and comp.stop_reason is None
        assert comp.token_ids[-1] in eos and not set(comp.token_ids[:-1]) & eos


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("so", "field"), [
    (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}),
     "structured_outputs.json"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(grammar="start: UNDEFINED"), "structured_outputs.grammar"),
])
def test_bad_constraint_is_a_value_error_before_anything_is_scheduled(llm, so, field):
    steps = llm.stats().num_steps
    good = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=rf"^prompt 1: {field}: "):
        llm.generate([{"prompt_token_ids": [5, 6]}] * 3, [good, SamplingParams(structured_outputs=so), good])
    with pytest.raises(ValueError, match=rf"^prompt 0: {field}: "):
        llm.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(structured_outputs=so))
    with pytest.raises(ValueError, match=rf"^{field}: "):
        check_structured_outputs(so)
    assert llm.stats().num_steps == steps and not llm.scheduler.has_unfinished()
    _assert_all_free(llm)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of"),
    ({"json": SCHEMA, "regex": "a"}, "exactly one of"),
    ({"json": "{not json"}, r"structured_outputs.json is not valid JSON"),
    ({"json": 3}, "structured_outputs.json must be a JSON schema object"),
    ({"json": {"x": float("nan")}}, "structured_outputs.json must hold JSON data"),
    ({"choice": "cat"}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", 1]}, r"structured_outputs.choice\[1\]"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_bad_structured_outputs_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_dict_and_refuse_min_tokens():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert params.structured_outputs.to_dict() == {"choice": ["a", "b"]}
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})


def test_json_object_gives_an_object(llm):
    """Any JSON object; a random model rarely closes one within a few tokens, so only prefixes are
    checked unless it finished."""
    import json

    so = {"json_object": True, "disable_any_whitespace": True}
    outs = llm.generate([{"prompt_token_ids": [60 + j]} for j in range(8)],
                        [SamplingParams(max_tokens=40, seed=j, structured_outputs=so) for j in range(8)])
    for out in outs:
        comp = out.outputs[0]
        assert comp.text.startswith("{")
        if comp.finish_reason == "stop":
            assert isinstance(json.loads(comp.text), dict)


def _byte_token_ids(tokenizer) -> dict[int, int]:
    """Byte -> the id of the byte-level token that stands for it alone (GPT-2's byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {b: tokenizer.convert_tokens_to_ids(c) for b, c in chars.items()}


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 5}])
def test_json_strings_hold_valid_utf8_only(llm, schema):
    """xgrammar reads the bytes ED A0-BF (UTF-16 surrogates, never in UTF-8) as a character: a JSON string
    must refuse them, as it refuses other invalid UTF-8 (the text would decode to U+FFFD, and a maxLength
    would count it wrong), and still take 2-, 3- and 4-byte characters."""
    from runner.engine.structured_outputs import GrammarCompiler

    tok = llm.tokenizer
    byte = _byte_token_ids(tok)
    compiler = GrammarCompiler(tok, llm.runner.vocab_size, llm.eos_token_ids)
    compiled = compiler.compile(StructuredOutputsParams(json=schema))

    def accepts(data: bytes) -> bool:
        grammar = compiler.request_grammar(compiled, llm.eos_token_ids)
        return all(grammar.accept_token(byte[b]) for b in b'"' + data + b'"')

    for bad in (b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\x80"):
        assert not accepts(bad), bad
    for good in ("\u00e9", "\u20ac", "\U0001f600", "\ud7ff", "\ue000"):
        assert accepts(good.encode()), good


# ----------------------------------------------------------------------------- the mask op
def test_token_mask_matches_xgrammar():
    """The torch unpacking equals xgrammar's own CPU kernel, for every row or a subset; columns past the
    mask (a padded head) are disallowed."""
    g = torch.Generator().manual_seed(0)
    vocab = 77
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 3), generator=g, dtype=torch.int32)
    logits = torch.randn(5, vocab, generator=g)
    want = logits.clone()
    xgrammar.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
    got = logits.clone()
    apply_token_mask(got, bitmask, list(range(5)))
    assert torch.equal(got, want)
    rows = [4, 1]
    got = logits.clone()
    apply_token_mask(got, bitmask[:2], rows)
    full = torch.full((5, 3), -1, dtype=torch.int32)  # every token allowed on the other rows
    full[4], full[1] = bitmask[0], bitmask[1]
    want = logits.clone()
    xgrammar.apply_token_bitmask_inplace(want, full, vocab_size=vocab)
    assert torch.equal(got, want)
    wide = unpack_token_mask(torch.full((1, 1), -1, dtype=torch.int32), 40)
    assert wide[0, :32].all() and not wide[0, 32:].any()


def test_choice_grammar_escapes():
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == 'root ::= "a\\"b" | "c\\\\d" | "e\\nf"'
    assert MAX_TOKENS >= 64


def test_threaded_mask_fill_equals_the_loop(llm, monkeypatch):
    """Many constrained rows on a machine with cores to spare: xgrammar's threaded batch fill, the same
    tokens as the one-by-one fill."""
    masks = llm.core.token_masks
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompts = [{"prompt_token_ids": [70 + j, 71]} for j in range(12)]
    params = [SamplingParams(max_tokens=32, seed=j, structured_outputs=so) for j in range(12)]
    monkeypatch.setattr(masks, "_threads", 1)
    loop = _tokens(llm, prompts, params)
    monkeypatch.setattr(masks, "_threads", 2)
    assert _tokens(llm, prompts, params) == loop
    assert masks._batch is not None


def test_changed_eos_ids_end_constrained_outputs(model_dir):
    """`llm.eos_token_ids = ...` (a chat model's end-of-turn id, say): the grammar's end is then that id."""
    engine = LLM(model_dir, **OPTIONS)
    try:
        new_eos = engine.tokenizer.convert_tokens_to_ids("<pad>")
        engine.eos_token_ids = [new_eos]
        so = StructuredOutputsParams(choice=["yes", "no"])
        params = [SamplingParams(max_tokens=12, seed=j, structured_outputs=so) for j in range(6)]
        outs = engine.generate([{"prompt_token_ids": [80 + j]} for j in range(6)], params)
        for out in outs:
            comp = out.outputs[0]
            assert comp.text in ("yes", "no") and comp.finish_reason == "stop"
            assert comp.token_ids[-1] == new_eos
    finally:
        engine.shutdown()
