"""vLLM's request fields on `bridge serve`: each is honoured (equal to the same model offline) or refused
with a 400 naming it; an unknown field is logged once by name. One shared server (conftest.py)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from serve_helpers import API_KEY

from bridge import encode_prompt_embeds
from bridge.backends.completions import parse_logprobs
from runner.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "max_tokens": 8}
TEXT = "the red circle"


@pytest.fixture(scope="module")
def http(text_server):
    with httpx.Client(base_url=text_server.url, headers=text_server.headers, timeout=60) as client:
        yield client


def _post(http, route: str, **body) -> dict:
    r = http.post(route, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _refused(http, route: str, field: str, **body) -> str:
    r = http.post(route, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error
    return error["message"]


def _offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def _chat(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def _stream(http, route: str, **body) -> list[dict]:
    chunks = []
    with http.stream("POST", route, json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_prompt_logprobs_equal_the_engine_and_are_refused_where_vllm_refuses(http, offline_llm, text_server):
    ids = offline_llm.tokenizer.encode(TEXT)
    want = _offline(offline_llm, {"prompt_token_ids": ids}, max_tokens=1, temperature=0.0, prompt_logprobs=2)
    got = _post(http, "/v1/completions", prompt=TEXT, max_tokens=1, temperature=0.0, prompt_logprobs=2)
    rows = got["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None and want.prompt_logprobs[0] is None
    for pos, (row, entry) in enumerate(zip(rows[1:], want.prompt_logprobs[1:]), 1):
        assert {int(t): v["logprob"] for t, v in row.items()} == pytest.approx(entry, abs=1e-4)
        assert str(ids[pos]) in row  # the prompt's own token is always there
        by_value = sorted(row.values(), key=lambda v: -v["logprob"])
        ranked = [v["rank"] for v in by_value if v["rank"] is not None]
        assert ranked == list(range(1, len(ranked) + 1)) and len(ranked) >= 2
        token = offline_llm.tokenizer.decode([ids[pos]])
        assert row[str(ids[pos])]["decoded_token"] == token

    chat = _post(http, "/v1/chat/completions", messages=_chat(TEXT), max_tokens=1, prompt_logprobs=0)
    assert chat["prompt_logprobs"][0] is None and all(len(r) == 1 for r in chat["prompt_logprobs"][1:])
    embeds = encode_prompt_embeds(torch.randn(4, 64))
    _refused(http, "/v1/completions", "prompt_logprobs", prompt="", prompt_embeds=embeds, prompt_logprobs=1)
    _refused(http, "/v1/chat/completions", "prompt_logprobs", prompt_logprobs=1, max_tokens=2,
             messages=_chat([{"type": "prompt_embeds", "data": embeds}]))
    _refused(http, "/v1/completions", "prompt_logprobs", prompt=TEXT, prompt_logprobs=1, stream=True)
    _refused(http, "/v1/completions", "prompt_logprobs", prompt=TEXT, prompt_logprobs=21)
    _refused(http, "/v1/completions", "prompt_logprobs", prompt=TEXT, prompt_logprobs=-1)
    text_server.wait_idle()


def test_include_stop_str_in_output_keeps_the_stop_string(http, offline_llm, text_server):
    full = _offline(offline_llm, TEXT, max_tokens=12, temperature=0.0, ignore_eos=True).outputs[0].text
    stop = full[3:6]  # a stop string the greedy answer reaches after its first characters
    assert len(stop) == 3 and full.find(stop) == 3, full
    body = {"prompt": TEXT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}
    cut = _post(http, "/v1/completions", **body)["choices"][0]
    kept = _post(http, "/v1/completions", include_stop_str_in_output=True, **body)["choices"][0]
    assert cut["text"] == full[:3] and kept["text"] == full[:6]
    assert cut["stop_reason"] == kept["stop_reason"] == stop
    streamed = _stream(http, "/v1/completions", include_stop_str_in_output=True, **body)
    assert "".join(c["choices"][0]["text"] for c in streamed) == full[:6]
    chat = _post(http, "/v1/chat/completions", messages=_chat(TEXT), include_stop_str_in_output=True, **{
        k: v for k, v in body.items() if k != "prompt"})
    assert chat["choices"][0]["message"]["content"].endswith(stop)
    text_server.wait_idle()


def test_echo_prepends_the_prompt_and_its_logprobs(http, offline_llm, text_server):
    ids = offline_llm.tokenizer.encode(TEXT)
    want = _offline(offline_llm, {"prompt_token_ids": ids}, prompt_logprobs=1, logprobs=1, **GREEDY)
    got = _post(http, "/v1/completions", prompt=TEXT, echo=True, **GREEDY)["choices"][0]
    assert got["text"] == TEXT + want.outputs[0].text

    tokens = [7, 30, 41]
    decoded = offline_llm.tokenizer.decode(tokens)
    got = _post(http, "/v1/completions", prompt=tokens, echo=True, **GREEDY)["choices"][0]
    assert got["text"].startswith(decoded) and len(got["text"]) > len(decoded)

    got = _post(http, "/v1/completions", prompt=TEXT, echo=True, logprobs=1, **GREEDY)["choices"][0]
    lp = got["logprobs"]
    n_out = len(want.outputs[0].token_ids)
    assert len(lp["tokens"]) == len(ids) + n_out
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        assert lp["token_logprobs"][pos] == pytest.approx(want.prompt_logprobs[pos][ids[pos]], abs=1e-4)
    assert lp["token_logprobs"][len(ids):] == pytest.approx(
        [e[t] for t, e in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)], abs=1e-4)
    assert "".join(lp["tokens"][:len(ids)]) == TEXT and got["text"].startswith(TEXT)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]

    # max_tokens 0: the prompt alone, its logprobs alone (lm-eval's loglikelihood request)
    got = _post(http, "/v1/completions", prompt=TEXT, echo=True, logprobs=0, max_tokens=0, temperature=0.0)
    assert got["choices"][0]["text"] == TEXT and len(got["choices"][0]["logprobs"]["tokens"]) == len(ids)
    streamed = _stream(http, "/v1/completions", prompt=TEXT, echo=True, logprobs=1, **GREEDY)
    assert "".join(c["choices"][0]["text"] for c in streamed) == TEXT + want.outputs[0].text
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in streamed) == len(ids) + n_out

    _refused(http, "/v1/completions", "max_tokens", prompt=TEXT, max_tokens=0)
    _refused(http, "/v1/completions", "echo", prompt="", echo=True,
             prompt_embeds=encode_prompt_embeds(torch.randn(3, 64)))
    # chat: the answer continues the last assistant message
    reply = _post(http, "/v1/chat/completions", echo=True, add_generation_prompt=False, **GREEDY,
                  messages=[{"role": "user", "content": TEXT}, {"role": "assistant", "content": "a red"}])
    assert reply["choices"][0]["message"]["content"].startswith("a red")
    text_server.wait_idle()


def test_return_token_ids_gives_prompt_and_output_ids(http, offline_llm, text_server):
    ids = offline_llm.tokenizer.encode(TEXT)
    want = _offline(offline_llm, {"prompt_token_ids": ids}, **GREEDY).outputs[0]
    one = _post(http, "/v1/completions", prompt=TEXT, return_token_ids=True, **GREEDY)["choices"][0]
    assert one["prompt_token_ids"] == ids and one["token_ids"] == want.token_ids
    embeds = torch.randn(5, 64)
    both = _post(http, "/v1/completions", prompt=TEXT, prompt_embeds=encode_prompt_embeds(embeds),
                 return_token_ids=True, **GREEDY)["choices"]
    assert both[0]["prompt_token_ids"] == [0] * 5 and both[1]["prompt_token_ids"] == ids  # vLLM's zeros

    # chat: the rendered conversation's ids at the top (the test template renders the content alone)
    chat = _post(http, "/v1/chat/completions", messages=_chat(TEXT), return_token_ids=True, **GREEDY)
    assert chat["prompt_token_ids"] == offline_llm.tokenizer.encode(TEXT, add_special_tokens=False)
    assert chat["choices"][0]["token_ids"] == want.token_ids
    chunks = _stream(http, "/v1/chat/completions", messages=_chat(TEXT), return_token_ids=True, **GREEDY)
    with_ids = [c for c in chunks if c.get("prompt_token_ids") is not None]
    assert len(with_ids) == 1 and with_ids[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == want.token_ids
    chunks = _stream(http, "/v1/completions", prompt=TEXT, return_token_ids=True, **GREEDY)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids
    text_server.wait_idle()


def test_tokens_as_token_ids_read_back_by_the_remote_backend(http, offline_llm, text_server):
    want = _offline(offline_llm, TEXT, logprobs=2, **GREEDY).outputs[0]
    got = _post(http, "/v1/completions", prompt=TEXT, logprobs=2, return_tokens_as_token_ids=True, **GREEDY)
    lp = got["choices"][0]["logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"])
    rows = parse_logprobs(lp)
    assert [max(r, key=r.get) for r in rows] == want.token_ids
    text_server.wait_idle()


def test_prompt_embeds_content_part_in_vllm_spelling(http, offline_llm, text_server):
    rows = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))
    payload = encode_prompt_embeds(rows)
    vllm = _post(http, "/v1/chat/completions", messages=_chat([{"type": "prompt_embeds", "data": payload}]),
                 **GREEDY)
    bridge = _post(http, "/v1/chat/completions",
                   messages=_chat([{"type": "prompt_embeds", "prompt_embeds": payload}]), **GREEDY)
    want = _offline(offline_llm, {"prompt_embeds": rows}, **GREEDY).outputs[0].text
    assert vllm["choices"][0]["message"]["content"] == bridge["choices"][0]["message"]["content"] == want
    r = http.post("/v1/chat/completions", json={
        "messages": _chat([{"type": "prompt_embeds", "data": payload, "prompt_embeds": payload}])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    text_server.wait_idle()


def test_refusals_name_the_field(http, text_server):
    routes = (("/v1/completions", {"prompt": TEXT}), ("/v1/chat/completions", {"messages": _chat(TEXT)}))
    for route, extra in routes:
        message = _refused(http, route, "guided_regex", guided_regex="a+", **extra)
        assert "structured_outputs" in message  # vLLM's older name: the field to use instead
        _refused(http, route, "stream_options", stream_options={"include_usage": True}, **extra)
        _refused(http, route, "seed", seed=2**63, **extra)
        _refused(http, route, "seed", seed=-(2**63) - 1, **extra)
        _refused(http, route, "min_p", min_p=0.1, **extra)
        _refused(http, route, "logit_bias", logit_bias={"5": 10}, **extra)
        _refused(http, route, "use_beam_search", use_beam_search=True, **extra)
        # the same fields asking for nothing are accepted, and a seed at int64's ends is one
        _post(http, route, response_format={"type": "text"}, min_p=0, logit_bias={}, use_beam_search=False,
              seed=-(2**63), max_tokens=2, **extra)
        _post(http, route, seed=2**63 - 1, max_tokens=2, **extra)
    _refused(http, "/v1/chat/completions", "tools", messages=_chat(TEXT),
             tools=[{"type": "function", "function": {"name": "f"}}])
    _refused(http, "/v1/chat/completions", "continue_final_message", messages=_chat(TEXT),
             continue_final_message=True)
    _refused(http, "/v1/chat/completions", "messages[0].tool_calls",
             messages=[{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}])
    text_server.wait_idle()


def test_unknown_fields_are_logged_once_by_name(http, text_server):
    for _ in range(3):
        _post(http, "/v1/completions", prompt=TEXT, max_tokens=2, bridge_test_unknown_field=1)
        _post(http, "/v1/chat/completions", max_tokens=2,
              messages=[{"role": "user", "content": TEXT, "bridge_test_message_field": True}])
    log = text_server.log()
    assert log.count("'bridge_test_unknown_field' is not one this server knows") == 1, log
    assert log.count("'messages[].bridge_test_message_field' is not one this server knows") == 1, log


def test_openai_client_reads_the_extra_fields(text_server):
    import openai

    client = openai.OpenAI(base_url=text_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    r = client.completions.create(model="tiny", prompt=TEXT, echo=True, max_tokens=4, temperature=0.0,
                                  extra_body={"return_token_ids": True, "prompt_logprobs": 1})
    choice = r.choices[0].model_dump()
    assert len(choice["token_ids"]) == 4 and choice["prompt_logprobs"][0] is None
    # vLLM's rule: with return_token_ids, echo shows the prompt as prompt_token_ids, not as text
    assert not r.choices[0].text.startswith(TEXT) and choice["prompt_token_ids"]
