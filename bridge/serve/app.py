"""The FastAPI application: routes that validate, submit, stream and abort; nothing here runs the model.

`build_app(server)` wires a loaded `ServerState` (the engine, its loop task, limits, metrics, chat
renderer) into routes; the app's lifespan starts the engine loop, and at its shutdown frees the engine.
Draining comes first: `ServerState.drain`, which the server runs as soon as a SIGTERM's shutdown
starts (`uvicorn_server.py`), lets live requests finish within the drain timeout and ends the rest,
each stream with an error event and `[DONE]`.
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

import bridge
from bridge.serve.arrivals import Arrivals
from bridge.serve.chat import ChatRenderer
from bridge.serve.engine_loop import EngineFront, EngineLoop
from bridge.serve.engine_process import EngineInfo, EngineLink, EngineProcess, RemoteEngineLoop
from bridge.serve.errors import ApiError, bounded, install_error_handlers
from bridge.serve.generation import Generation, TokenText
from bridge.serve.guards import BODY_RECEIVED, Guards
from bridge.serve.ingest import BodyParser, EmbedsSpec, IngestRoute
from bridge.serve.inputs import ServeLimits, completion_prompts, samples_params
from bridge.serve.metrics import ServeMetrics
from bridge.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)

if TYPE_CHECKING:
    from runner.llm import LLM

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


@dataclass
class ServerState:
    """Everything the routes need; built by `bridge.serve.server.load_server_state`.

    The engine is `llm`, in this process, or runs in an engine process (`engine_info`): started by this
    process (`engine_process`), or by the parent of several API processes, this one talking to it over
    `engine_link`. The routes only see the front (`loop`) and the sizes below.
    """

    llm: LLM | None
    model_name: str
    model_root: str
    limits: ServeLimits
    chat: ChatRenderer
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    api_key: str | None = None
    max_body_bytes: int = 512 * 2**20
    max_pending: int = 1024
    drain_timeout_s: float = 30.0
    ingest_workers: int = 0
    ingest_inline_bytes: int = 256 * 2**10
    arrival_decode_window: int | None = None
    engine_process: EngineProcess | None = None
    engine_link: EngineLink | None = None  # an API process of several: its pipes to the engine process
    engine_info: EngineInfo | None = None
    tokenizer: Any = None
    loop: EngineFront | None = None
    ingest_pool: Any = None  # a ProcessPoolExecutor of ingest_workers processes started ahead, or None

    def __post_init__(self) -> None:
        if self.llm is not None:
            self.hidden_size, self.max_model_len = self.llm.hidden_size, self.llm.max_model_len
            self.tokenizer = self.tokenizer if self.tokenizer is not None else self.llm.tokenizer
        elif self.engine_info is not None and (self.engine_process or self.engine_link) is not None:
            info = self.engine_info
            self.hidden_size, self.max_model_len = info.hidden_size, info.max_model_len
        else:
            raise ValueError("ServerState needs an llm, or an engine_process with its engine_info")
        spec = EmbedsSpec(enabled=self.limits.enable_prompt_embeds, hidden_size=self.hidden_size,
                          max_bytes=self.limits.max_prompt_embeds_bytes, max_rows=self.max_model_len,
                          max_prompts=self.limits.max_prompts)
        self.body_parser = BodyParser(spec, workers=self.ingest_workers,
                                      inline_bytes=self.ingest_inline_bytes, metrics=self.metrics,
                                      pool=self.ingest_pool)
        self.arrivals = Arrivals()
        self.arrivals.listeners.append(lambda: self.metrics.arriving.set(self.arrivals.count))
        if self.llm is not None:
            self.loop = EngineLoop(self.llm, max_pending=self.max_pending, metrics=self.metrics,
                                   arrivals=self.arrivals, arrival_decode_window=self.arrival_decode_window)
        else:
            # In the process that started the engine (one API process) the loop also waits for its end.
            link = self.engine_link or self.engine_process.links[0]
            on_finish = self.engine_process.join if self.engine_link is None else None
            self.loop = RemoteEngineLoop(link, self.engine_info, max_pending=self.max_pending,
                                         metrics=self.metrics, arrivals=self.arrivals, on_finish=on_finish)
        self.token_text = TokenText(self.tokenizer)

    async def drain(self) -> None:
        """The start of a shutdown: running requests get `drain_timeout_s`, then each left is ended."""
        await self.loop.drain(self.drain_timeout_s)


def build_app(state: ServerState) -> Guards:
    """The ASGI app to hand uvicorn (FastAPI behind the guards middleware)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.body_parser.start()
        state.loop.start()
        try:
            yield
        finally:
            await state.loop.stop(state.drain_timeout_s)
            state.body_parser.close()
            if state.llm is not None:
                state.llm.shutdown()

    app = FastAPI(title="Bridge OpenAI-compatible server", version=_version(), lifespan=lifespan)
    app.router.route_class = IngestRoute  # JSON bodies through state.body_parser (ingest.py)
    app.state.body_parser = state.body_parser
    install_error_handlers(app)

    def parsed(raw: Request) -> None:
        """Record the body-to-prompts time (the parse and payload decode) of the request."""
        received = raw.scope.get(BODY_RECEIVED)
        if received is not None:
            state.metrics.parse_seconds.observe(time.perf_counter() - received)

    def check_model(name: str | None) -> None:
        # the served name, or the PATH the server was started with (vLLM's default name)
        if name is not None and name not in (state.model_name, state.model_root):
            raise ApiError(404, f"the model {bounded(name, 100)!r} does not exist (this server serves "
                           f"{state.model_name!r})", param="model")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.loop.healthy else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, root=state.model_root,
                                         max_model_len=state.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        prompts = await completion_prompts(body, hidden_size=state.hidden_size,
                                           max_model_len=state.max_model_len, limits=state.limits,
                                           metrics=state.metrics, tokenizer=state.tokenizer,
                                           decoded=getattr(raw.state, "prompt_embeds", None))
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = samples_params(body, max_tokens=max_tokens, logprobs=body.logprobs, limits=state.limits)
        parsed(raw)
        gen = Generation(state.loop, state.metrics, base_id=f"cmpl-{uuid.uuid4().hex}",
                         model=state.model_name, prompts=prompts, params=params, n=body.n, check_context=True,
                         token_text=state.token_text)
        await gen.submit()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(gen.completion_stream(include_usage, bool(body.return_token_ids)),
                                     media_type="text/event-stream")
        await gen.collect(raw)
        return JSONResponse(gen.completion_response(bool(body.return_token_ids)).model_dump())

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        prompt = await state.chat.prompt(body)
        given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = state.max_model_len if given is None else given
        top = body.top_logprobs or 0
        logprobs = top if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        params = samples_params(body, max_tokens=max_tokens, logprobs=logprobs, limits=state.limits)
        parsed(raw)
        gen = Generation(state.loop, state.metrics, base_id=f"chatcmpl-{uuid.uuid4().hex}",
                         model=state.model_name, prompts=[prompt], params=params, n=body.n,
                         check_context=given is not None, token_text=state.token_text)
        await gen.submit()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(gen.chat_stream(include_usage, top), media_type="text/event-stream")
        await gen.collect(raw)
        return JSONResponse(gen.chat_response(top).model_dump())

    return Guards(app, api_key=state.api_key, max_body_bytes=state.max_body_bytes, metrics=state.metrics,
                  arrivals=state.arrivals)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("bridge")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
        return getattr(bridge, "__version__", "0.1.0")
