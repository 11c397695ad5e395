"""Serving throughput: `bridge serve` under N concurrent clients vs offline `LLM.generate`, same requests.

One command, GPU (the lead runs it; a few minutes on an H200):

    python benchmarks/serve.py [--clients 16,64,256] [--out results.json]

W1's model (benchmarks/generate.py: Qwen3-0.6B-shaped, random bf16): every request is 512 prompt-embeds
rows (base64 `torch.save` payloads, vLLM's wire format) and 128 greedy output tokens (ignore_eos).
For each client count N the same max(N, 64) requests run twice: offline through `LLM.generate` in
this process, then (after the offline engine is freed) through a `bridge serve` subprocess with the
same engine settings, N clients each streaming one request at a time (httpx, SSE, usage included).

Reported per N: throughput (output tok/s, wall time from the first request sent to the last [DONE]),
its fraction of offline throughput (target >= 0.9 at 64 clients), TTFT p50/p99 (send to first
chunk), inter-token latency p50/p99 (per request: (last chunk - first chunk) / (tokens - 1); with
decode windows a chunk carries many tokens), and where the rest goes: the server's prompt-embeds
decode time (base64 + torch.load, from /metrics; summed over the server's ingest worker processes,
which parse large bodies off the engine's process), the client's encode time and the payload bytes.
The request bodies are serialised before timing (N real clients do that in N processes).
`--ingest-workers K` sets the server's pool (0: every body parsed in the engine's process, the A/B).

`--http-client httpx,raw` runs each level with both client stacks: httpx (the default, as in every earlier
run) and raw asyncio streams (`_raw_client_loop`), which leave the shared host's cores to the server
(about 1.6 ms of client CPU per streamed 1.4 MB request against httpx's 5 ms, on the CPU).

`--cpu`: a tiny model (hidden 64), 32 requests of 16-96 rows and 32 tokens, clients 4,16,32.
Writes JSON to `--out`, else `$OUT/serve_benchmark.json` when `$OUT` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from generate import bench_setup, log, run_bridge, workload  # noqa: E402

from bridge.wire import encode_prompt_embeds  # noqa: E402
from runner.llm import LLM  # noqa: E402

_SERVER_LOGS = itertools.count()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def engine_settings(args, max_len: int) -> dict:
    return {"max_num_seqs": 64 if args.cpu else 256, "max_num_batched_tokens": 2048 if args.cpu else 16384,
            "max_model_len": max_len + 16, "gpu_memory_utilization": 0.85}


def offline_run(llm: LLM, embeds: list[torch.Tensor], output_lens: list[int], device) -> dict:
    """Offline `LLM.generate` on the same prompt-embeds requests (generate.py's timed run)."""
    return run_bridge(llm, [{"prompt_embeds": e} for e in embeds], output_lens, device)


# ------------------------------------------------------------------------------------------ server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: pathlib.Path, args, server_args: str, settings: dict, dtype: str,
                 log_path: pathlib.Path):
    port = free_port()
    cmd = [sys.executable, "-m", "bridge", "serve", str(model_dir), "--port", str(port),
           "--enable-prompt-embeds", "--dtype", dtype, "--log-level", "warning",
           "--max-pending-requests", "100000",
           "--max-prompts-per-request", "1", "--served-model-name", "bench"]
    for key, value in settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if args.cpu:
        cmd += ["--device", "cpu"]
    if args.ingest_workers is not None:
        cmd += ["--ingest-workers", str(args.ingest_workers), "--ingest-inline-bytes", "0"]
    cmd += shlex.split(server_args)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    if args.trace:
        env["BRIDGE_TICK_TRACE"] = str(pathlib.Path(args.trace).resolve())
    if args.cpu:
        env["OMP_NUM_THREADS"] = "1"
    out = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def server_metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and ("{" not in line or "request_bodies_parsed" in line):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def request_bodies(payloads: list[str], output_lens: list[int]) -> list[bytes]:
    """The JSON bodies, serialised before the clock starts: N real clients encode theirs in N processes,
    while this benchmark's clients share one; timing its json.dumps would measure the benchmark."""
    return [json.dumps({"model": "bench", "prompt": "", "prompt_embeds": payload, "max_tokens": out_len,
                        "temperature": 0.0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}).encode()
            for payload, out_len in zip(payloads, output_lens)]


