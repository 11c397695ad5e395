"""`bridge serve` through the official `openai` client and raw HTTP, against offline `LLM.generate`.

One real server process (tests/serve/conftest.py) over a tiny random qwen3; expected outputs come
from the same model run offline in this process, never hard-coded.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from serve_helpers import API_KEY, MAX_PENDING

from bridge import encode_prompt_embeds
from runner.sampling_params import SamplingParams

HIDDEN = 64
GREEDY = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=text_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _embeds(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _offline(llm, prompts, **params):
    outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_completions_text_ids_and_embeds_equal_offline_greedy(client, offline_llm, text_server):
    text = "the red circle"
    ids = [12, 40, 77, 100, 5]
    one, two, three = _embeds(5, 1), _embeds(7, 2), _embeds(3, 3)

    r = client.completions.create(model="tiny", prompt=text, **GREEDY)
    (want,) = _offline(offline_llm, [text], **GREEDY)
    assert r.choices[0].text == want.text
    assert r.usage.prompt_tokens == len(offline_llm.tokenizer.encode(text))
    assert r.usage.completion_tokens == len(want.token_ids)

    r = client.completions.create(model="tiny", prompt=[ids, ids[:3]], **GREEDY)
    want = _offline(offline_llm, [{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:3]}], **GREEDY)
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert r.usage.prompt_tokens == 8

    r = client.completions.create(model="tiny", prompt="",
                                  extra_body={"prompt_embeds": encode_prompt_embeds(one)}, **GREEDY)
    (want,) = _offline(offline_llm, [{"prompt_embeds": one}], **GREEDY)
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == 5

    # several payloads, plus a text prompt in the same request: embeds prompts first, then text (vLLM's order)
    r = client.completions.create(model="tiny", prompt=text, extra_body={
        "prompt_embeds": [encode_prompt_embeds(t) for t in (one, two, three)]}, **GREEDY)
    want = _offline(offline_llm, [{"prompt_embeds": t} for t in (one, two, three)] + [text], **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert r.usage.prompt_tokens == 5 + 7 + 3 + len(offline_llm.tokenizer.encode(text))
    text_server.wait_idle()


def test_streaming_adds_up_to_the_non_streaming_answer(client, text_server):
    kwargs = dict(model="tiny", prompt=["a blue square", "three"], temperature=0.0, max_tokens=10, logprobs=1)
    whole = client.completions.create(**kwargs)
    texts, finish, usage = ["", ""], [None, None], None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_strings_and_stop_ids_equal_offline(client, offline_llm):
    (free,) = _offline(offline_llm, ["stop here"], max_tokens=12, temperature=0.0)
    stop = free.text[3:5] or free.text[-1:]
    for extra in ({"stop": [stop]}, {"stop_token_ids": [free.token_ids[4]]}):
        how = {"stop": extra["stop"]} if "stop" in extra else {"extra_body": extra}
        r = client.completions.create(model="tiny", prompt="stop here", max_tokens=12, temperature=0.0, **how)
        (want,) = _offline(offline_llm, ["stop here"], max_tokens=12, temperature=0.0, **extra)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, want.finish_reason)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="stop here", max_tokens=12, temperature=0.0, stream=True, **how))
        assert streamed == want.text


def test_n_with_a_seed_runs_seed_plus_j_like_vllm(client, offline_llm):
    params = {"temperature": 1.0, "max_tokens": 6}
    r = client.completions.create(model="tiny", prompt="seeded", n=3, seed=11, **params)
    want = [_offline(offline_llm, ["seeded"], seed=11 + j, **params)[0].text for j in range(3)]
    assert [c.text for c in r.choices] == want
    again = client.completions.create(model="tiny", prompt="seeded", n=3, seed=11, **params)
    assert [c.text for c in again.choices] == want


def test_logprobs_match_offline(client, offline_llm):
    r = client.completions.create(model="tiny", prompt="logprobs please", logprobs=3, **GREEDY)
    (want,) = _offline(offline_llm, ["logprobs please"], logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(want.token_ids) == len(lp.top_logprobs) == len(lp.tokens)
    for got, tid, row in zip(lp.token_logprobs, want.token_ids, want.logprobs):
        assert got == pytest.approx(row[tid], abs=1e-4)
    decode = offline_llm.tokenizer.decode
    for top, row in zip(lp.top_logprobs, want.logprobs):  # keyed by token text, as in OpenAI's API
        assert len(row) >= 3 and set(top) == {decode([t]) for t in row}
    # greedy: the sampled token has the top logprob of its row
    for top, t in zip(lp.top_logprobs, lp.token_logprobs):
        assert max(top.values()) == pytest.approx(t, abs=1e-6)


def test_chat_text_and_embeds_content_equal_offline(client, offline_llm):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                       temperature=0.0, max_tokens=8, logprobs=True, top_logprobs=2)
    ids = offline_llm.tokenizer.encode("hello there", add_special_tokens=False)
    (want,) = _offline(offline_llm, [{"prompt_token_ids": ids}], **GREEDY)
    assert r.choices[0].message.content == want.text
    assert len(r.choices[0].logprobs.content) == len(want.token_ids)
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)

    rows = _embeds(4, 9)
    r = client.chat.completions.create(model="tiny", temperature=0.0, max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "x"},
                                     {"type": "prompt_embeds",
                                      "prompt_embeds": encode_prompt_embeds(rows)}]}])
    prompt = {"prompt": "x\n<embeds>", "multi_modal_data": {"prompt_embeds": [rows]}}
    (want,) = _offline(offline_llm, [prompt], **GREEDY)
    assert r.choices[0].message.content == want.text

    chunks = list(client.chat.completions.create(model="tiny", temperature=0.0, max_tokens=8, stream=True,
                                                 messages=[{"role": "user", "content": "hello there"}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    (want,) = _offline(offline_llm, [{"prompt_token_ids": ids}], **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_64_concurrent_streams_complete_and_equal_offline(text_server, offline_llm):
    prompts = [[10 + i, 20 + (i * 7) % 200, 30 + (i * 13) % 200] for i in range(64)]
    want = [o.text for o in _offline(offline_llm, [{"prompt_token_ids": p} for p in prompts], **GREEDY)]

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> str:
        body = {"model": "tiny", "prompt": prompt, "stream": True, **GREEDY}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run_all() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=text_server.url, headers=text_server.headers, timeout=120,
                                     limits=limits) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    got = asyncio.run(asyncio.wait_for(run_all(), timeout=180))
    assert got == want
    text_server.wait_idle()


def test_client_disconnect_aborts_and_frees_blocks_and_slot(text_server):
    before = text_server.metrics()["bridge:request_aborted_total"]
    body = {"model": "tiny", "prompt": [5, 6, 7], "stream": True, "max_tokens": 100, "ignore_eos": True,
            "temperature": 0.0}
    with httpx.Client(base_url=text_server.url, headers=text_server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = [line for line, _ in zip(lines, range(3)) if line.startswith("data: ")]
            assert got, "no chunk before disconnecting"
        # non-streaming: the client gives up half-way through (timed on this machine: a fixed 0.3 s
        # outlasted the whole request on a fast one)
        started = time.monotonic()
        assert http.post("/v1/completions", json={**body, "stream": False}).status_code == 200
        whole = time.monotonic() - started
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/completions", json={**body, "stream": False}, timeout=whole / 2)
    m = text_server.wait_idle()
    deadline = time.monotonic() + 10
    while m["bridge:request_aborted_total"] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        m = text_server.metrics()
    assert m["bridge:request_aborted_total"] == before + 2


def test_auth_limits_and_error_shape(text_server):
    with httpx.Client(base_url=text_server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        ok = http.get("/v1/models", headers=text_server.headers).json()
        assert ok["data"][0]["id"] == "tiny" and ok["data"][0]["max_model_len"] == 128
        assert "version" in http.get("/version").json()

        auth = text_server.headers
        r = http.post("/v1/completions", headers=auth,
                      json={"prompt": [[1, 2]] * 16, "n": 8, "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert str(MAX_PENDING) in r.json()["error"]["message"]
        r = http.post("/v1/completions", headers=auth, json={"prompt": "hi", "max_tokens": 1000})
        assert r.status_code == 400 and "maximum context length is 128" in r.json()["error"]["message"]
        r = http.post("/v1/completions", headers=auth, json={"prompt": "hi", "model": "other"})
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = http.post("/v1/completions", headers=auth, content=b"x" * (5 * 2**20))
        assert r.status_code == 413
    text_server.wait_idle()


def test_metrics_count_requests_tokens_and_latency(client, text_server):
    """The counters move by what this test sends (one text stream, four embeds payloads in one request),
    whatever ran before it on the shared server: a test of its own, alone or on any worker."""
    before = text_server.metrics()
    text_route = 'bridge:http_requests_total{route="/v1/completions",status="200"}'
    pool = 'bridge:request_bodies_parsed_total{where="pool"}'
    stream = client.completions.create(model="tiny", prompt="the red circle", stream=True, **GREEDY)
    assert len(list(stream)) > 1  # the stream ran to its end
    client.completions.create(model="tiny", prompt="", **GREEDY, extra_body={
        "prompt_embeds": [encode_prompt_embeds(_embeds(4 + i, 20 + i)) for i in range(4)]})
    text_server.wait_idle()
    m = text_server.metrics()

    def grew(name: str) -> float:
        return m.get(name, 0) - before.get(name, 0)

    assert grew("bridge:prompt_tokens_total") >= 4 + 5 + 6 + 7  # the embeds rows, plus the text's tokens
    assert grew("bridge:generation_tokens_total") > 0
    assert grew("bridge:time_to_first_token_seconds_count") >= 5  # one per prompt
    assert grew("bridge:inter_token_latency_seconds_count") > 0
    assert grew(text_route) == 2
    assert grew("bridge:prompt_embeds_decode_seconds_count") == 4
    # the text server parses every body in its ingest pool (conftest): none was parsed in-process
    assert grew(pool) == 2
    assert m.get('bridge:request_bodies_parsed_total{where="inline"}', 0) == 0
    assert m["bridge:kv_cache_usage_perc"] == 0.0
