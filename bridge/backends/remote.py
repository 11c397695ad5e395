"""`RemoteBackend`: the LLM behind any vLLM-compatible server, the encoders here.

Each prompt becomes one `POST {base_url}/v1/completions` with its embeddings in `prompt_embeds`
(completions.py). Requests go out concurrently, at most `max_concurrency` in flight, from an
`httpx.AsyncClient` on a private event-loop thread (loop_thread.py), so `generate` is an ordinary
blocking call and throughput is the server's. Encoding (`torch.save` + base64 + JSON, ~tens of MB
for a long prompt) runs in a thread pool, never on the event loop, inside the concurrency slot so
that at most `max_concurrency` encoded bodies are alive at once.

Faults (retry.py): transient ones are retried with backoff up to `retries` times; a 4xx raises at
once with the server's message. In a batch every prompt runs to its end: failures are collected
and raised together as `GenerationError`, which keeps the finished outputs.
"""

from __future__ import annotations

import asyncio
import copy
import json
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch
from tqdm.auto import tqdm

from bridge.backends.completions import completion_body, encode_body, parse_completion, parse_logprobs
from bridge.backends.errors import RemoteError, RemoteHTTPError, RemoteModelMismatch
from bridge.backends.identity import ModelExpectation, pick_model, served_cards
from bridge.backends.loop_thread import LoopThread
from bridge.backends.retry import (
    Backoff,
    describe_transport_error,
    is_retryable_exception,
    is_retryable_status,
    retry_after_seconds,
)
from bridge.wire import encode_prompt_embeds
from runner.outputs import CompletionOutput, GenerationError, RequestOutput
from runner.sampling_params import SamplingParams

_STREAM_END = object()


def _server_message(response: httpx.Response) -> str:
    """OpenAI/vLLM errors are {"error": {"message": ...}} (older vLLM: {"message": ...})."""
    try:
        data = response.json()
    except ValueError:
        return response.text or response.reason_phrase
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(data.get("message"), str):
            return data["message"]
        if isinstance(data.get("detail"), str):
            return data["detail"]
    return response.text


