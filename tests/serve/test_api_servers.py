"""`bridge serve --api-server-count 2`: two API processes share the port in front of one engine process.

One server for the module: 32 concurrent streaming requests (token ids and prompt embeds, spread by
the kernel over both API processes) equal the same requests run offline, and they were batched
together by the one engine; /metrics, whichever process answers it, adds both processes' counters;
a client that disconnects still frees its blocks; SIGTERM to the parent drains both API processes,
ends the engine and exits 0 with no child left behind. Start-up: the API processes start while the
engine builds, a SIGTERM during start-up still exits 0, and a port already taken fails at once.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import ServerProcess, still_running

from runner.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def two_api_server(tiny_text_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve_logs")
    trace = logs / "ticks.jsonl"
    os.environ["BRIDGE_TICK_TRACE"] = str(trace)  # inherited by the server (benchmarks/serve.py --trace)
    try:
        server = ServerProcess(tiny_text_model, logs / "two_api_server.log", "--api-server-count", "2",
                               "--enable-prompt-embeds", "--dtype", "float32", "--max-model-len", "128",
                               "--num-kv-blocks", "160", "--max-num-seqs", "32",
                               "--max-num-batched-tokens", "256", "--ingest-workers", "1",
                               "--ingest-inline-bytes", "0")
    finally:
        del os.environ["BRIDGE_TICK_TRACE"]
    server.trace = trace
    children = server.children()
    yield server, children
    if server.proc.poll() is None:
        assert server.stop() == 0, server.log()


def _payload(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_two_api_processes_serve_one_engine_and_drain_on_sigterm(two_api_server, offline_llm):
    server, children = two_api_server
    assert len(children) >= 3, children  # the engine process, two API processes (and a resource tracker)
    table = offline_llm.runner.embed_tokens.weight.detach()
    prompts = []
    for i in range(32):
        ids = [10 + i, 20 + (i * 7) % 200, 30 + (i * 13) % 200]
        prompts.append({"prompt_token_ids": ids} if i % 2 else {"prompt_embeds": table[ids].clone()})
    params = SamplingParams(**GREEDY)
    offline = offline_llm.generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].text for o in offline]

    async def one(http: httpx.AsyncClient, prompt: dict) -> str:
        if "prompt_embeds" in prompt:
            body = {"prompt_embeds": _payload(prompt["prompt_embeds"])}
        else:
            body = {"prompt": prompt["prompt_token_ids"]}
        text = ""
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True, **GREEDY}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run_all() -> list[str]:
        limits = httpx.Limits(max_connections=32)  # one connection each: the kernel spreads them
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    assert asyncio.run(asyncio.wait_for(run_all(), timeout=180)) == want
    m = server.wait_idle()
    # the engine's tick trace: each admitting tick's requests arrived, were parsed and reached the
    # engine process in that order, before the tick that admitted them began
    ticks = [json.loads(line) for line in server.trace.read_text().splitlines()]
    admitting = [t for t in ticks if t["prompts"]]
    assert sum(t["prompts"] for t in admitting) >= 32
    for t in admitting:
        arrived, parsed, received = t["arrived_at"], t["submitted_at"], t["received_at"]
        assert arrived[0] <= parsed[0] <= received[0] and arrived[1] <= parsed[1] <= received[1] <= t["t"]
    # both API processes took a share of the 32 connections (each listens on its own socket of the
    # port; with one shared socket a burst could all land on whichever process woke first)
    owners = [o for t in admitting for o in t["owners"]]
    assert sorted(set(owners)) == [0, 1], owners
    # counters of both API processes, added up by whichever answered /metrics
    assert m['bridge:http_requests_total{route="/v1/completions",status="200"}'] == 32
    assert m["bridge:prompt_tokens_total"] == 32 * 3
    generated = sum(len(o.outputs[0].token_ids) for o in offline)
    assert m["bridge:generation_tokens_total"] == generated
    assert m["bridge:engine_step_seconds_count"] < generated  # the requests shared steps

    # a client that leaves mid-stream: its request is aborted in the engine and its blocks come back
    body = {"prompt": [5, 6, 7], "stream": True, "max_tokens": 100, "ignore_eos": True, "temperature": 0.0}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert any(line.startswith("data: ") for line, _ in zip(resp.iter_lines(), range(3)))
    server.wait_idle()

    assert server.stop() == 0, server.log()
    assert not still_running(children), "a child process outlived the server"


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        path = Path(f"/proc/{todo.pop()}/task")
        for task in path.iterdir() if path.exists() else ():
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def test_start_up_overlaps_the_engine_build_and_stops_cleanly_midway(tiny_text_model, tmp_path):
    """The API processes (and their ingest workers) start while the engine builds, so they are running
    before the server is ready; a SIGTERM in the middle of start-up stops everything and exits 0,
    with no process of the server's tree left."""
    server = ServerProcess(tiny_text_model, tmp_path / "early_stop.log", "--api-server-count", "2",
                           "--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "64",
                           "--ingest-workers", "1", wait=False)
    deadline = time.monotonic() + 120
    tree: list[int] = []
    while time.monotonic() < deadline and server.proc.poll() is None:
        tree = _descendants(server.proc.pid)
        if len(server.children()) >= 3 and len(tree) >= 5:  # engine, 2 API processes, their workers
            break
        time.sleep(0.05)
    assert len(tree) >= 5, (tree, server.log())
    assert server.stop(timeout=90) == 0, server.log()
    assert not still_running(tree), "a process of the server's tree outlived it"


def test_a_port_already_taken_fails_before_the_engine_builds(tiny_text_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "bridge", "serve", str(tiny_text_model), "--port", str(port),
               "--device", "cpu", "--api-server-count", "2", "--log-level", "info"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "address already in use" in (done.stdout + done.stderr).lower()
    assert "[engine]" not in done.stdout + done.stderr  # no engine process was started
