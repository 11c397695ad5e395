"""`bridge serve PATH`: load the one engine, then run uvicorn until SIGINT/SIGTERM.

PATH is a Hugging Face model directory (text, token ids, prompt embeds) or a Bridge run /
checkpoint directory: then the checkpoint's LLM is served with its trained encoders registered in
the engine (as `Bridge.from_checkpoint` finds them), so chat messages may carry media.

Shutdown: uvicorn stops accepting on SIGTERM, waits up to `--shutdown-timeout` s for open
connections (streams keep receiving tokens meanwhile), then the app's lifespan aborts what is left
and frees the engine; the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.serve.app import ServerState, build_app
from bridge.serve.chat import ChatRenderer
from bridge.serve.ingest import DEFAULT_INLINE_BYTES, default_workers
from bridge.serve.inputs import ServeLimits
from bridge.serve.metrics import ServeMetrics
from bridge.wire import DEFAULT_MAX_PROMPT_EMBEDS_BYTES
from runner.engine.warmup import warm_up_serving
from runner.llm import LLM

logger = logging.getLogger("bridge.serve")


@dataclass
class LoadedModel:
    llm_dir: Path
    encoders: dict[str, Any]
    dtype: str
    name: str


def resolve_model(path: str | Path) -> LoadedModel:
    """A HF model dir as is; a Bridge run or checkpoint dir -> its LLM dir, encoders and dtype."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory (give a Hugging Face model dir or a Bridge "
                         "run/checkpoint)")
    if (path / "config.json").is_file() and not (path / "meta.json").is_file():
        return LoadedModel(path, {}, "auto", path.name)
    from bridge.training import checkpoint as ckpt_io
    from encoders.api import load_encoder

    directory = path
    if not (directory / "meta.json").is_file():
        latest = ckpt_io.latest_checkpoint(directory)
        if latest is None:
            raise ValueError(f"{path} has no config.json (not a HF model dir) and no checkpoint "
                             "(not a Bridge run)")
        directory = latest
    meta = ckpt_io.read_meta(directory)
    llm_dir = directory / meta["llm_dir"] if meta["llm_dir"] == "llm" else Path(meta["llm_dir"])
    encoders = {m: load_encoder(directory / "encoder" / m) for m in meta["modalities"]}
    return LoadedModel(llm_dir, encoders, meta.get("llm_dtype", "float32"), path.name)


def build_llm(model: LoadedModel, args: argparse.Namespace) -> LLM:
    """The engine, with the checkpoint's encoders (moved to the engine's device) registered."""
    dtype = args.dtype if args.dtype != "auto" else model.dtype
    llm = LLM(str(model.llm_dir), enable_prompt_embeds=args.enable_prompt_embeds, dtype=dtype,
              device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
              kv_cache_memory=args.kv_cache_memory, enforce_eager=args.enforce_eager, seed=args.seed,
              enable_prefix_caching=args.enable_prefix_caching)
    for encoder in model.encoders.values():
        llm.register_encoder(encoder.to(llm.device).eval())
    return llm


def set_torch_threads(args: argparse.Namespace, device_type: str) -> None:
    """CPU threads for torch's ops in the server process: 1 on a GPU server unless told otherwise.

    There the process's own CPU tensor work is small (step inputs, uploads), while the host is busy
    with HTTP, the ingest workers and often the clients; an OpenMP team spread over busy cores waits
    at its barriers for descheduled threads (a 20 us copy took ms beside another busy process). vLLM
    runs its GPU workers with OMP_NUM_THREADS=1 for the same reason. A CPU server keeps torch's
    default: there the model runs on those threads.
    """
    import torch

    threads = args.torch_threads if args.torch_threads is not None else (1 if device_type == "cuda" else None)
    if threads is not None:
        torch.set_num_threads(threads)