class _Streams:
    """What both client loops share: the queue of bodies, and per request its time to first token, its
    inter-token latency and its (sent, first, last) times, read from the SSE events."""

    def __init__(self, bodies: list[bytes]) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        for item in enumerate(bodies):
            self.queue.put_nowait(item)
        self.ttft, self.itl, self.tokens, self.times = [], [], [0] * len(bodies), []

    def event(self, i: int, line: str | bytes, first: float | None, last: float | None) -> tuple:
        """One SSE line or event of request `i`; returns its (first, last) chunk times so far."""
        data = line[6:] if line[:6] in ("data: ", b"data: ") else None
        if data is None or data in ("[DONE]", b"[DONE]"):
            return first, last
        chunk = json.loads(data)
        if chunk.get("usage"):
            self.tokens[i] = chunk["usage"]["completion_tokens"]
        if chunk.get("choices"):
            last = time.monotonic()
            first = first or last
        return first, last

    def done(self, i: int, sent: float, first: float, last: float) -> None:
        self.ttft.append(first - sent)
        self.times.append((sent, first, last))
        if self.tokens[i] > 1:
            self.itl.append((last - first) / (self.tokens[i] - 1))

    async def run(self, workers: list, start_at: float) -> dict:
        """The workers, started together at `start_at`, timed from their start to the last one's end."""
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        began = time.monotonic()  # start_at, or later if this process got its share late
        await asyncio.gather(*workers)
        ended = time.monotonic()
        return {"ttft": self.ttft, "itl": self.itl, "tokens": sum(self.tokens), "began": began,
                "ended": ended, "times": self.times}


async def _client_loop(url: str, bodies: list[bytes], clients: int, start_at: float) -> dict:
    """`clients` streams in this process, each sending its next body as soon as its last one ended."""
    import httpx

    streams = _Streams(bodies)
    headers = {"content-type": "application/json"}

    async def worker(http: httpx.AsyncClient) -> None:
        while not streams.queue.empty():
            i, body = streams.queue.get_nowait()
            sent = time.monotonic()
            first = last = None
            async with http.stream("POST", "/v1/completions", content=body, headers=headers) as resp:
                if resp.status_code != 200:  # a plain error: httpx's does not cross the process pool
                    body = (await resp.aread()).decode(errors="replace")
                    raise RuntimeError(f"HTTP {resp.status_code} from the server: {body[:1000]}")
                async for line in resp.aiter_lines():
                    first, last = streams.event(i, line, first, last)
            streams.done(i, sent, first, last)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        return await streams.run([worker(http) for _ in range(clients)], start_at)


async def _raw_client_loop(url: str, bodies: list[bytes], clients: int, start_at: float) -> dict:
    """`_client_loop` on asyncio streams instead of httpx: HTTP/1.1 with keep-alive, the request written
    as one head and the pre-serialised body, the chunked SSE response read chunk by chunk. Why: the
    clients share the server's host, and httpx spent about 5 ms of CPU per 1.4 MB streamed request
    against 1.6 ms this way (CPU server, 16 tokens each): on a 16-core host, 64 httpx clients burn as
    much CPU as the 8 API processes they are measuring."""
    host, _, port = url.removeprefix("http://").partition(":")
    streams = _Streams(bodies)

    async def response(reader: asyncio.StreamReader, i: int) -> tuple[float | None, float | None]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
        if b" 200 " not in status + b" ":
            length = int(headers.get(b"content-length", b"0"))
            text = (await reader.readexactly(length)).decode(errors="replace") if length else ""
            raise RuntimeError(f"{status.decode(errors='replace')} from the server: {text[:1000]}")
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            raise RuntimeError(f"expected a chunked event stream, got headers {headers}")
        first = last = None
        pending = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return first, last
            pending += data[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                first, last = streams.event(i, event, first, last)

    async def worker() -> None:
        reader = writer = None
        try:
            while not streams.queue.empty():
                i, body = streams.queue.get_nowait()
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, int(port))
                sent = time.monotonic()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (host.encode(), len(body)))
                writer.write(body)
                await writer.drain()
                first, last = await response(reader, i)
                streams.done(i, sent, first, last)
        finally:
            if writer is not None:
                writer.close()

    return await streams.run([worker() for _ in range(clients)], start_at)


HTTP_CLIENTS = {"httpx": _client_loop, "raw": _raw_client_loop}

