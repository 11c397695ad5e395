"""Encoder checkpoints: ``config.json`` (how to rebuild) + ``model.safetensors`` (weights).

This module owns the file format and nothing else (it imports nothing of its own package):
``save_encoder`` writes it, ``read_encoder_config`` and ``load_state_dict_checked`` read it, and
``encoders.encoder.load_encoder`` (which needs the builders) rebuilds an Encoder from it.

Loading rebuilds the architecture from the saved config (no external files needed: towers export a
self-contained config) and then checks every parameter name and shape, saying exactly what does not
match instead of a bare "size mismatch" deep inside torch.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


def _atomic_write(path: Path, write) -> None:
    """Write through a temp file in the same folder and rename, so a crash never leaves half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_encoder(encoder, directory: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Save an Encoder's config and weights into ``directory`` (created if needed).

    ``state`` replaces the module's own state dict (a trainer passes full tensors gathered from
    a sharded model); the files are the same either way."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    source = encoder.state_dict() if state is None else state
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in source.items()}
    config = {"bridge_encoder_format": FORMAT_VERSION, **encoder.config}
    _atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    _atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2)))
    return directory


def describe_mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> list[str]:
    """Human-readable differences between a module's state dict and a checkpoint's tensors."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing from checkpoint ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected in checkpoint ({len(unexpected)}): {', '.join(unexpected)}")
    for key in sorted(set(expected) & set(found)):
        want, got = tuple(expected[key].shape), tuple(found[key].shape)
        if want != got:
            problems.append(f"shape mismatch for {key}: checkpoint has {got}, model expects {want}")
    return problems


def load_state_dict_checked(
    module: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint"
) -> None:
    """``module.load_state_dict(state)`` after checking names and shapes; ValueError lists every problem."""
    problems = describe_mismatch(module.state_dict(), state)
    if problems:
        raise ValueError(f"weights in {source} do not match the model:\n  - " + "\n  - ".join(problems))
    module.load_state_dict(state, strict=True)


def read_encoder_config(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not directory.is_dir():
        raise ValueError(f"encoder checkpoint directory {directory} does not exist")
    if not path.is_file():
        raise ValueError(f"encoder checkpoint {directory} has no {CONFIG_NAME}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON (truncated or damaged?): {str(e)[:200]}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    version = config.pop("bridge_encoder_format", None)
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: bridge_encoder_format is {version!r}, this code reads {FORMAT_VERSION}")
    return config