def load_server_state(args: argparse.Namespace) -> ServerState:
    model = resolve_model(args.path)
    llm = build_llm(model, args)
    set_torch_threads(args, llm.device.type)
    if llm.device.type == "cuda":  # the kernels a server's bursts meet, built before the first one
        compiles = llm.kernel_compiles
        before = compiles.count if compiles is not None else 0
        seconds = warm_up_serving(llm)
        built = (compiles.count - before) if compiles is not None else 0
        logger.info("serving warm-up: %.2f s, %d Triton kernels built", seconds, built)
    limits = ServeLimits(max_prompts=args.max_prompts_per_request, max_n=args.max_n,
                         max_prompt_embeds_bytes=args.max_prompt_embeds_bytes,
                         enable_prompt_embeds=args.enable_prompt_embeds)
    metrics = ServeMetrics()
    template = Path(args.chat_template).read_text() if args.chat_template else None
    media_dir = Path(args.allowed_local_media_path) if args.allowed_local_media_path else None
    chat = ChatRenderer(llm.tokenizer, chat_template=template, encoders=dict(llm.mm.encoders),
                        allowed_media_dir=media_dir, limits=limits, hidden_size=llm.hidden_size,
                        max_model_len=llm.max_model_len, metrics=metrics)
    return ServerState(llm=llm, model_name=args.served_model_name or model.name, model_root=str(args.path),
                       limits=limits, chat=chat, metrics=metrics, api_key=args.api_key,
                       max_body_bytes=args.max_request_bytes, max_pending=args.max_pending_requests,
                       drain_timeout_s=args.shutdown_timeout,
                       ingest_workers=(default_workers(llm.device.type) if args.ingest_workers is None
                                       else args.ingest_workers),
                       ingest_inline_bytes=args.ingest_inline_bytes,
                       arrival_decode_window=args.arrival_decode_window)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bridge serve` flags (vLLM's names where vLLM has the flag)."""
    parser.add_argument("path", help="a Hugging Face model dir, or a Bridge run / checkpoint dir")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/*")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the directory's name)")
    parser.add_argument("--enable-prompt-embeds", action="store_true", help="accept prompt_embeds payloads")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (default: the tokenizer's)")
    parser.add_argument("--allowed-local-media-path", default=None,
                        help="let image_url name local files under this directory")
    parser.add_argument("--max-request-bytes", type=int, default=512 * 2**20, help="request body size limit")
    parser.add_argument("--max-prompt-embeds-bytes", type=int, default=DEFAULT_MAX_PROMPT_EMBEDS_BYTES,
                        help="cap on one prompt_embeds tensor's dense size")
    parser.add_argument("--max-prompts-per-request", type=int, default=256)
    parser.add_argument("--max-n", type=int, default=16, help="largest n (samples per prompt)")
    parser.add_argument("--max-pending-requests", type=int, default=1024,
                        help="requests in flight beyond which new ones get 503 + Retry-After")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish on SIGTERM before they are aborted")
    parser.add_argument("--ingest-workers", type=int, default=None,
                        help="processes that parse large JSON bodies and decode prompt_embeds payloads "
                             "off the engine's process (default: half the cores up to 8 with a GPU, 0 on the "
                             "CPU)")
    parser.add_argument("--ingest-inline-bytes", type=int, default=DEFAULT_INLINE_BYTES,
                        help="bodies up to this size are parsed in the server process (default 256 KiB)")
    parser.add_argument("--arrival-decode-window", type=int, default=None,
                        help="greedy decode steps per window while requests are being received or parsed "
                             "(default 4; the engine's full window once they are in)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch CPU threads in the server process (default: 1 with a GPU engine, "
                             "torch's default on the CPU)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    engine = parser.add_argument_group("engine options (runner.LLM)")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--device", default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    engine.add_argument("--enable-prefix-caching", action="store_true")
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument("--seed", type=int, default=0)


def _graceful_server_cls():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its shutdown (the process then dies of the signal);
        here a signal only starts the graceful shutdown, and the process exits 0 after it."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def serve(args: argparse.Namespace) -> int:
    """Load the engine and serve until a signal; 0 on a clean shutdown."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = load_server_state(args)
    logger.info("serving %s as %r on http://%s:%d", args.path, state.model_name, args.host, args.port)
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)),
                            limit_concurrency=None, access_log=False)
    _graceful_server_cls()(config).run()
    return 0
