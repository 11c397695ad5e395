"""Serving throughput with the official `openai` client: `bridge serve` against offline `LLM.generate`.

GPU (the lead runs it; a few minutes on an H200), and the CPU smoke (tiny model, under a minute):

    python3 benchmarks/serve.py [--out results.json]
    python3 benchmarks/serve.py --smoke

Workload: W1's model (Qwen3-0.6B-shaped, random bf16, benchmarks/generate.py); `--requests` (256)
completions of `--rows` (512) prompt-embeds rows each -> `--max-tokens` (128) greedy tokens (ignore_eos),
streamed with usage. The same requests run offline and served, on the same engine settings, with
max_num_seqs equal to the streams in flight.

Clients, as users run them: `--client-procs` (8) processes share `--in-flight` (64) streams; each stream
sends its next request as soon as its last one ended. Inside the timed region, per request: the tensor
serialised as vLLM's docs show (`torch.save` to bytes, base64), then
`AsyncOpenAI(...).completions.create(..., stream=True, extra_body={"prompt_embeds": ...})` and every chunk
read (`--client openai`, the default), or the same body written by hand on asyncio streams and the SSE
read by hand (`--client raw`: a client that leaves the host's cores to the server). The processes start
together at a common clock time; wall time runs from then to the last stream's end.

Order of a run:
1. offline: `LLM(...)`, one warm-up generate of all requests, `--runs` timed ones (median);
2. `bridge serve` started cold: a fresh, empty Triton cache directory (TRITON_CACHE_DIR) for it;
   `/health` polled from the start: the first 503 (an API process answers: the engine is starting)
   and the first 200 (ready), and from the server's log (run at info level) the moment its engine was
   ready; then one warm-up run and `--runs` timed runs (median);
3. the same server started again, warm (its kernel cache now full): the same `/health` timeline.

Reported: served and offline tok/s and their ratio (target >= 0.9), TTFT and inter-token latency
p50/p99 (TTFT from the request's start, its serialisation included; ITL per request: (last chunk -
first chunk) / (tokens - 1)), SSE chunks per request, the client's serialisation time, the server's CPU
time per request (utime + stime of the server's process tree from /proc, before and after each run:
API processes, engine process, the rest), the clients' CPU time per request, and the start timelines
(target: `/health` 200 within 20 s cold); with `--extra-client-procs`, the same server measured again
from other numbers of client processes. One JSON line (`RESULT {...}`) and a table; the JSON also goes
to `--out`, else `$OUT/serve_benchmark.json` when `$OUT` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from generate import bench_setup, embed_rows, log, run_bridge, workload  # noqa: E402

TARGET_VS_OFFLINE = 0.9
TARGET_COLD_HEALTH_S = 20.0
MODEL_NAME = "bench"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


# ------------------------------------------------------------------------------------------ the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(port: int, timeout: float) -> int | None:
    """GET /health's status, or None when nothing answered (refused, reset, timed out)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        conn.close()


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_epoch(line: str) -> float | None:
    """The wall-clock time of a server log line (logging's default asctime), or None."""
    match = _LOG_TIME.match(line)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class Server:
    """One `bridge serve` subprocess: its start timeline, its processes, their CPU time."""

    proc: subprocess.Popen
    port: int
    log_path: pathlib.Path
    started: float  # time.time() just before Popen
    timeline: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, limit_s: float = 900.0, poll_s: float = 0.05) -> dict:
        """Poll /health until 200; the first 503 and the first 200 in seconds from the start. A request
        sent before an API process runs waits in the listen backlog (the port is bound first) and is
        answered when one does."""
        first_503 = None
        deadline = self.started + limit_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()[-4000:]}")
            status = health_status(self.port, timeout=5.0)
            now = time.time() - self.started
            if status == 503 and first_503 is None:
                first_503 = now
            if status == 200:
                self.timeline = {"first_503_s": first_503, "health_200_s": now, **self._log_times()}
                ready = self.timeline.get("engine_ready_s")
                self.timeline["engine_ready_to_health_s"] = None if ready is None else now - ready
                return self.timeline
            time.sleep(poll_s)
        self.stop()
        raise RuntimeError(f"no /health 200 within {limit_s} s:\n{self.log_text()[-4000:]}")

    def _log_times(self) -> dict:
        """From the log: seconds from the start to the engine process's start (spawned, imported), its
        LLM built ("start-up:", before its construction warm-up), the serving warm-up's end and the
        engine ready; and how long the two warm-ups took."""
        out = {}
        for line in self.log_text().splitlines():
            t = log_epoch(line)
            if t is None:
                continue
            if "engine_ready_s" not in out and re.search(r"engine process \d+ ready", line):
                out["engine_ready_s"] = t - self.started
            elif "engine_started_s" not in out and re.search(r"engine process \d+ started", line):
                out["engine_started_s"] = t - self.started  # spawned, its modules imported
            elif "construction_warm_up_s" not in out and re.search(r"runner\.warmup.*: warm-up: ", line):
                match = re.search(r"warm-up: ([\d.]+) s", line)
                out["construction_warm_up_s"] = float(match.group(1)) if match else None
            elif "serving warm-up:" in line:
                out["serving_warm_up_logged_s"] = t - self.started
                match = re.search(r"serving warm-up: ([\d.]+) s", line)
                out["serving_warm_up_s"] = float(match.group(1)) if match else None
            elif "start-up:" in line and "engine_built_s" not in out:
                out["engine_built_s"] = t - self.started
        return out

    def roles(self) -> dict[int, str]:
        """pid -> "api" / "engine" / "other" for the server's process tree (roles from its log)."""
        text = self.log_text()
        engine = {int(p) for p in re.findall(r"engine process (\d+) ready", text)}
        apis: set[int] = set()
        for group in re.findall(r"API processes \(pids \[([\d, ]+)\]\)", text):
            apis.update(int(p) for p in group.split(",") if p.strip())
        if not apis:
            apis = {self.proc.pid}  # one API process: the server's own
        out = {}
        for pid in process_tree(self.proc.pid):
            out[pid] = "engine" if pid in engine else "api" if pid in apis else "other"
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """utime + stime of the server's live processes so far, summed by role."""
        ticks = os.sysconf("SC_CLK_TCK")
        out = {"api": 0.0, "engine": 0.0, "other": 0.0}
        for pid, role in self.roles().items():
            try:
                fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[role] += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)
        return out

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def process_tree(root: int) -> list[int]:
    """`root` and its descendants (Linux /proc/<pid>/task/<tid>/children)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def start_server(model_dir: pathlib.Path, args, server_args: str, settings: dict, dtype: str,
                 cache_dir: pathlib.Path, log_path: pathlib.Path, trace: pathlib.Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "bridge", "serve", str(model_dir), "--port", str(port),
           "--enable-prompt-embeds", "--dtype", dtype, "--log-level", "info",
           "--max-pending-requests", "100000", "--max-prompts-per-request", "1",
           "--served-model-name", MODEL_NAME]
    for key, value in settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if args.smoke:
        cmd += ["--device", "cpu"]
    cmd += shlex.split(server_args)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TRITON_CACHE_DIR": str(cache_dir),
           "BRIDGE_TICK_TRACE": str(trace.resolve())}
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"
    out = open(log_path, "wb")  # noqa: SIM115 - the child holds it; closed when this process exits
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return Server(proc, port, log_path, started)


# ------------------------------------------------------------------------------------------ clients

def serialise(tensor: torch.Tensor) -> str:
    """A prompt-embeds payload as vLLM's docs make one: `torch.save` to bytes, then base64."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


