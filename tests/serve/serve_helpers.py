"""Shared by the server tests: a real `bridge serve` process on 127.0.0.1 and a free port.

`ServerProcess` starts the CLI in a subprocess, waits (bounded) for `/health`, and on teardown
sends SIGTERM, waits, and kills only if it must; its log is kept for failure messages. Counters
the tests assert on (free KV blocks and slots, live requests, encoder work) are read from
`/metrics`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_FILE = ROOT / "docs" / "chat_templates" / "content_only.jinja"  # the README's example template
TEMPLATE = TEMPLATE_FILE.read_text()  # each message's content as it is


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def still_running(pids: list[int], timeout: float = 10) -> list[int]:
    """Those of `pids` still alive after up to `timeout` s (exited children are reaped meanwhile)."""
    deadline = time.monotonic() + timeout

    def alive(pid: int) -> bool:
        try:
            return "zombie" not in Path(f"/proc/{pid}/status").read_text(errors="replace")
        except OSError:
            return False

    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


class ServerProcess:
    def __init__(self, path: Path, log: Path, *flags: str, api_key: str | None = None,
                 wait: bool = True, pythonpath: tuple[str, ...] = ()) -> None:
        """`wait=False` returns as soon as the process is started (call `wait_ready` before use),
        so that several servers can boot at once. `pythonpath`: directories ahead of the repository on
        the server's PYTHONPATH (a test's `sitecustomize.py`, say)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log
        cmd = [sys.executable, "-m", "bridge", "serve", str(path), "--port", str(self.port),
               "--device", "cpu", "--log-level", "warning", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        # what the environment had on the path stays behind the repository (packages installed there)
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(ROOT), *inherited]),
               "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if wait:
            self.wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def children(self) -> list[int]:
        """The server's child processes (engine, ingest workers, multiprocessing's tracker); Linux."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(pid) for pid in path.read_text().split()] if path.exists() else []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready within {timeout} s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics as {name: value} (labelled ones summed per name)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
            base = name.split("{", 1)[0]
            if "{" in name:
                out[base] = out.get(base, 0.0) + float(value)
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Wait until no request is live and every KV block and slot is free; the final metrics."""
        deadline = time.monotonic() + timeout
        m = self.metrics()
        while time.monotonic() < deadline:
            m = self.metrics()
            if (m["bridge:num_requests_live"] == 0 and m["bridge:num_requests_arriving"] == 0
                    and m["bridge:kv_free_blocks"] == m["bridge:kv_total_blocks"]
                    and m["bridge:free_slots"] == m["bridge:total_slots"]):
                return m
            time.sleep(0.1)
        shown = {k: v for k, v in m.items() if "free" in k or "live" in k}
        raise AssertionError(f"server not idle after {timeout} s: {shown}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


API_KEY = "test-key"
MAX_MODEL_LEN = 128
MAX_PENDING = 100