_START_BARRIER = None  # set in each client process by the pool's initializer


def _keep_barrier(barrier) -> None:
    global _START_BARRIER
    _START_BARRIER = barrier


def client_process(url: str, bodies: list[bytes], clients: int, start_at: float, kind: str = "httpx") -> dict:
    """One client process's share of a run. With a pool, every share first waits at the pool's barrier:
    a worker that took one share cannot take a second one while another worker idles. Without it, a
    fresh pool's first run sometimes gave one worker two shares, and that worker's second share of
    clients started when its first had finished (their sends spread over 0.5 s, the run measured at
    0.52-0.57 of offline)."""
    if _START_BARRIER is not None:
        _START_BARRIER.wait(timeout=120)
    if not bodies:
        return {"ttft": [], "itl": [], "tokens": 0, "began": None, "ended": None, "times": []}
    return asyncio.run(HTTP_CLIENTS[kind](url, bodies, clients, start_at))


def run_clients(url: str, bodies: list[bytes], clients: int, pool=None, procs: int = 1,
                kind: str = "httpx") -> dict:
    """N = `clients` concurrent streams over `procs` client processes (N real clients do not share one
    interpreter: one process sending 64 x 1.9 MB and parsing 64 SSE streams is itself a bottleneck).
    The processes start together at a common clock time (or together when the last of them got its
    share, if later); wall time runs from then to the last [DONE]."""
    active = max(1, min(procs, clients))
    shares = [bodies[k::active] for k in range(active)]
    counts = [clients // active + (k < clients % active) for k in range(active)]
    if pool is not None:  # one task per pool process (`procs`), for the barrier: the rest idle
        shares += [[]] * (procs - active)
        counts += [0] * (procs - active)
    start_at = time.monotonic() + (0.5 + len(bodies) * 0.02 if pool is not None else 0.0)
    if pool is None:
        parts = [client_process(url, bodies, clients, start_at, kind)]
    else:
        # every share is submitted, empty ones too: the barrier waits for one share per process
        futures = [pool.submit(client_process, url, share, count, start_at, kind)
                   for share, count in zip(shares, counts)]
        parts = [f.result() for f in futures]
    parts = [p for p in parts if p["began"] is not None]
    # from the first send: start_at, unless the barrier released every process after it
    start_at = min(p["began"] for p in parts)
    dt = max(p["ended"] for p in parts) - start_at
    ttft = [t for p in parts for t in p["ttft"]]
    itl = [t for p in parts for t in p["itl"]]
    n = sum(p["tokens"] for p in parts)
    times = sorted(t for p in parts for t in p["times"])
    return {"tok_s": n / dt, "seconds": dt, "output_tokens": n, "client_processes": active,
            "start_at": start_at, "requests_sent_first_last": times,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def serve_variant(args, server_args: str, model_dir: pathlib.Path, settings: dict, dtype_name: str,
                  clients: list[int], bodies: list[bytes], offline: dict, encode_s: float,
                  n_max: int) -> dict:
    """One `bridge serve` with `server_args` on top of the benchmark's flags: every client level, its
    runs, the server's own phase metrics, and the Triton builds it logged."""
    log_dir = pathlib.Path(os.environ.get("OUT") or tempfile.gettempdir())
    log_path = log_dir / f"bridge_serve_bench_{next(_SERVER_LOGS)}.log"  # one per server: kept in $OUT
    pool = None
    results: dict = {"server_args": server_args, "levels": {}}
    started = time.perf_counter()
    proc, url = start_server(model_dir, args, server_args, settings, dtype_name, log_path)
    results["server_start_seconds"] = time.perf_counter() - started
    log(f"server ready in {results['server_start_seconds']:.1f} s ({server_args or 'default flags'})")
    try:
        procs = args.client_procs or max(1, min(8, (os.cpu_count() or 2) // 2))
        if procs > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            ctx = multiprocessing.get_context("spawn")
            pool = ProcessPoolExecutor(procs, mp_context=ctx, initializer=_keep_barrier,
                                       initargs=(ctx.Barrier(procs),))
        run_clients(url, bodies[:procs * 2], procs * 2, pool, procs)  # warm-up (and the pool's start)
        for c in clients:
            n = max(c, 32 if args.cpu else 64)
            kinds = args.http_client.split(",")
            for kind in kinds:
                key = str(c) if kind == kinds[0] else f"{c} {kind}"
                # Like the offline side (best of 2 after a warm-up), the served level runs `--server-runs`
                # times and the best counts; the first one's numbers are kept: a fresh server's first
                # burst of a new size pays kernel compiles the offline engine paid in its own warm-up.
                first = best = None
                runs = []
                for _ in range(args.server_runs):
                    before = server_metrics(url)
                    res = run_clients(url, bodies[:n], c, pool, procs, kind)
                    after = server_metrics(url)
                    if first is None:
                        first = res
                    if best is None or res["tok_s"] > best[1]["tok_s"]:
                        best = (before, res, after)
                    builds = after["bridge:kernel_compiles"] - before["bridge:kernel_compiles"]
                    runs.append({"tok_s": res["tok_s"], "builds": builds, "start_at": res.pop("start_at"),
                                 "requests_sent_first_last": res.pop("requests_sent_first_last")})
                    log(f"    run: {res['tok_s']:.0f} tok/s, {builds:.0f} Triton builds in the server")
                before, res, after = best
                res["runs"] = runs
                res["first_run_tok_s"] = first["tok_s"]
                res["first_run_ttft_p50_s"] = first["ttft_p50_s"]
                decode_s = (after["bridge:prompt_embeds_decode_seconds_sum"]
                            - before["bridge:prompt_embeds_decode_seconds_sum"])
                for phase, name in (("body_receive", "request_body_receive_seconds"),
                                    ("parse", "request_parse_seconds"),
                                    ("admission", "request_admission_seconds"),
                                    ("server_ttft", "time_to_first_token_seconds"),
                                    ("tick_admit", "engine_tick_admit_seconds"),
                                    ("engine_step", "engine_step_seconds")):
                    count = after[f"bridge:{name}_count"] - before[f"bridge:{name}_count"]
                    total = after[f"bridge:{name}_sum"] - before[f"bridge:{name}_sum"]
                    res[f"mean_{phase}_s"] = total / count if count else float("nan")
                    res[f"sum_{phase}_s"], res[f"count_{phase}"] = total, count
                res["kernel_compiles"] = after["bridge:kernel_compiles"] - before["bridge:kernel_compiles"]
                res["kernel_compile_s"] = (after["bridge:kernel_compile_seconds"]
                                           - before["bridge:kernel_compile_seconds"])
                pooled = 'bridge:request_bodies_parsed_total{where="pool"}'
                res["bodies_parsed_in_pool"] = after.get(pooled, 0) - before.get(pooled, 0)
                res.update(requests=n, offline_tok_s=offline[n]["tok_s"],
                           fraction_of_offline=res["tok_s"] / offline[n]["tok_s"],
                           server_decode_seconds=decode_s,
                           server_decode_share_of_wall=decode_s / res["seconds"],
                           client_encode_seconds=encode_s * n / n_max)
                res["http_client"] = kind
                results["levels"][key] = res
                log(f"  {c} clients ({kind}), first run {first['tok_s']:.0f} tok/s "
                    f"(TTFT p50 {first['ttft_p50_s'] * 1e3:.0f} ms)")
                log(f"  {c} clients ({kind}), {n} requests: {res['tok_s']:.0f} tok/s = "
                    f"{res['fraction_of_offline']:.2f} of offline; TTFT p50 {res['ttft_p50_s'] * 1e3:.0f} ms "
                    f"p99 {res['ttft_p99_s'] * 1e3:.0f} ms; "
                    f"ITL p50 {res['itl_p50_s'] * 1e3:.1f} ms p99 {res['itl_p99_s'] * 1e3:.1f} ms; "
                    f"decode {decode_s:.3f} s; server means: body {res['mean_body_receive_s'] * 1e3:.0f} ms, "
                    f"parse {res['mean_parse_s'] * 1e3:.0f} ms, "
                    f"admission {res['mean_admission_s'] * 1e3:.0f} ms, "
                    f"TTFT from parsed {res['mean_server_ttft_s'] * 1e3:.0f} ms; engine thread: "
                    f"admitting {res['sum_tick_admit_s']:.2f} s in {res['count_tick_admit']} ticks, "
                    f"stepping {res['sum_engine_step_s']:.2f} s in {res['count_engine_step']} steps; "
                    f"{res['kernel_compiles']:.0f} Triton builds ({res['kernel_compile_s']:.2f} s)")
    except BaseException:
        log(f"the run failed; the server's log ends with:\n{log_path.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    builds = [line for line in log_path.read_text(errors="replace").splitlines() if "built" in line]
    results["server_kernel_build_log"] = builds[-40:]
    for line in builds[-12:]:
        log(f"  server: {line[-300:]}")
    return results


# ------------------------------------------------------------------------------------------ main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--clients", default=None,
                    help="comma-separated client counts (GPU 16,64,256; CPU 4,16,32)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--ingest-workers", type=int, default=None,
                    help="the server's --ingest-workers (default: its own; 0 parses every body in-process)")
    ap.add_argument("--server-args", action="append", default=None,
                    help="more `bridge serve` flags, e.g. --server-args='--api-server-count 4'; given "
                         "several times, each is a server of its own, run one after the other against "
                         "the same offline runs (an A/B in one process)")
    ap.add_argument("--trace", default=None,
                    help="append the server's engine ticks here (JSON lines, monotonic clock); each "
                         "run's client-side request times go in --out")
    ap.add_argument("--server-runs", type=int, default=2,
                    help="runs per client level, the best counts (offline: best of 2 after a warm-up)")
    ap.add_argument("--http-client", default="httpx",
                    help="the clients' HTTP stack: httpx (as before), raw (asyncio streams: a client that "
                         "leaves the shared host's cores to the server), or both: httpx,raw (each level "
                         "runs with each; the second's results are keyed '<clients> raw')")
    ap.add_argument("--client-procs", type=int, default=None,
                    help="client processes the N streams are spread over (default min(8, CPUs/2))")
    args = ap.parse_args()
    if not args.http_client or any(k not in HTTP_CLIENTS for k in args.http_client.split(",")):
        ap.error(f"--http-client takes a comma list of {sorted(HTTP_CLIENTS)}")
    device, model_dir, dtype = bench_setup(args)
    clients = [int(c) for c in (args.clients or ("4,16,32" if args.cpu else "16,64,256")).split(",")]
    dtype_name = "float32" if args.cpu else "bfloat16"

    from safetensors import safe_open
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    embed_key, table = None, None
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if k.endswith("embed_tokens.weight"):
                    embed_key, table = k, h.get_tensor(k)
    assert embed_key is not None, "no embedding table"

    n_max = max(max(clients), 32 if args.cpu else 64)
    ids, prompt_lens, output_lens = (workload(n_max, 16, 96, 32, 32, vocab, seed=1) if args.cpu
                                     else workload(n_max, 512, 512, 128, 128, vocab, seed=1))
    embeds = [table[torch.tensor(i)].to(dtype) for i in ids]
    t0 = time.perf_counter()
    payloads = [encode_prompt_embeds(e) for e in embeds]
    encode_s = time.perf_counter() - t0
    bodies = request_bodies(payloads, output_lens)
    settings = engine_settings(args, max(p + o for p, o in zip(prompt_lens, output_lens)))
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "model": "qwen3 tiny" if args.cpu else "Qwen3-0.6B-shaped (random bf16)",
                     "engine": settings, "client_encode_seconds_all": encode_s,
                     "payload_bytes_each": len(payloads[0])}

    log("offline LLM.generate on the same requests")
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype=dtype, device=device, **settings)
    sizes = sorted({max(c, 32 if args.cpu else 64) for c in clients})
    offline_run(llm, embeds[: min(8, n_max)], output_lens[: min(8, n_max)], device)  # warm-up
    offline = {}
    for n in sizes:
        runs = [offline_run(llm, embeds[:n], output_lens[:n], device) for _ in range(2)]
        offline[n] = max(runs, key=lambda r: r["tok_s"])
        log(f"  {n} requests: {offline[n]['tok_s']:.0f} tok/s offline")
    llm.shutdown()
    del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # a SIGTERM (a `timeout` around this script) still runs the `finally`s: no server left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    variants = args.server_args or [""]
    results["variants"] = {}
    for server_args in variants:
        results["variants"][server_args] = serve_variant(args, server_args, model_dir, settings, dtype_name,
                                                         clients, bodies, offline, encode_s, n_max)
    results["levels"] = results["variants"][variants[0]]["levels"]  # serve_trace.py reads the first
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], "serve_benchmark.json")
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        pathlib.Path(out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
