"""`bridge train --nproc N`: start N ranks of the same command on this host and watch them.

Each rank is `python -m bridge ...` with the environment torchrun would give it (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless set), so a rank
cannot tell this launcher from `torchrun --standalone`. Why not torchrun itself: when one rank dies,
torchrun prints its own traceback and every rank's, and the user has to find the cause among them.

What the user sees: rank 0's output as it is (its stdout and stderr are the launcher's, so the
progress bar, the status lines and the JSON summary come in the order of a one-process run); the
other ranks' stderr is kept (its last lines) and quoted only when that rank is the one that failed. The
first rank to exit with an error ends the run: the others are stopped (SIGTERM, then SIGKILL), and
one message names the rank, how it ended (its last line, or the signal that killed it) and the
checkpoint a rerun resumes from. Checkpoints are written atomically by rank 0, so a run stopped
this way leaves its last checkpoint loadable.

The launcher imports nothing heavy while the ranks run (torch only to name the last checkpoint after
a failure).
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: seconds the other ranks get to exit after SIGTERM before they are killed
STOP_GRACE_S = 5.0
#: lines of a rank's stderr kept to quote when it fails
_TAIL_LINES = 20


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun --standalone gives rank `rank` of `nproc` on one host."""
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks of all-core OpenMP teams oversubscribe
    return env


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    ended_at: float | None = None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Tail(threading.Thread):
    """Keeps the last lines of a rank's stderr (ranks other than 0)."""

    def __init__(self, rank: _Rank):
        super().__init__(daemon=True)
        self.rank = rank

    def run(self) -> None:
        stream = self.rank.proc.stderr
        pending = b""
        while chunk := os.read(stream.fileno(), 65536):
            pending += chunk
            *lines, pending = pending.replace(b"\r", b"\n").split(b"\n")
            self.rank.tail.extend(line.decode(errors="replace") for line in lines if line.strip())
        if pending.strip():
            self.rank.tail.append(pending.decode(errors="replace"))


def _last_words(rank: _Rank) -> str:
    """The rank's own last line: its one-line error when it printed one."""
    lines = [line.strip() for line in rank.tail if line.strip()]
    for line in reversed(lines):
        if line.startswith("bridge:"):
            return line
    return lines[-1] if lines else ""


def launch(argv: Sequence[str], nproc: int, resume_hint: Callable[[], str]) -> int:
    """Run `python -m bridge *argv` as `nproc` ranks; the exit code is the run's. `resume_hint()`
    says where a rerun resumes from (called after a failure, once the ranks are gone)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "bridge", *argv]
    print(f"bridge: launching {nproc} ranks on this host (MASTER_PORT {port})", file=sys.stderr, flush=True)
    ranks: list[_Rank] = []
    threads = []
    for r in range(nproc):
        quiet = subprocess.DEVNULL if r else None
        proc = subprocess.Popen(cmd, env=rank_env(r, nproc, port), stdout=quiet,
                                stderr=subprocess.PIPE if r else None)
        ranks.append(_Rank(r, proc))
        if r:
            threads.append(_Tail(ranks[-1]))
            threads[-1].start()
    terminated = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    try:
        failed = _wait(ranks, terminated)
    except KeyboardInterrupt:
        failed = None
        _interrupt(ranks)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if terminated.is_set():  # the launcher was asked to stop: so are the ranks
        _stop(ranks)
        print(f"bridge: stopped (SIGTERM). {resume_hint()}", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    if failed is not None:
        _stop(ranks)
    for t in threads:
        t.join(timeout=5)
    if failed is None:
        codes = [rank.proc.returncode for rank in ranks]
        return next((c for c in codes if c), 0) if all(c is not None for c in codes) else 1
    words = _last_words(failed) if failed.rank else ""  # rank 0 said it above, on our stderr
    how = _describe_exit(failed.proc.returncode)
    others = nproc - 1
    print(f"bridge: rank {failed.rank} of {nproc} failed ({how}{': ' + words if words else ''}); "
          f"stopped the other {others} rank{'s' if others != 1 else ''}. {resume_hint()}",
          file=sys.stderr, flush=True)
    code = failed.proc.returncode
    return code if code > 0 else 1


def _interrupt(ranks: list[_Rank]) -> None:
    """Ctrl-C: a terminal sends it to the ranks too, and each stops at its step and says where;
    a launcher interrupted alone passes it on. A rank that does not stop within a minute is killed."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(r.proc.poll() is None for r in ranks):
        time.sleep(0.05)
    for rank in ranks:
        if rank.proc.poll() is None:
            rank.proc.send_signal(signal.SIGINT)
    for rank in ranks:
        try:
            rank.proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            rank.proc.kill()
            rank.proc.wait()


def _wait(ranks: list[_Rank], terminated: threading.Event) -> _Rank | None:
    """Wait until every rank has exited cleanly (None) or one has failed (that rank: the first to
    end with an error; a rank killed by a signal first when two end together)."""
    while not terminated.is_set():
        now = time.monotonic()
        for rank in ranks:
            if rank.ended_at is None and rank.proc.poll() is not None:
                rank.ended_at = now
        bad = [r for r in ranks if r.ended_at is not None and r.proc.returncode != 0]
        if bad:
            return min(bad, key=lambda r: (r.ended_at, r.proc.returncode >= 0, r.rank))
        if all(r.ended_at is not None for r in ranks):
            return None
        time.sleep(0.05)
    return None


def _stop(ranks: list[_Rank]) -> None:
    live = [r for r in ranks if r.proc.poll() is None]
    for rank in live:
        rank.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for rank in live:
        try:
            rank.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.proc.kill()
            rank.proc.wait()


def last_checkpoint_hint(output_dir: str | Path) -> str:
    """'the last checkpoint is step N (PATH); rerun the same command to resume' (or that there is none)."""
    from bridge.training.checkpoint import latest_checkpoint

    last = latest_checkpoint(output_dir)
    if last is None:
        return "There is no checkpoint yet; rerun the same command to start again."
    return f"The last checkpoint is {last.name} ({last}); rerun the same command to resume from it."
