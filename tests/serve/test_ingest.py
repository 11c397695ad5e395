"""The ingest pool (bridge/serve/ingest.py) parses bodies exactly as the in-process path does.

One `BodyParser` with one spawned worker, driven in this process: the same JSON, the same tensors
(bit for bit, every accepted dtype), the same 400 messages for hostile payloads, JSON errors as
`json.JSONDecodeError`, refused prompts left undecoded, and a pool whose worker dies keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import time

import pytest
import torch
from wire_crafting import b64, pickle_archive

from bridge.serve.ingest import PLACEHOLDER, BodyParser, EmbedsSpec, close_pool, spawn_ingest_pool, warm_up
from bridge.serve.metrics import ServeMetrics
from bridge.wire import encode_prompt_embeds, load_prompt_embeds

HIDDEN = 16
SPEC = EmbedsSpec(enabled=True, hidden_size=HIDDEN, max_bytes=2**20, max_rows=64, max_prompts=4)
MARKER = f"/tmp/bridge_ingest_test_ran_{os.getpid()}"


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


@pytest.fixture(scope="module")
def pool_parser():
    parser = BodyParser(SPEC, workers=1, inline_bytes=0, metrics=ServeMetrics())
    asyncio.run(parser.start())
    yield parser
    parser.close()


def parse(parser: BodyParser, body: dict | bytes):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(parser.parse(raw))


def inline_error(payload: str) -> str:
    with pytest.raises(ValueError) as info:
        load_prompt_embeds(payload, hidden_size=HIDDEN, max_bytes=SPEC.max_bytes, max_rows=SPEC.max_rows,
                           check_finite=False)
    return str(info.value)


def test_pool_returns_the_inline_tensors_bit_for_bit(pool_parser):
    tensors = [torch.randn(5, HIDDEN, dtype=dtype) for dtype in
               (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
    tensors.append(torch.randn(1, 3, HIDDEN))  # a batch-1 3-D tensor is squeezed, as inline
    body = {"model": "m", "prompt": "", "max_tokens": 3, "prompt_embeds": [encode_prompt_embeds(t)
                                                                             for t in tensors[:4]]}
    parsed = parse(pool_parser, body)
    assert parsed.data["prompt_embeds"] == [PLACEHOLDER] * 4
    assert {k: v for k, v in parsed.data.items() if k != "prompt_embeds"} == {"model": "m", "prompt": "",
                                                                                "max_tokens": 3}
    for sent, got in zip(tensors, parsed.embeds):
        assert got.error is None and got.seconds > 0
        assert got.tensor.dtype == sent.dtype and torch.equal(got.tensor, sent)
    one = parse(pool_parser, {"prompt_embeds": encode_prompt_embeds(tensors[4])})
    assert one.data["prompt_embeds"] == PLACEHOLDER
    assert torch.equal(one.embeds[0].tensor, tensors[4][0])
    one.embeds[0].tensor.add_(1)  # the rebuilt tensor owns writable memory


def test_hostile_payloads_get_the_inline_messages_and_run_nothing(pool_parser):
    payloads = [
        b64(pickle_archive(pickle.dumps(_RunsCode(), protocol=2))),
        b64(pickle.dumps(_RunsCode(), protocol=2)),
        "not base64 at all!",
        encode_prompt_embeds(torch.randn(3, HIDDEN + 1)),  # wrong hidden size
        encode_prompt_embeds(torch.ones(3, HIDDEN, dtype=torch.int64)),  # wrong dtype
        PLACEHOLDER,  # a client sending the placeholder text gets it decoded (and refused)
    ]
    parsed = parse(pool_parser, {"prompt_embeds": payloads[:4]})
    parsed2 = parse(pool_parser, {"prompt_embeds": payloads[4:]})
    for payload, got in zip(payloads, parsed.embeds + parsed2.embeds):
        assert got.tensor is None
        assert got.error == inline_error(payload)
    assert not os.path.exists(MARKER)


def test_json_errors_and_bodies_without_payloads(pool_parser):
    for bad in (b'{"prompt": ', b"\xff\xfe{}", b"[1, 2,]"):
        with pytest.raises(json.JSONDecodeError):
            parse(pool_parser, bad)
    assert parse(pool_parser, b"[1, 2]").data == [1, 2]
    plain = parse(pool_parser, {"prompt": "hi", "prompt_embeds": None})
    assert plain.data == {"prompt": "hi", "prompt_embeds": None} and plain.embeds is None
    wrong = parse(pool_parser, {"prompt_embeds": ["x", 3]})  # pydantic refuses it later, unchanged
    assert wrong.data["prompt_embeds"] == ["x", 3] and wrong.embeds is None


def test_refused_prompts_are_not_decoded():
    payload = encode_prompt_embeds(torch.randn(2, HIDDEN))
    off = BodyParser(EmbedsSpec(False, HIDDEN, 2**20, 64, 4), workers=1, inline_bytes=0)
    asyncio.run(off.start())
    try:
        parsed = parse(off, {"prompt_embeds": payload})  # the route answers the flag's 400
        assert parsed.data["prompt_embeds"] == PLACEHOLDER and parsed.embeds is None
    finally:
        off.close()


def test_small_bodies_stay_inline_and_a_dead_worker_is_replaced(pool_parser):
    metrics = pool_parser.metrics
    inline = BodyParser(SPEC, workers=1, inline_bytes=10**6, metrics=metrics)
    asyncio.run(inline.start())
    try:
        sent = torch.randn(2, HIDDEN)
        parsed = parse(inline, {"prompt_embeds": encode_prompt_embeds(sent)})
        assert parsed.data["prompt_embeds"] == PLACEHOLDER  # decoded as it was parsed, in this process
        assert torch.equal(parsed.embeds[0].tensor, sent)
    finally:
        inline.close()
    assert metrics.bodies_parsed.labels("inline")._value.get() >= 1
    pids = [p.pid for p in pool_parser._pool._processes.values()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    body = {"prompt_embeds": encode_prompt_embeds(torch.randn(2, HIDDEN))}
    first = parse(pool_parser, body)  # the broken pool is noticed here: parsed in-process, pool replaced
    assert first.embeds is not None and first.embeds[0].tensor.shape == (2, HIDDEN)
    again = parse(pool_parser, body)
    assert again.embeds is not None and again.embeds[0].tensor.shape == (2, HIDDEN)
    assert metrics.bodies_parsed.labels("pool")._value.get() >= 2


@pytest.mark.parametrize("started", [True, False], ids=["workers-up", "workers-starting"])
def test_close_pool_ends_the_manager_thread_before_returning(started):
    """close_pool returns with the pool's manager thread ended, its wake-up pipe closed: Python's exit
    hook writes to that pipe without the pool's lock, and a process exiting while the thread was still
    closing it died with EBADF (a clean SIGTERM of the server exited 1)."""
    pool = spawn_ingest_pool(1)
    futures = warm_up(pool, 1)
    if started:
        assert futures[0].result(timeout=120) > 0
    manager, workers = pool._executor_manager_thread, list(pool._processes.values())
    assert manager is not None and manager.is_alive() and workers
    close_pool(pool)
    assert not manager.is_alive()
    assert not any(worker.is_alive() for worker in workers)


def test_ingest_request_body_is_the_received_chunk_not_a_copy():
    """One chunk (what the guards middleware hands on) is the body itself; several are joined."""
    from bridge.serve.ingest import IngestRequest

    def request(chunks: list[bytes]) -> IngestRequest:
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                    for i, c in enumerate(chunks)]

        async def receive():
            return messages.pop(0)

        return IngestRequest({"type": "http", "method": "POST", "headers": []}, receive)

    chunk = b'{"prompt": "' + b"x" * 100_000 + b'"}'
    assert asyncio.run(request([chunk]).body()) is chunk
    assert asyncio.run(request([chunk[:10], chunk[10:]]).body()) == chunk
    assert asyncio.run(request([b""]).body()) == b""
