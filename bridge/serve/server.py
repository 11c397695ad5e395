"""`bridge serve PATH`: load the one engine, then run uvicorn until SIGINT/SIGTERM.

PATH is a Hugging Face model directory (text, token ids, prompt embeds) or a Bridge run /
checkpoint directory: then the checkpoint's LLM is served with its trained encoders registered in
the engine (as `Bridge.from_checkpoint` finds them), so chat messages may carry media.

Where things run: the engine in this process, or (`--engine-process`, the default with a CUDA
engine) in its own (`engine_process.py`), with `--api-server-count N` API processes in front of it
(`api_servers.py`; this process then only starts and watches them). Start-up order there: the port
is bound and the engine process launched before this process imports what the routes need (a
second or more of it on the engine's path), and the API processes serve `/health` (503) while the
engine builds (`starting.py`), 200 once it is ready.

Shutdown: uvicorn stops accepting on SIGTERM while running requests get up to `--shutdown-timeout` s
(streams keep receiving tokens meanwhile); each one left then ends with an error event and `[DONE]`
(a non-streaming one with a 503), the engine is freed and the process exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from typing import TYPE_CHECKING

from bridge.serve.engine_build import engine_device_type
from bridge.serve.engine_flags import add_engine_flags
from bridge.serve.media_flags import media_limits
from bridge.wire import DEFAULT_MAX_PROMPT_EMBEDS_BYTES
from encoders.media_budget import MediaLimits

if TYPE_CHECKING:
    from bridge.serve.app import ServerState

# The server extra, checked here (what `bridge serve` imports first) without importing it: the routes'
# modules are imported only where they run.
for _module in ("fastapi", "uvicorn", "prometheus_client"):
    if importlib.util.find_spec(_module) is None:
        raise ImportError(f"No module named {_module!r}")

logger = logging.getLogger("bridge.serve")


def use_engine_process(args: argparse.Namespace) -> bool:
    """`--engine-process` as given; by default on when the engine will run on a CUDA device."""
    if args.engine_process is not None:
        return args.engine_process
    return engine_device_type(args) == "cuda"


def default_api_server_count(args: argparse.Namespace) -> int:
    """Half the cores, up to 8, for a CUDA engine in its own process (its default), else 1.

    Why several: a burst of large prompt-embeds bodies is parsed by the API processes, each in its own
    interpreter; with one, 64 bodies of 1.4 MB reached the engine over 0.2 s and the batch started
    late (W1 behind the server at 64 clients: 0.58 of offline throughput with one API process, 0.88
    with eight, benchmarks/RESULTS.md). Half the cores leaves the rest to the engine process and to
    whatever sends the requests."""
    if not use_engine_process(args) or engine_device_type(args) != "cuda":
        return 1
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def load_server_state(args: argparse.Namespace) -> ServerState:
    """The routes' state with the engine in this process, built and warmed up."""
    from bridge.serve.engine_build import build_ready_llm, resolve_model
    from bridge.serve.state_builder import server_state

    model = resolve_model(args.path, verify=not args.no_verify)
    return server_state(args, llm=build_ready_llm(model, args), name=model.name)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bridge serve` flags (vLLM's names where vLLM has the flag)."""
    parser.add_argument("path", help="a Hugging Face model dir, or a Bridge run / checkpoint dir")
    parser.add_argument("--no-verify", action="store_true",
                        help="serve a Bridge checkpoint even when its files differ from its manifest.json")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/*")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the directory's name)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (default: the tokenizer's; for a Bridge run "
                             "whose tokenizer has none, one made from its recipe's data.prompt)")
    parser.add_argument("--allowed-local-media-path", default=None,
                        help="let image_url name local files under this directory")
    parser.add_argument("--max-request-bytes", type=int, default=512 * 2**20, help="request body size limit")
    parser.add_argument("--max-prompt-embeds-bytes", type=int, default=DEFAULT_MAX_PROMPT_EMBEDS_BYTES,
                        help="cap on one prompt_embeds tensor's dense size")
    parser.add_argument("--max-prompts-per-request", type=int, default=256)
    parser.add_argument("--max-prompt-bytes", type=int, default=None,
                        help="UTF-8 bytes of text per prompt (a chat: all its messages), refused before "
                             "tokenizing (default: the context length times the tokenizer's longest token)")
    media = MediaLimits()
    parser.add_argument("--max-media-items", type=int, default=media.max_items,
                        help="media parts per chat request, counted before any is read")
    parser.add_argument("--max-image-pixels", type=int, default=media.max_image_pixels,
                        help="pixels of a request's images together, from their headers before decoding")
    parser.add_argument("--max-audio-samples", type=int, default=media.max_audio_samples,
                        help="samples of a request's audio together at its encoder's rate (WAV headers)")
    parser.add_argument("--max-audio-file-samples", type=int, default=media.max_audio_file_samples,
                        help="samples of a request's WAVs together as stored (frames x channels)")
    parser.add_argument("--max-graph-nodes", type=int, default=media.max_graph_nodes,
                        help="nodes of a request's graphs together, as declared")
    parser.add_argument("--max-graph-edges", type=int, default=media.max_graph_edges,
                        help="edges of a request's graphs together")
    parser.add_argument("--max-n", type=int, default=16, help="largest n (samples per prompt)")
    parser.add_argument("--max-pending-requests", type=int, default=1024,
                        help="requests in flight beyond which new ones get 503 + Retry-After")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish on SIGTERM before they are aborted")
    parser.add_argument("--ingest-workers", type=int, default=None,
                        help="processes per API process that parse large JSON bodies and decode "
                             "prompt_embeds payloads (default: half the cores up to 8 with a GPU and one API "
                             "process; 0, parsing in the event loop, with several or on the CPU)")
    parser.add_argument("--ingest-inline-bytes", type=int, default=None,  # None: ingest.DEFAULT_INLINE_BYTES
                        help="bodies up to this size are parsed in the server process (default 256 KiB)")
    parser.add_argument("--arrival-decode-window", type=int, default=None,
                        help="greedy decode steps per window while requests are being received or parsed "
                             "(default 4; the engine's full window once they are in)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine in its own process, HTTP and parsing in this one (default: on "
                             "with a CUDA engine, off on the CPU)")
    parser.add_argument("--api-server-count", type=int, default=None,
                        help="API processes sharing the port in front of the one engine process (vLLM's "
                             "flag; default: half the cores, up to 8, with the engine in its own process, "
                             "else 1); above 1 the engine runs in its own process")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch CPU threads in the server process (default: 1 with a GPU engine, "
                             "torch's default on the CPU)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    add_engine_flags(parser)


def serve(args: argparse.Namespace) -> int:
    """Load the engine and serve until a signal; 0 on a clean shutdown."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.api_server_count is None:
        args.api_server_count = default_api_server_count(args)  # the API processes inherit the count
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    media_limits(args)  # a bad limit is refused before the engine builds
    if args.max_prompt_bytes is not None and args.max_prompt_bytes < 1:
        raise ValueError(f"--max-prompt-bytes must be >= 1, got {args.max_prompt_bytes}")
    if args.api_server_count > 1 and args.engine_process is False:
        raise ValueError("--api-server-count above 1 needs the engine in its own process "
                         "(drop --no-engine-process)")
    if args.api_server_count > 1 or use_engine_process(args):
        from bridge.serve.api_servers import serve_with_api_servers

        return serve_with_api_servers(args)
    from bridge.serve.app import build_app
    from bridge.serve.uvicorn_server import graceful_server, uvicorn_config

    state = load_server_state(args)
    logger.info("serving %s as %r on http://%s:%d", args.path, state.model_name, args.host, args.port)
    graceful_server(uvicorn_config(build_app(state), args), drain=state.drain).run()
    return 0
