"""Peak memory growth of `bridge serve` under one request at each per-request limit, against the budget.

Three tiny demo runs (shapes, tones, graphs: two training steps each, CPU) are served with the default
limits, and one request at a time is sent at each limit:

  image   8 PNGs whose pixels add up to exactly `--max-image-pixels` (and, refused: 8 of 8192 x 8192)
  audio   a 16 kHz mono WAV of exactly `--max-audio-samples` samples; a 48 kHz stereo WAV of exactly
          `--max-audio-file-samples` stored samples (and, refused: a header claiming 2,147,483,647 Hz)
  graph   a graph of exactly `--max-graph-nodes` nodes and `--max-graph-edges` edges (refused: 10**12 nodes)
  text    a completions prompt of exactly `--max-prompt-bytes` bytes (and, refused: one byte more)

For each request, every process of the server (the API process, the engine process, their helpers)
has its peak RSS reset (`/proc/PID/clear_refs`) and its RSS read just before; the growth is the sum
over the processes of peak RSS after the answer minus RSS before. It is compared with the budget
`README.md` documents for a request at that limit (`BUDGET_BYTES` below, per unit of each limit).

    python3 benchmarks/serve_memory.py                       # CPU; the engine in its own process, as on a GPU
    python3 benchmarks/serve_memory.py --smoke               # limits / 16: a quick check of the script
    python3 benchmarks/serve_memory.py --no-engine-process   # the CPU default layout: one process,
                                                             # its growth reported, not judged

Linux only (it reads `/proc`).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pathlib
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import wave
import zlib

import httpx
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from encoders.media_budget import MediaLimits  # noqa: E402

MB = 2**20
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TRAIN = [
    "train.max_steps=2",
    "train.progress=false",
    "train.batch_size=4",
    "eval.num_items=1",
    "data.num_train=8",
    "data.num_eval=2",
]

# The documented budget (README, "Security and limits"): bytes a request at a limit may add to the API
# process (body, parse, decode, hash), per unit of the limit, plus a fixed allowance. The engine process
# then holds the decoded item and the encoder's own working memory, which depends on the encoder.
BUDGET_BYTES = {"image": 8, "audio": 32, "audio_file": 32, "graph": 512, "text": 32}
BUDGET_FIXED = 32 * MB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in pathlib.Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def status_kb(pid: int, key: str) -> int:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(pid: int, send) -> tuple[int, int, int]:
    """(HTTP status of `send()`, bytes the API process `pid` grew by at its peak, the same summed over
    its child processes: the engine process and helpers)."""
    procs = tree(pid)
    before = {}
    for p in procs:
        try:
            pathlib.Path(f"/proc/{p}/clear_refs").write_text("5")  # peak RSS := current RSS
        except OSError:
            pass
        before[p] = status_kb(p, "VmRSS")
    status = send()
    growth = {p: max(0, status_kb(p, "VmHWM") - before[p]) * 1024 for p in procs}
    return status, growth[pid], sum(growth.values()) - growth[pid]


class Server:
    def __init__(self, run: pathlib.Path, log: pathlib.Path, flags: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        template = log.with_suffix(".jinja")
        template.write_text(TEMPLATE)
        cmd = [
            sys.executable,
            "-m",
            "bridge",
            "serve",
            str(run),
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--log-level",
            "warning",
            "--chat-template",
            str(template),
            "--served-model-name",
            "run",
            *flags,
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server not ready")

    def post(self, path: str, body: bytes) -> int:
        r = httpx.post(
            self.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=600
        )
        if r.status_code != 200:
            print(f"    -> {r.status_code}: {r.text[:200]}")
        return r.status_code

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def chat(parts: list[dict]) -> bytes:
    return json.dumps(
        {"model": "run", "messages": [{"role": "user", "content": parts}], "max_tokens": 2, "temperature": 0}
    ).encode()


def png(width: int, height: int) -> bytes:
    """A real PNG of a gradient pattern (small to send; decoding it costs what any such image costs)."""
    from PIL import Image

    row = (np.arange(width, dtype=np.uint32) % 251).astype(np.uint8)
    array = np.broadcast_to(row[None, :, None], (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


def wav(rate: int, frames: int, channels: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        t = np.arange(frames, dtype=np.float32)
        tone = (np.sin(t * 0.05) * 8000).astype("<i2")
        f.writeframes(np.repeat(tone, channels).tobytes())
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()},
    }


def audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def train(name: str, out: pathlib.Path) -> pathlib.Path:
    if not (out / "checkpoints").is_dir():
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run(
            [sys.executable, "-m", "bridge", "demo", name, "--output-dir", str(out), *TRAIN],
            check=True,
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs-dir", default=None, help="where the demo runs are trained (reused if there)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--smoke", action="store_true", help="every limit / 16 (a quick check of the script)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    d = MediaLimits()
    scale = 16 if args.smoke else 1
    limits = MediaLimits(
        max_items=d.max_items,
        max_image_pixels=d.max_image_pixels // scale,
        max_audio_samples=d.max_audio_samples // scale,
        max_audio_file_samples=d.max_audio_file_samples // scale,
        max_graph_nodes=d.max_graph_nodes // scale,
        max_graph_edges=d.max_graph_edges // scale,
    )
    flags = [
        "--engine-process" if args.engine_process else "--no-engine-process",
        "--max-image-pixels",
        str(limits.max_image_pixels),
        "--max-audio-samples",
        str(limits.max_audio_samples),
        "--max-audio-file-samples",
        str(limits.max_audio_file_samples),
        "--max-graph-nodes",
        str(limits.max_graph_nodes),
        "--max-graph-edges",
        str(limits.max_graph_edges),
        "--max-request-bytes",
        str(1024 * MB),
    ]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="serve-memory-"))
    runs = pathlib.Path(args.runs_dir) if args.runs_dir else tmp
    rows = []

    def row(case: str, server: Server, path: str, body: bytes, want: int | None, unit: str | None,
            amount: int) -> None:
        """`want`: the status the request must get (None: any answer; at a limit the engine may still
        refuse a request whose items expand past the context, after the media were decoded)."""
        status, api, engine = measure(server.proc.pid, lambda: server.post(path, body))
        budget = BUDGET_FIXED + (BUDGET_BYTES[unit] * amount if unit else 0)
        # With the engine in the API process, its growth holds the encoder's working memory too: the
        # budget (the API process's own work) is judged only where the two are apart.
        within = (api <= budget or not args.engine_process) and status == (want or status)
        rows.append({"case": case, "status": status, "expected_status": want, "body_mb": len(body) / MB,
                     "api_growth_mb": api / MB, "engine_growth_mb": engine / MB, "api_budget_mb": budget / MB,
                     "within": within})
        print(f"{case:62s} {status:4d}  body {len(body) / MB:6.1f} MB  API process +{api / MB:7.1f} MB "
              f"(budget {budget / MB:7.1f})  engine process +{engine / MB:7.1f} MB  "
              f"{'ok' if within else 'OVER'}", flush=True)

    # -- images
    server = Server(train("shapes", runs / "shapes"), tmp / "shapes.log", flags)
    try:
        side = int((limits.max_image_pixels // 8) ** 0.5)
        height = limits.max_image_pixels // 8 // side
        pixels = 8 * side * height
        row(f"8 images of {side}x{height} ({pixels} px, the cap)", server, CHAT,
            chat([image_part(png(side, height))] * 8), 200, "image", pixels)
        row("8 images of 8192x8192 (refused from the headers)", server, CHAT,
            chat([image_part(png_header(8192, 8192))] * 8), 400, None, 0)
        # -- text, on the same server: a prompt of exactly the byte cap, then one byte more
        from bridge.serve.engine_build import resolve_model
        from bridge.serve.inputs import default_max_prompt_bytes
        from runner.llm import load_tokenizer

        max_len = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        cap = default_max_prompt_bytes(load_tokenizer(resolve_model(runs / "shapes").llm_dir), max_len)
        text = "a" * cap  # tokenized (it is within the byte cap), then refused: longer than the context
        row(f"a text prompt of {cap} bytes (the cap)", server, COMPLETIONS,
            json.dumps({"model": "run", "prompt": text, "max_tokens": 1}).encode(), None, "text", cap)
        row(f"a text prompt of {cap + 1} bytes (refused unread)", server, COMPLETIONS,
            json.dumps({"model": "run", "prompt": text + "a", "max_tokens": 1}).encode(), 400, None, 0)
    finally:
        server.stop()
    # -- audio
    server = Server(train("tones", runs / "tones"), tmp / "tones.log", flags)
    try:
        n = limits.max_audio_samples
        row(f"a 16 kHz mono WAV of {n} samples (the cap)", server, CHAT,
            chat([audio_part(wav(16000, n, 1))]), None, "audio", n)
        frames = limits.max_audio_file_samples // 2
        row(f"a 48 kHz stereo WAV of {2 * frames} stored samples (the cap)", server, CHAT,
            chat([audio_part(wav(48000, frames, 2))]), None, "audio_file", 2 * frames)
        row("a WAV whose header says 2147483647 Hz (refused)", server, CHAT,
            chat([audio_part(wav(2_147_483_647, 8000, 1))]), 400, None, 0)
    finally:
        server.stop()
    # -- graphs
    server = Server(train("graphs", runs / "graphs"), tmp / "graphs.log", flags)
    try:
        nodes, edges = limits.max_graph_nodes, limits.max_graph_edges
        pairs = np.random.default_rng(0).integers(0, nodes, size=(edges, 2)).tolist()
        graph = {"type": "graph", "graph": {"num_nodes": nodes, "edges": pairs}}
        row(f"a graph of {nodes} nodes and {edges} edges (the caps)", server, CHAT, chat([graph]), 200,
            "graph", nodes + edges)
        row("a graph of 10**12 nodes (refused)", server, CHAT,
            chat([{"type": "graph", "graph": {"num_nodes": 10**12, "edges": []}}]), 400, None, 0)
    finally:
        server.stop()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    over = [r["case"] for r in rows if not r["within"]]
    print("all within the documented budget" if not over else f"OVER THE BUDGET: {over}")
    return 0 if not over else 1


if __name__ == "__main__":
    raise SystemExit(main())
