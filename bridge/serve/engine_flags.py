"""`bridge serve`'s engine flags, made from `runner.config.EngineConfig`'s fields.

Why: the engine's options are listed once, as the config's fields with their help texts; a flag per
field (`--max-num-seqs` for `max_num_seqs`) and the keywords handed to `LLM` come from that list, so an
option added to the engine is a server flag too and the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from runner.config import EngineConfig


def _engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("flag", False)]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per engine option: booleans off by default are vLLM-style switches (`--enforce-eager`),
    options whose default is decided by the engine take `--x` / `--no-x`, numbers and names their value."""
    group = parser.add_argument_group("engine options (runner.config.EngineConfig, as LLM(...) takes them)")
    for field in _engine_fields():
        flag = "--" + field.name.replace("_", "-")
        kinds = str(field.type)
        help_text = field.metadata["help"]
        if "bool" in kinds:
            if field.default is False:
                group.add_argument(flag, action="store_true", help=help_text)
            else:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                                   help=help_text)
        else:
            kind = int if kinds.startswith("int") else float if kinds.startswith("float") else str
            group.add_argument(flag, type=kind, default=field.default, help=help_text)


def engine_options(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The `LLM(...)` keywords the parsed flags give (`overrides` win)."""
    options = {f.name: getattr(args, f.name) for f in _engine_fields() if hasattr(args, f.name)}
    options.update(overrides)
    return options


__all__ = ["add_engine_flags", "engine_options"]
