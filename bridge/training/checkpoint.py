"""Atomic training checkpoints: OUTPUT/checkpoints/step_N.

A checkpoint is written into a hidden temp folder next to its final place and renamed into
place only once complete (`os.replace` of a directory is atomic on one filesystem), so a
process killed mid-save leaves the previous checkpoint untouched and no half checkpoint that
looks complete. Only folders named `step_N` holding `meta.json` count as checkpoints.

Layout of step_N/:
  meta.json                 step, stage, where the LLM is (`llm_dir`), base LLM dir
  recipe.yaml               the resolved recipe the run used
  encoder/                  encoders' own format (config.json + model.safetensors) per modality
  llm_trainable.safetensors trainable LLM tensors (LoRA A/B or all weights), for resuming
  llm/                      a merged, ready-to-serve HF model dir, only when LLM weights changed
  trainer_state.pt          optimizer (keyed by parameter name), LR scheduler and RNG states

The tensors come from full (unsharded) state dicts (fsdp.gather_full_state), so the files are
the same whether one process, DDP or FSDP2 trained the run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

#: test hook: "STEP:SECONDS" sleeps that long in the middle of saving step STEP (after some files
#: are written, before the rename), so a test can kill the process mid-save.
SLEEP_HOOK_ENV = "BRIDGE_TEST_SLEEP_IN_SAVE"
_STEP_RE = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and (child / "meta.json").is_file():
            found.append((int(match.group(1)), child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def _maybe_sleep(step: int) -> None:
    spec = os.environ.get(SLEEP_HOOK_ENV)
    if spec:
        at, _, seconds = spec.partition(":")
        if int(at) == step:
            time.sleep(float(seconds or 3600))


def write_checkpoint(output_dir: str | Path, step: int, fill: Any, keep: int = 0) -> Path:
    """Create step_N atomically: `fill(tmp_dir)` writes the contents, then meta is finalised and
    the folder renamed into place. `keep > 0` deletes all but the newest `keep` afterwards."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    meta = fill(tmp)
    _maybe_sleep(step)
    # meta.json last: a folder without it is never taken for a checkpoint
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2))
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step (e.g. the end of a resumed run): swap, then drop the old
        trash = root / f".old-step_{step}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    if keep > 0:
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_meta(ckpt: str | Path) -> dict:
    path = Path(ckpt) / "meta.json"
    if not path.is_file():
        raise ValueError(f"{ckpt} is not a Bridge checkpoint (no meta.json)")
    return json.loads(path.read_text())


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(state, str(path), metadata={"format": "pt"})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def sub_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix` (e.g. "llm."), with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def save_encoder_state(encoder: Any, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Write an encoder checkpoint (the format of `encoders.checkpoint.save_encoder`) from full
    tensors, so a sharded encoder (whose own state dict holds shards) saves the same files."""
    from encoders.checkpoint import CONFIG_NAME, FORMAT_VERSION, WEIGHTS_NAME

    directory.mkdir(parents=True, exist_ok=True)
    save_tensors(directory / WEIGHTS_NAME, state)
    config = {"bridge_encoder_format": FORMAT_VERSION, **encoder.config}
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2))


def merged_llm_state(llm: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the LLM's full state dict) with every LoRA layer folded in, under the plain model's
    key names, so the saved directory is an ordinary HF checkpoint the runner can load. Same
    arithmetic as `LoRALinear.merged_linear`, on full tensors (the module may be sharded)."""
    from bridge.training.lora import LoRALinear

    state = dict(state)
    for name, module in llm.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        base_w = state.pop(f"{name}.base.weight")
        a, b = state.pop(f"{name}.lora_a"), state.pop(f"{name}.lora_b")
        delta = (b.float() @ a.float()) * module.scale
        state[f"{name}.weight"] = (base_w.float() + delta).to(base_w.dtype)
        if f"{name}.base.bias" in state:
            state[f"{name}.bias"] = state.pop(f"{name}.base.bias")
    return state
