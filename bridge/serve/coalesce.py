"""Deltas of one HTTP request that wait in its queue together, merged into one delta per engine request.

Why: the engine delivers a tick's deltas all at once, and a stream writes one server-sent event per delta
it reads. When the event loop is behind (a burst of bodies being parsed, many streams), a request's
queue holds several ticks' deltas by the time its stream looks: written one event each, every one is a
JSON body, a socket write and a parse in the client (the official `openai` client builds a model
object per event), for tokens the client then gets all at once anyway. Merged, the stream writes what
is there in one event per choice, as vLLM's API server does with the outputs it finds queued.

A merged delta carries the same tokens, text and logprobs in the same order, the first delta's prompt
logprobs and prompt ids, and the last delta's end (finished, finish_reason, stop_reason, error): the
concatenated stream is unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from runner.outputs import RequestDelta


def take_queued(queue: asyncio.Queue, first: Any) -> list[Any]:
    """`first` (just read from `queue`) and everything else queued behind it now, in order."""
    items = [first]
    while True:
        try:
            items.append(queue.get_nowait())
        except asyncio.QueueEmpty:
            return items


def coalesce(items: list[Any]) -> tuple[list[RequestDelta], Any]:
    """The `RequestDelta`s among `items` up to the first item that is not one, merged per request id
    (in the order each id first appears), and that first other item (None if there is none): the
    caller handles the deltas before it, then it. Items after it are dropped, as a stream ends there."""
    merged: dict[str, RequestDelta] = {}
    for item in items:
        if not isinstance(item, RequestDelta):
            return list(merged.values()), item
        seen = merged.get(item.request_id)
        merged[item.request_id] = item if seen is None else _merge(seen, item)
    return list(merged.values()), None


def _merge(first: RequestDelta, then: RequestDelta) -> RequestDelta:
    logprobs = None
    if first.new_logprobs is not None or then.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (then.new_logprobs or [])
    # what only a request's first delta carries (its prompt logprobs and expanded prompt ids) stays
    return dataclasses.replace(then, new_token_ids=first.new_token_ids + then.new_token_ids,
                               new_text=first.new_text + then.new_text, new_logprobs=logprobs,
                               prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None
                               else then.prompt_logprobs,
                               prompt_token_ids=first.prompt_token_ids if first.prompt_token_ids is not None
                               else then.prompt_token_ids)


__all__ = ["coalesce", "take_queued"]