class Tally:
    """Per request of one client process: TTFT, ITL, chunks, tokens, serialisation time, end time."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.chunks: list[int] = []
        self.encode_s: list[float] = []
        self.tokens = 0
        self.ended = 0.0

    def add(self, began: float, encoded: float, first: float | None, last: float | None, chunks: int,
            tokens: int) -> None:
        if first is None or last is None or tokens == 0:
            raise RuntimeError("a stream ended without tokens")
        self.ttft.append(first - began)
        self.encode_s.append(encoded - began)
        self.chunks.append(chunks)
        self.tokens += tokens
        if tokens > 1:
            self.itl.append((last - first) / (tokens - 1))
        self.ended = max(self.ended, last)


async def openai_streams(url: str, work: list[tuple[torch.Tensor, int]], streams: int, tally: Tally) -> None:
    """`streams` concurrent streams of the official client, one `AsyncOpenAI` for this process."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600.0)

    async def stream_loop() -> None:
        while work:
            tensor, max_tokens = work.pop()
            began = time.monotonic()
            payload = serialise(tensor)
            encoded = time.monotonic()
            stream = await client.completions.create(
                model=MODEL_NAME, prompt="", max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"prompt_embeds": payload, "ignore_eos": True})
            first = last = None
            chunks = tokens = 0
            async for chunk in stream:
                if chunk.choices:
                    last = time.monotonic()
                    first = first or last
                    chunks += 1
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            tally.add(began, encoded, first, last, chunks, tokens)

    try:
        await asyncio.gather(*(stream_loop() for _ in range(streams)))
    finally:
        await client.close()


