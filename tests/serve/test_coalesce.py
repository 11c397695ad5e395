"""Deltas that wait in a request's queue together become one event per choice (bridge/serve/coalesce.py).

A stream fed one delta at a time and the same stream finding every delta queued at once must tell the
client the same thing: per choice the same concatenated text and token ids, the same finish_reason
and stop_reason, the same usage; only the number of events and writes differs (one write per batch,
`[DONE]` in the last one). An engine failure behind queued deltas still reaches the client after them.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from bridge.serve.coalesce import coalesce
from bridge.serve.engine_loop import EngineFailed
from bridge.serve.generation import Generation, TokenText
from bridge.serve.metrics import ServeMetrics
from bridge.serve.response_extras import ResponseOptions
from runner.llm import load_tokenizer
from runner.outputs import RequestDelta
from runner.sampling_params import SamplingParams


class _Front:
    """Just enough of an EngineFront: `submit` hands back an empty queue that the test fills."""

    max_pending = 8

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def submit(self, prompts, params, ids, *, stream_text, check_context):
        return asyncio.Queue(), [3] * len(ids)

    def abort(self, ids) -> None:
        self.aborted += list(ids)


def _deltas(base: str) -> list[RequestDelta]:
    """Two choices' deltas, interleaved as ticks deliver them; choice 1 stops on an id."""
    a, b = f"{base}-0", f"{base}-1"
    return [RequestDelta(a, [11]), RequestDelta(b, [40]), RequestDelta(a, [12, 13]),
            RequestDelta(b, [41, 42]), RequestDelta(a, [14]),
            RequestDelta(b, [43], finished=True, finish_reason="stop", stop_reason=43),
            RequestDelta(a, [15, 16], finished=True, finish_reason="length")]


async def _stream(tokenizer, kind: str, feed: str) -> list[str]:
    """The writes of one stream; `feed` "queued": every delta waits before the stream reads, "one":
    each is put in only once the stream took the one before."""
    gen = Generation(_Front(), ServeMetrics(), base_id="cmpl-t", model="m",
                     prompts=[{"prompt_token_ids": [1]}], params=[SamplingParams(max_tokens=6)] * 2, n=2,
                     check_context=True, token_text=TokenText(tokenizer),
                     options=ResponseOptions(return_token_ids=kind == "completion"))
    await gen.submit()
    items = _deltas("cmpl-t")
    stream = (gen.completion_stream(include_usage=True) if kind == "completion"
              else gen.chat_stream(include_usage=True, top=0))
    writes: list[str] = []

    async def read() -> None:
        async for write in stream:
            writes.append(write)

    if feed == "queued":
        for item in items:
            gen.queue.put_nowait(item)
        await read()
    else:
        async def put_one_by_one() -> None:
            for item in items:
                gen.queue.put_nowait(item)
                while not gen.queue.empty():
                    await asyncio.sleep(0)

        await asyncio.gather(read(), put_one_by_one())
    return writes


def _told(writes: list[str], kind: str) -> dict:
    """What the client learns: per choice text, ids, finish and stop reasons; the usage; events seen."""
    per: dict[int, dict] = {}
    usage, events, done = None, 0, False
    for event in "".join(writes).split("\n\n"):
        if not event:
            continue
        assert event.startswith("data: ")
        if event == "data: [DONE]":
            done = True
            continue
        body = json.loads(event[6:])
        if body.get("usage"):
            usage = body["usage"]
        for c in body["choices"]:
            events += 1
            got = per.setdefault(c["index"], {"text": "", "ids": [], "finish": None, "stop": None})
            got["text"] += c["text"] if kind == "completion" else c["delta"].get("content", "")
            got["ids"] += c.get("token_ids", [])
            if c["finish_reason"] is not None:
                got["finish"], got["stop"] = c["finish_reason"], c["stop_reason"]
    assert done and writes[-1].endswith("data: [DONE]\n\n")
    return {"choices": per, "usage": usage, "events": events}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_queued_deltas_make_one_event_per_choice_and_the_same_stream(tiny_text_model, kind):
    tokenizer = load_tokenizer(tiny_text_model)
    one = asyncio.run(_stream(tokenizer, kind, "one"))
    queued = asyncio.run(_stream(tokenizer, kind, "queued"))
    told_one, told_queued = _told(one, kind), _told(queued, kind)
    assert told_queued["choices"] == told_one["choices"]
    assert told_queued["usage"] == told_one["usage"] == {"prompt_tokens": 3, "completion_tokens": 10,
                                                         "total_tokens": 13}
    choices = told_queued["choices"]
    assert choices[0]["finish"] == "length" and choices[1]["finish"] == "stop" and choices[1]["stop"] == 43
    if kind == "completion":
        assert choices[0]["ids"] == [11, 12, 13, 14, 15, 16] and choices[1]["ids"] == [40, 41, 42, 43]
    assert choices[0]["text"] == tokenizer.decode([11, 12, 13, 14, 15, 16])
    # one write, one event per choice (chat: after its role events), usage and [DONE] in the same write
    role_events = 2 if kind == "chat" else 0
    assert len(queued) == 1 + (kind == "chat") and told_queued["events"] == 2 + role_events
    assert len(one) == 7 + (kind == "chat") and told_one["events"] == 7 + role_events


def test_an_engine_failure_behind_queued_deltas_comes_after_them(tiny_text_model):
    merged, other = coalesce([RequestDelta("r-0", [1]), RequestDelta("r-0", [2], new_text="b"),
                              EngineFailed("tick"), RequestDelta("r-0", [3])])
    assert [(d.new_token_ids, d.finished) for d in merged] == [([1, 2], False)]
    assert isinstance(other, EngineFailed)

    async def scenario() -> tuple[list[str], list[str]]:
        front = _Front()
        gen = Generation(front, ServeMetrics(), base_id="cmpl-f", model="m",
                         prompts=[{"prompt_token_ids": [1]}], params=[SamplingParams(max_tokens=6)], n=1,
                         check_context=True, token_text=TokenText(load_tokenizer(tiny_text_model)),
                         options=ResponseOptions(return_token_ids=True))
        await gen.submit()
        for item in (RequestDelta("cmpl-f-0", [11]), RequestDelta("cmpl-f-0", [12]), EngineFailed("tick")):
            gen.queue.put_nowait(item)
        writes = [w async for w in gen.completion_stream(include_usage=False)]
        return writes, front.aborted

    writes, aborted = asyncio.run(scenario())
    events = [e for e in "".join(writes).split("\n\n") if e]
    assert json.loads(events[0][6:])["choices"][0]["token_ids"] == [11, 12]
    assert json.loads(events[1][6:])["error"]["code"] == 500 and events[2] == "data: [DONE]"
    assert aborted == ["cmpl-f-0"]


def test_a_merged_delta_keeps_what_only_the_first_delta_carries():
    first = RequestDelta("r", [1], prompt_logprobs=[None, {5: -0.5}], prompt_token_ids=[9, 5])
    (merged,), other = coalesce([first, RequestDelta("r", [2]), RequestDelta("r", [3], finished=True)])
    assert other is None and merged.new_token_ids == [1, 2, 3] and merged.finished
    assert merged.prompt_logprobs == [None, {5: -0.5}] and merged.prompt_token_ids == [9, 5]
