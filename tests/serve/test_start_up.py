"""`bridge serve` with the engine in its own process answers from its first moments: `/health` 503 (and
every route a 503 with Retry-After) while the engine builds, 200 once it is ready.

The engine is held back by the test: a `sitecustomize.py` on the server's PYTHONPATH (test-only, read by
every process of the server) makes `build_ready_llm` wait for a file before it returns, so "the engine
is not ready yet" lasts exactly as long as the test wants, with no timing in the assertions. Once any API
process answers 200, no request is refused, even one reaching an API process still building its routes.
Ordering of the server's log: every API process listened before the engine was ready, and none was ready
before it; so what is left between the engine's readiness and a 200 is the routes' state, nothing of
an API process's own start-up (imports, uvicorn, the tokenizer of a plain model directory).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
from serve_helpers import ServerProcess, still_running

GATE_ENV = "BRIDGE_TEST_ENGINE_GATE"

SITECUSTOMIZE = f'''
import os
import sys

_GATE = os.environ.get("{GATE_ENV}")
if _GATE:
    import importlib.abc
    import importlib.util
    import time

    class _HoldTheEngine(importlib.abc.MetaPathFinder):
        """Wraps bridge.serve.engine_build.build_ready_llm as the module is loaded: it waits for the gate."""

        def find_spec(self, name, path, target=None):
            if name != "bridge.serve.engine_build":
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                build = module.build_ready_llm

                def held(*args, **kwargs):
                    llm = build(*args, **kwargs)
                    while not os.path.exists(_GATE):
                        time.sleep(0.02)
                    return llm

                module.build_ready_llm = held

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _HoldTheEngine())
'''


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return None


def test_health_is_503_while_the_engine_starts_and_200_once_it_is_ready(tiny_text_model, tmp_path,
                                                                        monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    gate = tmp_path / "engine_may_finish"
    monkeypatch.setenv(GATE_ENV, str(gate))
    log = tmp_path / "server.log"
    server = ServerProcess(tiny_text_model, log, "--engine-process", "--api-server-count", "2",
                           "--enable-prompt-embeds", "--dtype", "float32", "--max-model-len", "128",
                           "--num-kv-blocks", "64", "--log-level", "info", wait=False,
                           pythonpath=(str(site),))
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        statuses: list[int | None] = []
        while time.monotonic() < deadline and server.proc.poll() is None:
            statuses.append(_health(server.url))
            if statuses[-1] == 503 and _listening(log) == 2:  # both API processes answer
                break
            time.sleep(0.05)
        assert statuses[-1] == 503 and _listening(log) == 2, (statuses[-5:], server.log())
        assert 200 not in statuses
        r = httpx.get(server.url + "/health", timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "starting" in r.json()["error"]["message"] and r.json()["error"]["code"] == 503
        text = log.read_text()  # still held back: started, not ready, not serving
        assert "started: building the engine" in text and not re.search(r"engine process \d+ ready", text)
        children = server.children()

        gate.touch()  # the engine may finish now
        while time.monotonic() < deadline and server.proc.poll() is None and _health(server.url) != 200:
            time.sleep(0.02)
        # the first 200 seen: from here no request is refused, also one that reaches the API process that
        # is still building its routes (it is held until they are up)
        assert asyncio.run(_completions(server.url, 8)) == [200] * 8, server.log()

        while time.monotonic() < deadline and _ready(log) < 2:
            time.sleep(0.05)
        lines = log.read_text().splitlines()
        engine_ready = _first(lines, r"engine process \d+ ready")
        for api in (0, 1):
            listening = _first(lines, rf"\[api {api}\]: listening: /health answers 503")
            ready = _first(lines, rf"\[api {api}\]: ready: /health answers 200")
            assert listening < engine_ready < ready, (api, listening, engine_ready, ready)
    finally:
        gate.touch()
        code = server.stop()
    assert code == 0, server.log()
    assert not still_running(children), "a child process outlived the server"


async def _completions(url: str, count: int) -> list[int]:
    """`count` completions at once, each on a connection of its own (the kernel spreads them over the
    API processes' sockets); their statuses."""
    body = {"prompt": [5, 6], "max_tokens": 2, "temperature": 0.0}

    async def one() -> int:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/v1/completions", json=body)
            return r.status_code

    return list(await asyncio.gather(*(one() for _ in range(count))))


def _listening(log: Path) -> int:
    return len(re.findall(r"\[api \d\]: listening", log.read_text(errors="replace")))


def _ready(log: Path) -> int:
    return len(re.findall(r"\[api \d\]: ready", log.read_text(errors="replace")))


def _first(lines: list[str], pattern: str) -> int:
    for i, line in enumerate(lines):
        if re.search(pattern, line):
            return i
    raise AssertionError(f"no log line matches {pattern!r}:\n" + "\n".join(lines[-40:]))