async def raw_streams(url: str, work: list[tuple[torch.Tensor, int]], streams: int, tally: Tally) -> None:
    """The same requests on asyncio streams: HTTP/1.1 keep-alive, the head and the JSON body written
    as they are, the chunked SSE response split by hand (each event's JSON still parsed)."""
    host, _, port = url.removeprefix("http://").partition(":")

    async def response(reader: asyncio.StreamReader) -> tuple[float | None, float | None, int, int]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
        if b" 200 " not in status + b" ":
            length = int(headers.get(b"content-length", b"0"))
            text = (await reader.readexactly(length)).decode(errors="replace") if length else ""
            raise RuntimeError(f"{status.decode(errors='replace')} from the server: {text[:1000]}")
        first = last = None
        chunks = tokens = 0
        pending = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return first, last, chunks, tokens
            pending += data[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                body = json.loads(event[6:])
                if body.get("choices"):
                    last = time.monotonic()
                    first = first or last
                    chunks += 1
                if body.get("usage"):
                    tokens = body["usage"]["completion_tokens"]

    async def stream_loop() -> None:
        reader = writer = None
        try:
            while work:
                tensor, max_tokens = work.pop()
                began = time.monotonic()
                body = json.dumps({"model": MODEL_NAME, "prompt": "", "prompt_embeds": serialise(tensor),
                                   "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                                   "stream": True, "stream_options": {"include_usage": True}}).encode()
                encoded = time.monotonic()
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                             b"\r\nContent-Length: %d\r\n\r\n" % (host.encode(), len(body)))
                writer.write(body)
                await writer.drain()
                first, last, chunks, tokens = await response(reader)
                tally.add(began, encoded, first, last, chunks, tokens)
        finally:
            if writer is not None:
                writer.close()

    await asyncio.gather(*(stream_loop() for _ in range(streams)))


CLIENTS = {"openai": openai_streams, "raw": raw_streams}

_BARRIER = None  # each client process's copy of the pool's barrier (set by the initializer)


def _client_init(barrier) -> None:
    """A client process: one torch thread, the client's imports done before any share is timed."""
    global _BARRIER
    _BARRIER = barrier
    torch.set_num_threads(1)
    import openai  # noqa: F401


def client_share(kind: str, url: str, requests_file: str, indices: list[int], max_tokens: list[int],
                 streams: int, start_at: float) -> dict:
    """One client process's share of a run: its tensors loaded, every process met at the barrier,
    then its streams from `start_at` (time.monotonic, one clock for the host)."""
    from safetensors import safe_open

    with safe_open(requests_file, framework="pt") as f:
        work = [(f.get_tensor(f"r{i}"), n) for i, n in zip(indices, max_tokens)][::-1]  # popped from the end
    _BARRIER.wait(timeout=300)
    tally = Tally()
    if work:
        time.sleep(max(0.0, start_at - time.monotonic()))
        cpu = time.process_time()
        began = time.monotonic()
        asyncio.run(CLIENTS[kind](url, work, streams, tally))
        cpu = time.process_time() - cpu
    else:
        cpu, began = 0.0, None
    return {"ttft": tally.ttft, "itl": tally.itl, "chunks": tally.chunks, "encode_s": tally.encode_s,
            "tokens": tally.tokens, "began": began, "ended": tally.ended, "cpu_s": cpu}


class Clients:
    """`procs` spawned client processes, reused for every run."""

    def __init__(self, procs: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        self.procs = procs
        self.pool = ProcessPoolExecutor(procs, mp_context=ctx, initializer=_client_init,
                                        initargs=(ctx.Barrier(procs),))
        self._starting = [self.pool.submit(os.getpid) for _ in range(procs)]  # start them all now

    def wait_started(self) -> None:
        for future in self._starting:
            future.result()

    def run(self, kind: str, url: str, requests_file: pathlib.Path, max_tokens: list[int],
            in_flight: int) -> dict:
        """Every request once, `in_flight` streams over the processes (each gets every procs-th request
        and its share of the streams); throughput from the common start to the last stream's end."""
        n, procs = len(max_tokens), self.procs
        streams = [in_flight // procs + (k < in_flight % procs) for k in range(procs)]
        indices = [list(range(k, n, procs)) for k in range(procs)]
        self.wait_started()
        start_at = time.monotonic() + 0.5  # each process loads its share, meets the others, waits for this
        futures = [self.pool.submit(client_share, kind, url, str(requests_file), idx,
                                    [max_tokens[i] for i in idx], s, start_at)
                   for idx, s in zip(indices, streams)]
        parts = [f.result() for f in futures]
        live = [p for p in parts if p["began"] is not None]
        began = min(p["began"] for p in live)
        seconds = max(p["ended"] for p in live) - began
        tokens = sum(p["tokens"] for p in parts)

        def pooled(key: str) -> list:
            return [x for p in parts for x in p[key]]

        ttft, itl, chunks, enc = pooled("ttft"), pooled("itl"), pooled("chunks"), pooled("encode_s")
        return {"tok_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens, "requests": len(ttft),
                "began": began, "ended": began + seconds, "start_late_s": began - start_at,
                "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
                "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
                "chunks_per_request": statistics.mean(chunks), "encode_ms_mean": statistics.mean(enc) * 1e3,
                "client_cpu_ms_per_request": sum(p["cpu_s"] for p in parts) / len(ttft) * 1e3}

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


# ------------------------------------------------------------------------------------------ phases

def offline_phase(model_dir, device, dtype, settings, embeds, max_tokens, runs: int,
                  before_timing=lambda: None) -> dict:
    """`LLM.generate` on the same requests: one warm-up, then (after `before_timing()`: the client
    processes' start, which must not share the host with the timed runs) `runs` timed generates
    (median)."""
    from runner.llm import LLM

    llm = LLM(model_dir, enable_prompt_embeds=True, dtype=dtype, device=device, **settings)
    prompts = [{"prompt_embeds": e} for e in embeds]
    try:
        run_bridge(llm, prompts, max_tokens, device)  # warm-up
        before_timing()
        timed = [run_bridge(llm, prompts, max_tokens, device)["tok_s"] for _ in range(runs)]
    finally:
        llm.shutdown()
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for tok_s in timed:
        log(f"  offline: {tok_s:.0f} tok/s")
    return {"tok_s": statistics.median(timed), "runs_tok_s": timed}


def served_runs(server: Server, clients: Clients, args, requests_file, max_tokens,
                trace: pathlib.Path) -> dict:
    """One warm-up run, then `args.runs` timed runs (the median by throughput is reported, each kept),
    with the server's CPU time per request and its engine's tick trace over each run."""
    clients.run(args.client, server.url, requests_file, max_tokens, args.in_flight)  # warm-up
    runs = []
    for _ in range(args.runs):
        before = server.cpu_seconds()
        res = clients.run(args.client, server.url, requests_file, max_tokens, args.in_flight)
        after = server.cpu_seconds()
        for role in before:
            res[f"server_cpu_ms_per_request_{role}"] = (after[role] - before[role]) / res["requests"] * 1e3
        res["server_cpu_ms_per_request"] = sum(after.values()) - sum(before.values())
        res["server_cpu_ms_per_request"] *= 1e3 / res["requests"]
        res["engine"] = engine_summary(trace, res.pop("began"), res.pop("ended"), args.in_flight)
        runs.append(res)
        e = res["engine"]
        log(f"  served ({args.client}): {res['tok_s']:.0f} tok/s, TTFT p50 {res['ttft_p50_ms']:.0f} ms, "
            f"{res['chunks_per_request']:.1f} chunks/request, server CPU "
            f"{res['server_cpu_ms_per_request']:.1f} ms/request; engine: {e.get('mean_running', 0):.1f} of "
            f"{args.in_flight} slots running on average, {e.get('arriving_share', 0):.0%} of ticks while "
            f"requests arrived, ticks busy {e.get('tick_busy_share', 0):.0%} of the run")
    ranked = sorted(runs, key=lambda r: r["tok_s"])
    return {**ranked[len(ranked) // 2], "runs_tok_s": [r["tok_s"] for r in runs], "runs": runs}


def client_variant(procs: int, server: Server, args, requests_file, max_tokens, trace: pathlib.Path,
                   offline_tok_s: float) -> dict:
    """The same served runs from `procs` client processes (a pool of their own, started and warmed first)."""
    log(f"  the same server from {procs} client processes")
    clients = Clients(procs)
    try:
        clients.wait_started()
        served = served_runs(server, clients, args, requests_file, max_tokens, trace)
    finally:
        clients.close()
    return {"client_procs": procs, "served": served, "ratio": served["tok_s"] / offline_tok_s}


def engine_summary(trace: pathlib.Path, began: float, ended: float, slots: int) -> dict:
    """What the server's engine did during one run, from its tick trace (one JSON line per tick,
    `time.monotonic()`, the clients' clock): ticks, the share taken while requests were arriving (decode
    windows cut short, none launched behind another), the decode windows used, the requests running
    on average over time (against the slots a full batch has: offline keeps them all busy), and the
    share of the run the engine thread spent inside ticks (admitting and stepping)."""
    if not trace.exists():
        return {}
    ticks = []
    for line in trace.read_text().splitlines():
        try:
            tick = json.loads(line)
        except ValueError:
            continue  # a line being written
        if began <= tick["t"] <= ended:
            ticks.append(tick)
    if len(ticks) < 2:
        return {"ticks": len(ticks)}
    span = ticks[-1]["t"] - ticks[0]["t"]
    running = sum(t["running"] * (nxt["t"] - t["t"]) for t, nxt in zip(ticks, ticks[1:])) / span
    windows: dict[str, int] = {}
    for t in ticks:
        if t["deltas"]:
            windows[str(t["window"])] = windows.get(str(t["window"]), 0) + 1
    # Where a request's time goes before the engine takes it (the earliest request of each admitting tick):
    # arrival at the API process -> submitted to the engine (body read, parsed, validated) -> received by
    # the engine process -> the tick that admits it.
    admitting = [t for t in ticks if t.get("subs") and "arrived_at" in t and "received_at" in t]
    before_engine = {}
    if admitting:
        def mean_ms(a: str, b: str) -> float:
            return statistics.mean(t[b][0] - t[a][0] for t in admitting) * 1e3
        before_engine = {
            "api_ms": mean_ms("arrived_at", "submitted_at"),
            "to_engine_ms": mean_ms("submitted_at", "received_at"),
            "engine_queue_ms": statistics.mean(t["t"] - t["received_at"][0] for t in admitting) * 1e3,
            "subs_per_admitting_tick": statistics.mean(t["subs"] for t in admitting)}
    return {"ticks": len(ticks), "arriving_share": statistics.mean(t["arriving"] for t in ticks),
            "before_engine": before_engine,
            "windows_of_stepping_ticks": windows, "mean_running": running, "slots": slots,
            "tick_busy_share": sum(t["admit_s"] + t["step_s"] for t in ticks) / (ended - began),
            "mean_step_ms": statistics.mean(t["step_s"] for t in ticks) * 1e3}


def started(model_dir, args, server_args: str, settings, dtype_name, cache_dir, log_dir, which: str,
            trace: pathlib.Path) -> Server:
    log(f"starting bridge serve ({which}: {server_args or 'default flags'})")
    server = start_server(model_dir, args, server_args, settings, dtype_name, cache_dir,
                          log_dir / f"serve_{which.replace(' ', '_')}.log", trace)
    try:
        timeline = server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    log(f"  /health 200 after {timeline['health_200_s']:.1f} s (first 503 at "
        f"{_fmt(timeline['first_503_s'])} s, engine ready at {_fmt(timeline.get('engine_ready_s'))} s)")
    return server


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict) -> str:
    s, o, cold, warm = results["served"], results["offline"], results["start_cold"], results["start_warm"]
    def each(runs: list[float]) -> str:
        return "runs " + ", ".join(f"{x:.0f}" for x in runs)

    rows = [
        ("served tok/s (median)", f"{s['tok_s']:.0f}", each(s["runs_tok_s"])),
        ("offline tok/s (median)", f"{o['tok_s']:.0f}", each(o["runs_tok_s"])),
        ("served / offline", f"{results['ratio']:.3f}", f"target >= {TARGET_VS_OFFLINE}"),
        ("TTFT p50 / p99 ms", f"{s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f}", "serialisation included"),
        ("ITL p50 / p99 ms", f"{s['itl_p50_ms']:.2f} / {s['itl_p99_ms']:.2f}", ""),
        ("SSE chunks per request", f"{s['chunks_per_request']:.1f}", f"{results['max_tokens']} tokens each"),
        ("client serialisation ms", f"{s['encode_ms_mean']:.2f}", "mean per request"),
        ("server CPU ms / request", f"{s['server_cpu_ms_per_request']:.1f}",
         f"API {s['server_cpu_ms_per_request_api']:.1f}, engine {s['server_cpu_ms_per_request_engine']:.1f}, "
         f"other {s['server_cpu_ms_per_request_other']:.1f}"),
        ("client CPU ms / request", f"{s['client_cpu_ms_per_request']:.1f}", f"--client {results['client']}"),
    ]
    e = s.get("engine") or {}
    if e.get("ticks", 0) > 1:
        rows.append(("engine: mean running / slots", f"{e['mean_running']:.1f} / {e['slots']}",
                     f"offline keeps {e['slots']} running; windows {e['windows_of_stepping_ticks']}"))
        rows.append(("engine: ticks while arriving", f"{e['arriving_share']:.0%}",
                     f"of {e['ticks']} ticks; ticks busy {e['tick_busy_share']:.0%} of the run, "
                     f"mean step {e['mean_step_ms']:.1f} ms"))
        b = e.get("before_engine") or {}
        if b:
            total = b["api_ms"] + b["to_engine_ms"] + b["engine_queue_ms"]
            rows.append(("request -> engine ms", f"{total:.1f}",
                         f"API {b['api_ms']:.1f}, to the engine process {b['to_engine_ms']:.1f}, queued "
                         f"for a tick {b['engine_queue_ms']:.1f} (earliest of each admitting tick; "
                         f"{b['subs_per_admitting_tick']:.1f} submissions per such tick)"))
    for v in results.get("client_variants", []):
        vs = v["served"]
        rows.append((f"served / offline, {v['client_procs']} client procs", f"{v['ratio']:.3f}",
                     f"{vs['tok_s']:.0f} tok/s, TTFT p50 {vs['ttft_p50_ms']:.0f} ms, client CPU "
                     f"{vs['client_cpu_ms_per_request']:.1f} ms/request, engine "
                     f"{(vs.get('engine') or {}).get('mean_running', 0):.1f} running"))
    for v in results["variants"][1:]:
        rows.append(("served / offline, variant", f"{v['ratio']:.3f}",
                     f"{v['server_args']!r}: {v['served']['tok_s']:.0f} tok/s, /health 200 after "
                     f"{v['start']['health_200_s']:.1f} s"))
    for name, t in (("cold", cold), ("warm", warm)):
        if t:
            rows.append((f"/health 200 s, {name}", f"{t['health_200_s']:.1f}",
                         f"engine process up {_fmt(t.get('engine_started_s'))} s, LLM built "
                         f"{_fmt(t.get('engine_built_s'))} s (+ warm-up "
                         f"{_fmt(t.get('construction_warm_up_s'))} s, serving warm-up "
                         f"{_fmt(t.get('serving_warm_up_s'))} s), engine ready "
                         f"{_fmt(t.get('engine_ready_s'))} s; first 503 {_fmt(t['first_503_s'])} s; "
                         f"ready -> 200 {_fmt(t.get('engine_ready_to_health_s'), 2)} s"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>14}  {c}" for a, b, c in rows)


# ------------------------------------------------------------------------------------------ main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", "--cpu", dest="smoke", action="store_true",
                    help="CPU, tiny model, small workload (a check of the script, under a minute)")
    ap.add_argument("--client", choices=sorted(CLIENTS), default="openai")
    ap.add_argument("--client-procs", type=int, default=None, help="client processes (default 8; smoke 2)")
    ap.add_argument("--in-flight", type=int, default=None,
                    help="streams in flight in all (default 64; smoke 8)")
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default 256; smoke 32)")
    ap.add_argument("--rows", type=int, default=None, help="prompt-embeds rows per request (default 512)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 128)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per side (median; default 3, smoke 1)")
    ap.add_argument("--server-args", action="append", default=None,
                    help="more `bridge serve` flags, e.g. --server-args='--api-server-count 4'; given "
                         "several times, each is a server of its own measured against the same offline "
                         "runs (the first one's start is the cold one). Smoke default: "
                         "'--engine-process --api-server-count 2', the GPU layout")
    ap.add_argument("--extra-client-procs", default="",
                    help="comma-separated client-process counts to measure too, on the first server after "
                         "its headline runs (the same streams in flight; whether the clients limit the run)")
    ap.add_argument("--no-warm-start", action="store_true", help="skip the second (warm) start")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        log("no CUDA device: running the --smoke benchmark")
        args.smoke = True
    small = args.smoke
    defaults = {"client_procs": 2 if small else 8, "in_flight": 8 if small else 64,
                "requests": 32 if small else 256, "rows": 64 if small else 512,
                "max_tokens": 16 if small else 128, "runs": 1 if small else 3,
                "server_args": ["--engine-process --api-server-count 2" if small else ""]}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.requests < args.in_flight or args.client_procs < 1 or args.runs < 1:
        ap.error("need --requests >= --in-flight, --client-procs >= 1 and --runs >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.cpu = args.smoke  # bench_setup's name for it
    device, model_dir, dtype = bench_setup(args)
    dtype_name = "float32" if args.smoke else "bfloat16"
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    lo = max(8, args.rows // 4) if args.smoke else args.rows
    ids, prompt_lens, max_tokens = workload(args.requests, lo, args.rows, args.max_tokens, args.max_tokens,
                                            vocab, seed=1)
    embeds = [e.contiguous() for e in embed_rows(model_dir, ids, dtype)]
    settings = {"max_num_seqs": args.in_flight, "max_num_batched_tokens": 2048 if args.smoke else 16384,
                "max_model_len": max(p + o for p, o in zip(prompt_lens, max_tokens)) + 16,
                "gpu_memory_utilization": 0.85}
    work_dir = pathlib.Path(tempfile.mkdtemp(prefix="bridge_serve_bench_"))
    log_dir = pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else work_dir
    cache_dir = work_dir / "triton_cache"  # the servers' own: empty for the cold start
    requests_file = work_dir / "requests.safetensors"
    from safetensors.torch import save_file

    save_file({f"r{i}": e for i, e in enumerate(embeds)}, str(requests_file))
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "model": "qwen3 tiny" if args.smoke else "Qwen3-0.6B-shaped (random bf16)",
                     "client": args.client, "client_procs": args.client_procs, "in_flight": args.in_flight,
                     "requests": args.requests, "rows": args.rows, "max_tokens": args.max_tokens,
                     "engine": settings,
                     "payload_bytes": len(serialise(embeds[0])), "start_warm": None}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` around this: the finallys run
    clients = None
    results["variants"] = []
    try:
        clients = Clients(args.client_procs)  # their imports (torch, openai) beside the offline warm-up
        log(f"offline LLM.generate: {args.requests} requests, max_num_seqs {args.in_flight}")
        results["offline"] = offline_phase(model_dir, device, dtype, settings, embeds, max_tokens, args.runs,
                                           before_timing=clients.wait_started)
        for k, server_args in enumerate(args.server_args):
            trace = work_dir / f"ticks_{k}.jsonl"
            server = started(model_dir, args, server_args, settings, dtype_name, cache_dir, log_dir,
                             "cold" if k == 0 else f"variant {k}", trace)
            try:
                served = served_runs(server, clients, args, requests_file, max_tokens, trace)
                if k == 0:
                    results["client_variants"] = [
                        client_variant(int(n), server, args, requests_file, max_tokens, trace,
                                       results["offline"]["tok_s"])
                        for n in filter(None, args.extra_client_procs.split(","))]
            except BaseException:
                log(f"the run failed; the server's log ends with:\n{server.log_text()[-4000:]}")
                raise
            finally:
                code = server.stop()
            results["variants"].append({"server_args": server_args, "start": server.timeline,
                                        "served": served, "server_exit_code": code,
                                        "ratio": served["tok_s"] / results["offline"]["tok_s"]})
        if not args.no_warm_start:
            server = started(model_dir, args, args.server_args[0], settings, dtype_name, cache_dir, log_dir,
                             "warm", work_dir / "ticks_warm.jsonl")
            results["start_warm"] = server.timeline
            server.stop()
    finally:
        if clients is not None:
            clients.close()
        shutil.rmtree(work_dir if log_dir != work_dir else cache_dir, ignore_errors=True)
        requests_file.unlink(missing_ok=True)
    first = results["variants"][0]
    results.update(served=first["served"], start_cold=first["start"],
                   server_exit_code=first["server_exit_code"])
    results["ratio"] = results["served"]["tok_s"] / results["offline"]["tok_s"]
    print("RESULT " + json.dumps(results), flush=True)
    print(table(results), flush=True)
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], "serve_benchmark.json")
    if out:
        pathlib.Path(out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