def _check_url(base_url: str) -> str:
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"backend URL must start with http:// or https://, got {str(base_url)[:200]!r}")
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class RemoteBackend:
    """Generation on a vLLM-compatible server (vLLM with `--enable-prompt-embeds`, `bridge serve`).

    `model`: the served model id to use (default: the one that names the base LLM). `timeout`:
    seconds per HTTP request (connect, each read, each write). `retries`: extra attempts after a
    transient failure. `check_model=False` skips the name check (the hidden size is always checked).
    `tokenizer` re-derives token ids from the text when the server does not return them.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 120.0,
        max_concurrency: int = 16,
        retries: int = 3,
        backoff: Backoff | None = None,
        check_model: bool = True,
        tokenizer=None,
    ):
        self.base_url = _check_url(base_url)
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.api_key = api_key
        self.requested_model = model
        self.model: str | None = model
        self.timeout = float(timeout)
        self.max_concurrency = max_concurrency
        self.retries = retries
        self.backoff = backoff or Backoff()
        self.check_model = check_model
        self.tokenizer = tokenizer
        self._verified: ModelExpectation | None = None
        self._verify_lock = threading.Lock()
        self._loop = LoopThread()
        self._client: httpx.AsyncClient | None = None
        self._pool = ThreadPoolExecutor(max_workers=min(4, max_concurrency),
                                        thread_name_prefix="bridge-encode")
        self._counter = 0

    def __repr__(self) -> str:
        return f"RemoteBackend({self.base_url!r}, model={self.model!r})"

    # ------------------------------------------------------------------ plumbing
    def _http(self) -> httpx.AsyncClient:
        """The client, created on (and only used from) the loop thread."""
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=httpx.Timeout(self.timeout),
                limits=httpx.Limits(max_connections=self.max_concurrency,
                                    max_keepalive_connections=self.max_concurrency),
            )
        return self._client

    async def _with_retries(
        self, label: str, send: Callable[[], Awaitable[httpx.Response]]
    ) -> httpx.Response:
        """`send()` until it answers < 400, a non-retryable status, or `retries` run out."""
        last: RemoteError | None = None
        for attempt in range(self.retries + 1):
            retry_after = None
            try:
                response = await send()
            except Exception as exc:  # noqa: BLE001 - sorted just below
                if not is_retryable_exception(exc):
                    raise
                what = describe_transport_error(exc, self.timeout)
                last = RemoteError(f"{label}: {what}", attempts=attempt + 1)
                last.__cause__ = exc
            else:
                if response.status_code < 400:
                    return response
                await response.aread()
                error = RemoteHTTPError(response.status_code, _server_message(response), attempts=attempt + 1)
                if not is_retryable_status(response.status_code):
                    raise error
                last, retry_after = error, retry_after_seconds(response)
            if attempt < self.retries:
                await asyncio.sleep(self.backoff.delay(attempt, retry_after))
        assert last is not None
        tries = f"{self.retries + 1} attempt{'s' if self.retries else ''}"
        if isinstance(last, RemoteHTTPError):
            raise RemoteHTTPError(last.status, f"{last.server_message} (gave up after {tries})",
                                  attempts=self.retries + 1)
        raise RemoteError(f"{last} (gave up after {tries})", attempts=self.retries + 1) from last.__cause__

    def _post(self, path: str, content: bytes, **kw):
        client = self._http()
        headers = {"Content-Type": "application/json"}
        return lambda: client.post(path, content=content, headers=headers, **kw)

    async def _encode(self, tensor: torch.Tensor, params: SamplingParams, stream: bool = False) -> bytes:
        def work() -> bytes:
            return encode_body(completion_body(encode_prompt_embeds(tensor), params, model=self.model,
                                               stream=stream))

        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def _next_id(self) -> str:
        self._counter += 1
        return f"remote-{self._counter}"

    # ------------------------------------------------------------------ model check
    def verify(self, expected: ModelExpectation) -> None:
        """Once per backend: the server serves the base LLM (by name, unless check_model=False) with
        `expected.hidden_size`. RemoteModelMismatch otherwise; nothing of the caller's is sent."""
        with self._verify_lock:
            if self._verified == expected:
                return
            self._loop.run(self._verify(expected))
            self._verified = expected

    async def _verify(self, expected: ModelExpectation) -> None:
        client = self._http()
        response = await self._with_retries(f"GET {self.base_url}/v1/models",
                                            lambda: client.get("/v1/models"))
        try:
            data = response.json()
        except ValueError:
            data = response.text
        cards = served_cards(data, self.base_url)
        self.model = pick_model(cards, requested=self.requested_model, expected=expected,
                                check_name=self.check_model, url=self.base_url)
        probe = torch.zeros(1, expected.hidden_size, dtype=torch.float32)
        body = await self._encode(probe, SamplingParams(max_tokens=1, temperature=0.0))
        try:
            await self._with_retries("prompt-embeds probe", self._post("/v1/completions", body))
        except RemoteHTTPError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                raise RemoteModelMismatch(
                    f"{self.base_url} (model {self.model!r}) refused a (1, {expected.hidden_size}) "
                    "prompt-embeds probe, so it does not take this Bridge's embeddings (a different LLM, or "
                    "prompt embeds not enabled: vLLM needs --enable-prompt-embeds): "
                    f"HTTP {exc.status}: {exc.server_message}"
                ) from None
            raise

    # ------------------------------------------------------------------ generate
    async def _one(self, request: dict, params: SamplingParams, slots: asyncio.Semaphore) -> RequestOutput:
        async with slots:
            body = await self._encode(request["prompt_embeds"], params)
            response = await self._with_retries(f"POST {self.base_url}/v1/completions",
                                                self._post("/v1/completions", body))
            del body
        try:
            data = response.json()
        except ValueError:
            raise RemoteError(f"the server's completion is not JSON: {response.text[:200]!r}") from None
        return parse_completion(data, request_id=self._next_id(), prompt_token_ids=_prompt_ids(request),
                                tokenizer=self.tokenizer)

    async def _all(self, requests: Sequence[dict], params: Sequence[SamplingParams], bar: tqdm) -> list:
        slots = asyncio.Semaphore(self.max_concurrency)

        async def counted(request: dict, p: SamplingParams) -> RequestOutput:
            try:
                return await self._one(request, p, slots)
            finally:
                bar.update(1)

        return await asyncio.gather(*(counted(r, p) for r, p in zip(requests, params)),
                                    return_exceptions=True)

    def generate(self, requests: Sequence[dict], sampling_params: SamplingParams | Sequence[SamplingParams],
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per request (dicts with `prompt_embeds`, as `Bridge.build_requests`
        makes), in order. GenerationError when any failed (it holds the rest). `use_tqdm=True`:
        a progress bar of finished requests on stderr."""
        requests = list(requests)
        params = ([sampling_params] * len(requests) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(requests):
            raise ValueError(f"{len(params)} sampling params for {len(requests)} prompts")
        for p in params:
            completion_body("", p, model=None)  # unsupported params fail before anything is sent
        with tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            results = self._loop.run(self._all(requests, params, bar))
        failed = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
        if failed:
            raise GenerationError(failed, [None if i in failed else r for i, r in enumerate(results)])
        return results

    # ------------------------------------------------------------------ streaming
    def stream(self, request: dict, sampling_params: SamplingParams) -> Iterator[RequestOutput]:
        """One request, streamed: a RequestOutput (text and tokens so far) per server chunk; the last
        has `finished=True`. Retried only until the first chunk arrives."""
        completion_body("", sampling_params, model=None)
        chunks: queue.Queue = queue.Queue()
        future = self._loop.submit(self._stream(request, sampling_params, chunks))
        out = RequestOutput(request_id=self._next_id(), prompt=None, prompt_token_ids=_prompt_ids(request),
                            outputs=[CompletionOutput(index=0, text="", token_ids=[])], finished=False)
        done = False
        try:
            while True:
                item = chunks.get()
                if item is _STREAM_END:
                    break
                if isinstance(item, BaseException):
                    raise item
                self._apply_chunk(out, item)
                yield copy.deepcopy(out)  # a snapshot, as LLM.step gives: later chunks do not change it
            done = True
        finally:
            if not done:  # the consumer stopped early, or a chunk failed: stop reading the stream
                future.cancel()
        future.result()
        if not out.finished:
            raise RemoteError("the server ended the stream before the completion finished")

    def _apply_chunk(self, out: RequestOutput, chunk: dict) -> None:
        try:
            choice = chunk["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise RemoteError(f"not a completions stream chunk: {json.dumps(chunk)[:200]}") from None
        comp = out.outputs[0]
        delta = choice.get("text") or ""
        comp.text += delta
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            comp.token_ids.extend(int(i) for i in ids)
        elif delta and self.tokenizer is not None:
            comp.token_ids = list(self.tokenizer.encode(comp.text, add_special_tokens=False))
        rows = parse_logprobs(choice.get("logprobs"))
        if rows:
            comp.logprobs = (comp.logprobs or []) + rows
        if choice.get("finish_reason") is not None:
            comp.finish_reason = choice["finish_reason"]
            comp.stop_reason = choice.get("stop_reason")
            out.finished = True

    async def _stream(self, request: dict, params: SamplingParams, chunks: queue.Queue) -> None:
        try:
            body = await self._encode(request["prompt_embeds"], params, stream=True)
            client = self._http()

            async def open_stream() -> httpx.Response:
                req = client.build_request("POST", "/v1/completions", content=body,
                                           headers={"Content-Type": "application/json"})
                return await client.send(req, stream=True)

            response = await self._with_retries(f"POST {self.base_url}/v1/completions (stream)", open_stream)
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        break
                    chunks.put(json.loads(payload))
            finally:
                await response.aclose()
        except Exception as exc:  # noqa: BLE001 - handed to the consuming thread
            if isinstance(exc, httpx.TransportError):
                exc = RemoteError(f"stream: {describe_transport_error(exc, self.timeout)}")
            chunks.put(exc)
        finally:
            chunks.put(_STREAM_END)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                self._loop.run(client.aclose())
            except RuntimeError:
                pass
        self._loop.stop()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> RemoteBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _prompt_ids(request: dict) -> list[int]:
    """The prompt's token ids with 0 where it carries embeddings (as the local engine reports them)."""
    ids = request.get("prompt_token_ids")
    if ids is None:
        return [0] * int(request["prompt_embeds"].shape[0])
    mask = request.get("prompt_is_token_ids")
    if mask is None:
        return list(ids)
    return [int(i) if bool(m) else 0 for i, m in zip(ids, mask.tolist())]
