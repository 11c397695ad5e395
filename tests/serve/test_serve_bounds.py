"""Issue 40's server findings on a plain model: a text prompt refused from its byte size before it is
tokenized, tokenization in the API process (never in the engine's tick), an HTTP/1.0 stream without
chunked encoding, and SIGTERM with streams in flight ending each with an error event and `[DONE]`."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from serve_helpers import API_KEY, MAX_MODEL_LEN, ServerProcess

from bridge.serve.inputs import ServeLimits, completion_prompts, default_max_prompt_bytes, longest_token_bytes
from bridge.serve.metrics import ServeMetrics
from bridge.serve.protocol import CompletionRequest

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_a_prompt_over_the_byte_limit_is_refused_before_tokenizing(text_server, offline_llm):
    cap = default_max_prompt_bytes(offline_llm.tokenizer, MAX_MODEL_LEN)
    assert cap == MAX_MODEL_LEN * longest_token_bytes(offline_llm.tokenizer)
    big = "word " * (cap // 5 + 1)
    with httpx.Client(base_url=text_server.url, headers=AUTH, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": big, "max_tokens": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and "--max-prompt-bytes" in error["message"]
        r = http.post("/v1/completions", json={"prompt": ["hi", big], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
        chat = {"messages": [{"role": "user", "content": big[: cap // 2]}, {"role": "user", "content": big}]}
        r = http.post("/v1/chat/completions", json={**chat, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1]"
        # token ids over the context are refused by the API process too, with the field named
        r = http.post("/v1/completions", json={"prompt": [[1] * (MAX_MODEL_LEN + 1)], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[0]"
        assert "maximum context length of 128" in r.json()["error"]["message"]
    text_server.wait_idle()


def test_text_prompts_reach_the_engine_as_token_ids(offline_llm):
    """Tokenization happens in the API process: the engine's tick gets ids and never calls the tokenizer's
    encode (which, for a 16 MB prompt, stalled every other request for seconds)."""
    limits = ServeLimits(max_prompt_bytes=10_000)
    body = CompletionRequest(prompt=["hello world", "the cat"])
    tokenizer = offline_llm.tokenizer
    prompts = asyncio.run(completion_prompts(body, hidden_size=64, max_model_len=MAX_MODEL_LEN, limits=limits,
                                             metrics=ServeMetrics(), tokenizer=tokenizer))
    assert prompts == [{"prompt_token_ids": list(tokenizer.encode(t))} for t in body.prompt]

    processor = offline_llm.processor

    class NoEncode:
        def __getattr__(self, name):
            if name == "encode":
                raise AssertionError("the engine tokenized a prompt")
            return getattr(tokenizer, name)

    processor.tokenizer = NoEncode()
    try:
        from runner.sampling_params import SamplingParams

        requests = processor.process(prompts, [SamplingParams(max_tokens=1)] * 2, ["a", "b"])
    finally:
        processor.tokenizer = tokenizer
    assert [r.prompt_token_ids for r in requests] == [p["prompt_token_ids"] for p in prompts]


def _raw_http(url: str, request: bytes, timeout: float = 30) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):  # an HTTP/1.0 body ends when the server closes
            chunks.append(chunk)
    return b"".join(chunks)


def test_an_http_1_0_stream_is_not_chunked(text_server):
    body = json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    response = _raw_http(text_server.url, head + body)
    headers, _, payload = response.partition(b"\r\n\r\n")
    assert b" 200 " in headers.split(b"\r\n")[0]
    assert b"transfer-encoding" not in headers.lower()
    events = [line for line in payload.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) >= 2
    # HTTP/1.1 keeps its chunked stream
    response = _raw_http(text_server.url, head.replace(b"HTTP/1.0", b"HTTP/1.1").replace(
        b"Host: x", b"Host: x\r\nConnection: close") + body)
    assert b"transfer-encoding: chunked" in response.partition(b"\r\n\r\n")[0].lower()
    text_server.wait_idle()


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A server whose requests can run for minutes, with a short drain (`--shutdown-timeout 3`)."""
    from bridge.tiny_models import build_tiny_model

    tmp = tmp_path_factory.mktemp("serve_shutdown")
    model = build_tiny_model(tmp / "qwen3", "qwen3", seed=5, max_position_embeddings=32768)
    server = ServerProcess(model, tmp / "server.log", "--dtype", "float32", "--max-model-len", "32768",
                           "--num-kv-blocks", "8400", "--max-num-seqs", "8", "--shutdown-timeout", "3")
    yield server
    server.stop()


def test_sigterm_ends_every_stream_with_an_error_event_and_done(long_server):
    body = {"prompt": "hello", "max_tokens": 32000, "ignore_eos": True, "temperature": 0.0, "stream": True}
    started = threading.Barrier(5)
    results: dict[int, object] = {}

    def stream(k: int) -> None:
        events = []
        try:
            with httpx.stream("POST", long_server.url + "/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        if not events:
                            started.wait(30)
                        events.append(line[6:])
            results[k] = events
        except Exception as err:  # noqa: BLE001 - a cut stream is the failure under test
            results[k] = err

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    started.wait(30)
    non_streaming: dict[str, httpx.Response] = {}  # a request that is not streamed gets an answer too
    collector = threading.Thread(target=lambda: non_streaming.setdefault("r", httpx.post(
        long_server.url + "/v1/completions", json={**body, "stream": False}, timeout=60)))
    collector.start()
    time.sleep(0.5)
    sent = time.monotonic()
    long_server.proc.send_signal(signal.SIGTERM)
    for thread in [*threads, collector]:
        thread.join(60)
    assert long_server.proc.wait(timeout=60) == 0, long_server.log()
    assert time.monotonic() - sent < 3 + 5 + 10  # the drain, uvicorn's grace after it, slack
    for k in range(4):
        events = results[k]
        assert isinstance(events, list), f"stream {k} was cut: {events!r}\n{long_server.log()}"
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "shut down" in error["message"]
    r = non_streaming["r"]
    assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]
