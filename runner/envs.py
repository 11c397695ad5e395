"""Every environment variable Bridge reads, in one place (vLLM keeps an `envs.py` for the same reason).

Engine behaviour is set by options (`runner.EngineConfig`, recipe keys, command flags), never by the
environment: a variable here is for what must reach a process that no option reaches (a CLI's crash
report, a server's trace file). `BRIDGE_VARIABLES` is the list the README's table is generated from;
`FOREIGN_VARIABLES` are other tools' variables that Bridge honours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name and what setting it does."""

    name: str
    help: str

    def get(self) -> str | None:
        """The variable's value, or None when unset or empty."""
        return os.environ.get(self.name) or None


TRACEBACK = EnvVar(
    "BRIDGE_TRACEBACK",
    "any non-empty value: `bridge` commands print the full traceback of an error instead of one line",
)
TICK_TRACE = EnvVar(
    "BRIDGE_TICK_TRACE",
    "a file path: `bridge serve`'s engine process appends one JSON line per engine tick (what was admitted, "
    "stepped and streamed, and how long it took); `benchmarks/serve.py --trace` sets it",
)

BRIDGE_VARIABLES: tuple[EnvVar, ...] = (TRACEBACK, TICK_TRACE)

FOREIGN_VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE",
           "torchrun's: `bridge train` under torchrun (or `--nproc`, which sets them) runs as that rank"),
    EnvVar("PROMETHEUS_MULTIPROC_DIR",
           "prometheus_client's: where `bridge serve`'s API processes share their metrics"),
    EnvVar("TRITON_INTERPRET", "Triton's: `1` runs Bridge's Triton kernels in the interpreter (CPU tests)"),
)


def env_table_markdown() -> str:
    """The README's table of environment variables."""
    lines = ["| variable | what it does |", "|---|---|"]
    lines += [f"| `{v.name}` | {v.help} |" for v in BRIDGE_VARIABLES]
    lines += [f"| `{v.name}` | {v.help} |" for v in FOREIGN_VARIABLES]
    return "\n".join(lines) + "\n"
