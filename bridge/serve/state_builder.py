"""The routes' state (`ServerState`) built from `bridge serve`'s flags and an engine, wherever it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from bridge.serve.app import ServerState
from bridge.serve.chat import ChatRenderer
from bridge.serve.chat_template import resolve_chat_template
from bridge.serve.engine_build import audio_sample_rates, set_torch_threads
from bridge.serve.engine_process import EngineInfo, EngineLink, EngineProcess
from bridge.serve.ingest import DEFAULT_INLINE_BYTES, default_workers
from bridge.serve.inputs import ServeLimits, default_max_prompt_bytes
from bridge.serve.media_flags import media_limits
from bridge.serve.metrics import ServeMetrics
from runner.hf_config import load_tokenizer

if TYPE_CHECKING:
    from runner.llm import LLM


def ingest_workers(args: argparse.Namespace, device_type: str) -> int:
    """`--ingest-workers` as given, or the default for an engine on `device_type` (per API process)."""
    if args.ingest_workers is not None:
        return args.ingest_workers
    return default_workers(device_type, api_processes=args.api_server_count or 1)


_LOAD = object()


def server_state(args: argparse.Namespace, *, llm: LLM | None = None, name: str | None = None,
                 engine_process: EngineProcess | None = None, engine_link: EngineLink | None = None,
                 info: EngineInfo | None = None, ingest_pool: Any = None,
                 tokenizer: Any = _LOAD) -> ServerState:
    """The routes' state for an engine in this process (`llm`) or in an engine process (`info`, with
    the `engine_process` this process started or the `engine_link` its parent handed it). `ingest_pool`:
    the `ingest_workers(args, ...)` processes, already started. `tokenizer`: that of `info.llm_dir`,
    loaded ahead (None: it has none); by default it is loaded here."""
    limits = ServeLimits(max_prompts=args.max_prompts_per_request, max_n=args.max_n,
                         max_prompt_embeds_bytes=args.max_prompt_embeds_bytes,
                         enable_prompt_embeds=args.enable_prompt_embeds, media=media_limits(args))
    metrics = ServeMetrics()
    media_dir = Path(args.allowed_local_media_path) if args.allowed_local_media_path else None
    if llm is None:
        assert info is not None
        set_torch_threads(args, info.device_type)
        tokenizer = load_tokenizer(info.llm_dir) if tokenizer is _LOAD else tokenizer
        encoders = {m: SimpleNamespace(placeholder=token) for m, token in info.placeholders.items()}
        name, sample_rates = info.model_name, dict(info.sample_rates)
        device_type, hidden_size, max_model_len = info.device_type, info.hidden_size, info.max_model_len
    else:
        tokenizer, encoders = llm.tokenizer, dict(llm.mm.encoders)
        sample_rates = audio_sample_rates(encoders)
        device_type, hidden_size, max_model_len = llm.device.type, llm.hidden_size, llm.max_model_len
    limits.max_prompt_bytes = args.max_prompt_bytes or (
        default_max_prompt_bytes(tokenizer, max_model_len) if tokenizer is not None else None)
    template = resolve_chat_template(args.chat_template, tokenizer, args.path)
    chat = ChatRenderer(tokenizer, chat_template=template, encoders=encoders,
                        allowed_media_dir=media_dir, limits=limits, hidden_size=hidden_size,
                        max_model_len=max_model_len, metrics=metrics, sample_rates=sample_rates)
    return ServerState(llm=llm, engine_process=engine_process, engine_link=engine_link, engine_info=info,
                       tokenizer=tokenizer, model_name=args.served_model_name or name,
                       model_root=str(args.path),
                       limits=limits, chat=chat, metrics=metrics, api_key=args.api_key,
                       max_body_bytes=args.max_request_bytes, max_pending=args.max_pending_requests,
                       drain_timeout_s=args.shutdown_timeout,
                       ingest_workers=ingest_workers(args, device_type), ingest_pool=ingest_pool,
                       ingest_inline_bytes=(DEFAULT_INLINE_BYTES if args.ingest_inline_bytes is None
                                            else args.ingest_inline_bytes),
                       arrival_decode_window=args.arrival_decode_window)
