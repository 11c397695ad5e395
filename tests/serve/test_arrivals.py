"""Requests on their way to the engine shorten its decode windows; the count never leaks."""

from __future__ import annotations

import asyncio

from bridge.serve.arrivals import Arrivals, submitted
from bridge.serve.engine_loop import EngineLoop
from bridge.serve.guards import Guards
from bridge.serve.metrics import ServeMetrics
from runner.sampling_params import SamplingParams


def test_a_ticket_is_punched_once_at_submission_or_at_the_end():
    arrivals = Arrivals()
    with arrivals.arriving():
        assert arrivals.count == 1
        submitted()
        submitted()
        assert arrivals.count == 0
    assert arrivals.count == 0
    with arrivals.arriving():  # a 400 before submission: punched when the request ends
        assert arrivals.count == 1
    assert arrivals.count == 0
    submitted()  # outside a counted request: nothing to punch
    assert arrivals.count == 0


def test_guards_count_a_post_while_its_body_arrives_and_never_after():
    arrivals = Arrivals()
    seen: list[int] = []

    async def app(scope, receive, send):
        seen.append(arrivals.count)  # the body is in; the handler has not submitted yet
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guards = Guards(app, api_key=None, max_body_bytes=1 << 20, metrics=ServeMetrics(), arrivals=arrivals)
    chunks = [{"type": "http.request", "body": b'{"a"', "more_body": True},
              {"type": "http.request", "body": b": 1}", "more_body": False}]

    async def receive():
        seen.append(arrivals.count)  # counted while the body is being read
        return chunks.pop(0)

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(guards(scope, receive, send))
    assert seen == [1, 1, 1] and arrivals.count == 0
    get = {"type": "http", "method": "GET", "path": "/health", "headers": []}
    asyncio.run(guards(get, receive, send))
    assert seen[-1] == 0  # a GET is not an arrival


def test_engine_windows_are_short_while_requests_arrive(offline_llm):
    llm = offline_llm
    configured = llm.core.decode_window  # 1 on the CPU (no CUDA graphs); the policy is the same
    llm.core.decode_window = full = 32
    loop = EngineLoop(llm, max_pending=8, metrics=ServeMetrics(), arrival_decode_window=2)
    assert loop.full_decode_window == full
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        for rid, arriving, expected in (("a", 1, 2), ("b", 0, full)):
            prompt = {"prompt_token_ids": [5, 6, 7]}
            llm.core.add_request(llm.processor.process([prompt], [params], [rid], stream_text=False)[0])
            loop.arrivals.count = arriving
            loop._tick([], [])
            assert llm.core.decode_window == expected
            while llm.core.has_unfinished():
                loop._tick([], [])
    finally:
        loop.arrivals.count = 0
        llm.core.decode_window = configured
