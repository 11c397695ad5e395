"""One HTTP generation request's life after validation: submit, then stream or collect the deltas.

`Generation` gathers what the n x prompts engine requests of one HTTP request produce (text, ids,
logprobs, finish reasons, per-token timing for the latency histograms) and turns them into OpenAI
completion / chat bodies or server-sent-event chunks. A client that goes away (the stream's
generator is closed, or the non-streaming wait is cancelled) aborts every request it still has
in the engine, which frees their KV blocks and slots before the next step.

A request that fails while running (an encoder raised on one of its items) finishes with
`finish_reason: "error"`, and the reason always reaches the client: as the choice's `stop_reason`, as an
error event after its last chunk in a stream, and, when every choice of a request failed, as the status
of a non-streaming answer (500 with the message).

What a request asked to see beyond the text (token ids, prompt logprobs, echo) is its
`ResponseOptions` (`response_extras.py`); a request's first delta brings its prompt logprobs and, for
a prompt with media, its expanded prompt ids.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from bridge.serve.coalesce import coalesce, take_queued
from bridge.serve.engine_loop import EngineFailed, EngineFront, QueueFull, ShuttingDown
from bridge.serve.errors import ApiError, bounded
from bridge.serve.metrics import ServeMetrics
from bridge.serve.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TopLogprob,
    UsageInfo,
)
from bridge.serve.response_extras import ResponseOptions, prompt_logprobs_json
from runner.outputs import RequestDelta
from runner.request import IncrementalDetokenizer
from runner.sampling_params import SamplingParams

RETRY_AFTER_S = "1"


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it failed, with finish_reason "error"
    last_time: float | None = None
    detokenizer: IncrementalDetokenizer | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # from the first delta
    prompt_token_ids: list[int] | None = None  # from the first delta: a prompt with media, expanded


class TokenText:
    """Token id -> its text for logprobs (the tokenizer's decode of the one id), or `token_id:N` (vLLM's
    `return_tokens_as_token_ids`, and always without a tokenizer)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None or self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


