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
from bridge.serve.engine_process import EngineInfo, EngineLink, EngineProcess, EngineProcessFront
from bridge.serve.errors import ApiError, bounded, install_error_handlers
from bridge.serve.generation import Generation, TokenText
from bridge.serve.guards import BODY_RECEIVED, Guards
from bridge.serve.ingest import BodyParser, EmbedsSpec, IngestRoute
from bridge.serve.inputs import (
    ServeLimits,
    check_prompt_logprobs,
    completion_prompts,
    echo_texts,
    samples_params,
)
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
from bridge.serve.request_fields import check_request_fields
from bridge.serve.response_extras import ResponseOptions
from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY

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
            self.loop = EngineProcessFront(link, self.engine_info, max_pending=self.max_pending,
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

    def token_text(body: CompletionRequest | ChatCompletionRequest) -> TokenText:
        as_ids = bool(body.return_tokens_as_token_ids)
        return TokenText(state.tokenizer, as_ids=True) if as_ids else state.token_text

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
        check_request_fields(body)
        prompt_logprobs = check_prompt_logprobs(body)
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                           param="max_tokens")
        if body.prompt_embeds is not None and (body.echo or prompt_logprobs is not None):
            field = "echo" if body.echo else "prompt_logprobs"
            raise ApiError(400, f"{field} is not available with prompt_embeds (an embeddings prompt has no "
                           "prompt tokens)", param=field)
        prompts = await completion_prompts(body, hidden_size=state.hidden_size,
                                           max_model_len=state.max_model_len, limits=state.limits,
                                           metrics=state.metrics, tokenizer=state.tokenizer,
                                           decoded=getattr(raw.state, "prompt_embeds", None))
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        echo_logprobs = body.echo and body.logprobs is not None
        if echo_logprobs and prompt_logprobs is None:
            prompt_logprobs = body.logprobs  # vLLM: echo shows the prompt logprobs, top k of logprobs
        options = ResponseOptions(
            return_token_ids=bool(body.return_token_ids), prompt_logprobs=prompt_logprobs is not None,
            echo=await echo_texts(body, state.tokenizer) if body.echo else None, echo_logprobs=echo_logprobs,
            prompt_only=body.echo and max_tokens == 0)
        params = samples_params(body, max_tokens=max(max_tokens, 1), logprobs=body.logprobs,
                                limits=state.limits, prompt_logprobs=prompt_logprobs)
        parsed(raw)
        gen = Generation(state.loop, state.metrics, base_id=f"cmpl-{uuid.uuid4().hex}",
                         model=state.model_name, prompts=prompts, params=params, n=body.n, check_context=True,
                         token_text=token_text(body), options=options)
        await gen.submit()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(gen.completion_stream(include_usage), media_type="text/event-stream")
        await gen.collect(raw)
        return JSONResponse(gen.completion_response().model_dump())

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        check_request_fields(body)
        prompt_logprobs = check_prompt_logprobs(body)
        prompt = await state.chat.prompt(body)
        if prompt_logprobs is not None and PROMPT_EMBEDS_MODALITY in prompt.get("multi_modal_data", {}):
            raise ApiError(400, "prompt_logprobs are not available for a conversation with prompt_embeds "
                           "parts", param="prompt_logprobs")
        given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = state.max_model_len if given is None else given
        top = body.top_logprobs or 0
        logprobs = top if body.logprobs else None
        if top and not body.logprobs:  # vLLM: top_logprobs 0 goes without logprobs
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        params = samples_params(body, max_tokens=max_tokens, logprobs=logprobs, limits=state.limits,
                                prompt_logprobs=prompt_logprobs)
        options = ResponseOptions(return_token_ids=bool(body.return_token_ids),
                                  prompt_logprobs=prompt_logprobs is not None,
                                  chat_echo=state.chat.echo(body))
        parsed(raw)
        gen = Generation(state.loop, state.metrics, base_id=f"chatcmpl-{uuid.uuid4().hex}",
                         model=state.model_name, prompts=[prompt], params=params, n=body.n,
                         check_context=given is not None, token_text=token_text(body), options=options)
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