class Generation:
    """The engine requests of one HTTP request: ids `<base>-<k>`, choice k = prompt * n + sample."""

    def __init__(self, loop: EngineFront, metrics: ServeMetrics, *, base_id: str, model: str,
                 prompts: Sequence[Any], params: Sequence[SamplingParams], n: int, check_context: bool,
                 token_text: TokenText, options: ResponseOptions | None = None) -> None:
        self.loop, self.metrics = loop, metrics
        self.base_id, self.model, self.n = base_id, model, n
        self.options = options or ResponseOptions()
        self.given_prompts = list(prompts)
        self.prompts = [p for p in prompts for _ in range(n)]
        self.params = list(params) * len(prompts)
        self.ids = [f"{base_id}-{k}" for k in range(len(self.prompts))]
        self.index = {rid: k for k, rid in enumerate(self.ids)}
        self.choices = [Choice(k) for k in range(len(self.ids))]
        self.check_context = check_context
        self.token_text = token_text
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.prompt_lens: list[int] = []
        self.queue: asyncio.Queue | None = None
        self.num_finished = 0
        # Text: the engine detokenizes token by token only when it must (stop strings, stop ids);
        # otherwise each delta is detokenized here at once (a decode window's 32 tokens in one call).
        first = self.params[0] if self.params else None
        self.engine_text = bool(first and (first.stop_strings or first.stop_token_ids))
        if not self.engine_text and token_text.tokenizer is not None:
            for choice, params in zip(self.choices, self.params):
                choice.detokenizer = IncrementalDetokenizer(token_text.tokenizer, params.skip_special_tokens)

    async def submit(self) -> None:
        try:
            self.queue, lens = await self.loop.submit(self.prompts, self.params, self.ids,
                                                      stream_text=self.engine_text,
                                                      check_context=self.check_context)
        except QueueFull:
            raise ApiError(503, f"the server has {self.loop.max_pending} requests in flight (its queue "
                           "limit); retry later", headers={"Retry-After": RETRY_AFTER_S}) from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        except EngineFailed:
            raise ApiError(503, "the engine is not running (see the server's log)",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        self.metrics.admission_seconds.observe(time.perf_counter() - self.arrival)
        self.prompt_lens = lens[:: self.n]

    def abort(self) -> None:
        self.loop.abort(self.ids)

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.ids)

    async def deltas(self) -> AsyncIterator[list[tuple[Choice, str, RequestDelta]]]:
        """The deltas as they arrive, in batches: whatever waits in the queue when it is read, merged
        into one delta per choice (`coalesce.py`), each with its new text, its choice updated; ends
        when all finished."""
        assert self.queue is not None
        while not self.done:
            merged, other = coalesce(take_queued(self.queue, await self.queue.get()))
            if merged:
                yield [(*self._apply(delta), delta) for delta in merged]
            if isinstance(other, EngineFailed):
                raise ApiError(500, "the engine failed while running this request")
            if isinstance(other, ShuttingDown):
                raise ApiError(503, "the server shut down before this request finished",
                               headers={"Retry-After": RETRY_AFTER_S})

    def _apply(self, delta: RequestDelta) -> tuple[Choice, str]:
        """Add one delta to its choice: tokens, text (detokenized here unless the engine did), logprobs,
        the end; the latency histograms. Returns the choice and the delta's new text."""
        choice = self.choices[self.index[delta.request_id]]
        now = time.perf_counter()
        if delta.new_token_ids:
            if choice.last_time is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                gap = (now - choice.last_time) / len(delta.new_token_ids)
                for _ in delta.new_token_ids:
                    self.metrics.itl.observe(gap)
            choice.last_time = now
        choice.token_ids += delta.new_token_ids
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.prompt_token_ids is not None:
            choice.prompt_token_ids = delta.prompt_token_ids
        text = delta.new_text
        det = choice.detokenizer
        if det is not None:
            before = len(det.text)
            if delta.new_token_ids:
                det.step(choice.token_ids)
            if delta.finished:
                det.flush(choice.token_ids)
            text = det.text[before:]
        choice.text += text
        if delta.new_logprobs:
            choice.logprobs += delta.new_logprobs
        if delta.finished:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = _stop_reason(delta)
            choice.error = _failure(delta)
            self.num_finished += 1
            self.metrics.e2e.observe(now - self.arrival)
        return choice, text

    async def collect(self, raw: Request) -> None:
        """Wait for every request to finish; abort them all if the client disconnects first."""
        waiter = asyncio.ensure_future(self._drain())
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not waiter.done():
                waiter.cancel()
                self.abort()
        waiter.result()  # re-raises ApiError from the engine side
        if self.choices and all(c.error is not None for c in self.choices):
            raise ApiError(500, self.choices[0].error)

    async def _drain(self) -> None:
        async for _ in self.deltas():
            pass

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_lens)
        completion = sum(len(c.token_ids) for c in self.choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    # ----------------------------------------------------------------------------- prompt extras
    def prompt_token_ids(self, choice: Choice) -> list[int] | None:
        """The prompt's ids as the engine ran them: the ids sent (a text prompt's, tokenized here), a
        media prompt's expansion (from its first delta), zeros for a prompt-embeds prompt (vLLM's
        placeholder ids); None for text the engine tokenized itself (a server without a tokenizer)."""
        if choice.prompt_token_ids is not None:
            return choice.prompt_token_ids
        prompt = self.given_prompts[choice.index // self.n] if self.given_prompts else None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt and "multi_modal_data" not in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt_embeds" in prompt and self.prompt_lens:
            return [0] * self.prompt_lens[choice.index // self.n]
        return None

    def prompt_extras(self, choice: Choice) -> dict[str, Any]:
        """`prompt_token_ids` / `prompt_logprobs` of a choice's prompt, those the request asked for."""
        out: dict[str, Any] = {}
        ids = self.prompt_token_ids(choice)
        if self.options.return_token_ids:
            out["prompt_token_ids"] = ids
        if self.options.prompt_logprobs:
            k = self.params[choice.index].prompt_logprobs or 0
            out["prompt_logprobs"] = prompt_logprobs_json(choice.prompt_logprobs, ids, k, self.token_text)
        return out

    # ----------------------------------------------------------------------------- completions
    def completion_logprobs(self, choice: Choice, start: int, offset: int = 0,
                            with_prompt: bool = False) -> CompletionLogprobs | None:
        """The choice's logprobs from output token `start` on (after its prompt's with `with_prompt`:
        echo), text offsets from `offset`."""
        if self.params[choice.index].logprobs is None:
            return None
        out = CompletionLogprobs()
        ids, entries = [], []
        if with_prompt:
            ids = self.prompt_token_ids(choice) or []
            entries = list(choice.prompt_logprobs or [None] * len(ids))
        if not self.options.prompt_only:
            ids, entries = ids + choice.token_ids[start:], entries + choice.logprobs[start:]
        for token_id, entry in zip(ids, entries):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(None if entry is None else _finite(entry.get(token_id)))
            top: dict[str, float | None] | None = None
            if entry is not None:
                top = {}
                for t, v in sorted(entry.items(), key=lambda kv: -kv[1]):  # ids sharing a text: best wins
                    top.setdefault(self.token_text(t), _finite(v))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _echo(self, choice: Choice) -> str:
        echo = self.options.echo
        return echo[choice.index // self.n] if echo else ""

    def completion_response(self) -> CompletionResponse:
        shown = self.options
        choices = [CompletionChoice(index=c.index, text=self._echo(c) + ("" if shown.prompt_only else c.text),
                                    logprobs=self.completion_logprobs(c, 0, with_prompt=shown.echo_logprobs),
                                    token_ids=list(c.token_ids) if self.options.return_token_ids else None,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                    **self.prompt_extras(c))
                   for c in self.choices]
        return CompletionResponse(id=self.base_id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage())

    async def completion_stream(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one write per batch of deltas (`deltas`), one event per choice in it;
        the usage event and `[DONE]` go with the last batch. A choice's first event carries the echoed
        prompt (and its logprobs and ids when asked for)."""
        offsets = [0] * len(self.choices)
        started = [False] * len(self.choices)

        def chunk(choice: Choice, delta: RequestDelta, text: str) -> str:
            first = not started[choice.index]
            started[choice.index] = True
            text = (self._echo(choice) if first else "") + ("" if self.options.prompt_only else text)
            start = len(choice.token_ids) - len(delta.new_token_ids)
            lp = self.completion_logprobs(choice, start, offsets[choice.index],
                                          with_prompt=first and self.options.echo_logprobs)
            offsets[choice.index] += len(text)
            body = {"id": self.base_id, "object": "text_completion", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": choice.index, "text": text,
                                 "logprobs": None if lp is None else lp.model_dump(),
                                 "finish_reason": delta.finish_reason if delta.finished else None,
                                 "stop_reason": _stop_reason(delta) if delta.finished else None}]}
            if self.options.return_token_ids:
                body["choices"][0]["token_ids"] = list(delta.new_token_ids)
                if first:
                    body["choices"][0]["prompt_token_ids"] = self.prompt_token_ids(choice)
            if include_usage:
                body["usage"] = None
            return _sse(body)

        def usage() -> str:
            return _sse({"id": self.base_id, "object": "text_completion", "created": self.created,
                         "model": self.model, "choices": [], "usage": self.usage().model_dump()})

        async for events in self._events(chunk, usage if include_usage else None):
            yield events

    # ----------------------------------------------------------------------------- chat
    def chat_logprobs(self, choice: Choice, start: int, top: int) -> ChatLogprobs | None:
        if self.params[choice.index].logprobs is None:
            return None
        content = []
        for token_id, entry in zip(choice.token_ids[start:], choice.logprobs[start:]):
            text = self.token_text(token_id)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            content.append(ChatTokenLogprob(
                token=text, logprob=_lp(entry.get(token_id)), bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=self.token_text(t), logprob=_lp(v),
                                         bytes=list(self.token_text(t).encode())) for t, v in ranked]))
        return ChatLogprobs(content=content)

    def chat_response(self, top: int) -> ChatCompletionResponse:
        echo = self.options.chat_echo
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=echo + c.text),
                              logprobs=self.chat_logprobs(c, 0, top), finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason,
                              token_ids=list(c.token_ids) if self.options.return_token_ids else None)
                   for c in self.choices]
        extras = self.prompt_extras(self.choices[0]) if self.choices else {}
        return ChatCompletionResponse(id=self.base_id, created=self.created, model=self.model,
                                      choices=choices, usage=self.usage(), **extras)

    async def chat_stream(self, include_usage: bool, top: int) -> AsyncIterator[str]:
        """Server-sent events as `completion_stream` writes them, after one role event per choice."""

        def event(index: int, delta: dict, **extra: Any) -> str:
            body = {"id": self.base_id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": extra.get("logprobs"),
                                 "finish_reason": extra.get("finish_reason"),
                                 "stop_reason": extra.get("stop_reason")}]}
            if "token_ids" in extra:
                body["choices"][0]["token_ids"] = extra["token_ids"]
            if "prompt_token_ids" in extra:
                body["prompt_token_ids"] = extra["prompt_token_ids"]
            if include_usage:
                body["usage"] = None
            return _sse(body)

        sent_prompt_ids = False

        def chunk(choice: Choice, delta: RequestDelta, text: str) -> str:
            nonlocal sent_prompt_ids
            start = len(choice.token_ids) - len(delta.new_token_ids)
            lp = self.chat_logprobs(choice, start, top)
            content = {"content": text} if text or not delta.finished else {}
            extra = {}
            if self.options.return_token_ids:
                extra["token_ids"] = list(delta.new_token_ids)
                if not sent_prompt_ids:  # once, at the top of the first chunk with tokens (a media
                    sent_prompt_ids = True  # prompt's expanded ids arrive with its first delta)
                    extra["prompt_token_ids"] = self.prompt_token_ids(choice)
            return event(choice.index, content, logprobs=None if lp is None else lp.model_dump(),
                         finish_reason=delta.finish_reason if delta.finished else None,
                         stop_reason=_stop_reason(delta) if delta.finished else None, **extra)

        def usage() -> str:
            return _sse({"id": self.base_id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model, "choices": [], "usage": self.usage().model_dump()})

        opening = [event(c.index, {"role": "assistant", "content": ""}) for c in self.choices]
        if self.options.chat_echo:
            opening += [event(c.index, {"content": self.options.chat_echo}) for c in self.choices]
        yield "".join(opening)
        async for events in self._events(chunk, usage if include_usage else None):
            yield events

    async def _events(self, chunk: Callable[[Choice, RequestDelta, str], str],
                      usage: Callable[[], str] | None) -> AsyncIterator[str]:
        """The stream's writes: per batch of deltas, `chunk`'s event for each (a failed choice's error
        event after its last one), with the `usage` event (when asked for) and `[DONE]` appended to the
        last batch; an engine-side error becomes one error event (the status line is sent already), then
        `[DONE]`. Leaving early (the client went: the generator is closed) aborts what is left."""
        try:
            async for batch in self.deltas():
                events = []
                for choice, text, delta in batch:
                    events.append(chunk(choice, delta, text))
                    failure = _failure(delta)
                    if failure is not None:  # after the choice's last chunk, which carries it as stop_reason
                        events.append(_sse({"error": {"message": failure, "type": "InternalServerError",
                                                      "param": None, "code": 500}}))
                if self.done:
                    events += [usage()] if usage is not None else []
                    events.append("data: [DONE]\n\n")
                yield "".join(events)
        except ApiError as err:
            yield _sse({"error": {"message": err.message, "type": "ServiceUnavailableError"
                                  if err.status == 503 else "InternalServerError", "param": None,
                                  "code": err.status}}) + "data: [DONE]\n\n"
        finally:
            if not self.done:
                self.abort()


def _failure(delta: RequestDelta) -> str | None:
    """Why a finished request failed (None: it did not): the engine's message, never left empty."""
    if not delta.finished or delta.finish_reason != "error":
        return None
    return bounded(getattr(delta, "error", None) or "the request failed while running (see the server's log)")


def _stop_reason(delta: RequestDelta) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or id that ended the request; for a failure, its reason."""
    failure = _failure(delta)
    return delta.stop_reason if failure is None else failure


def _finite(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else -9999.0


def _lp(value: float | None) -> float:
    finite = _finite(value)
    return -9999.0 if finite is None else finite


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
