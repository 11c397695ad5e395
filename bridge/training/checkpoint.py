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
                            (tensors, numbers and strings only: read back with weights_only=True)
  manifest.json             size and sha256 of every other file, written last

Nothing here unpickles code: tensors are safetensors, metadata JSON, and trainer_state.pt is read
with `torch.load(weights_only=True)`. On resume the newest checkpoint whose manifest verifies is
used; a damaged one (a truncated file, a planted one) is skipped with a warning naming what is
wrong. Temp folders of saves that were killed are removed when a run starts.

The tensors come from full (unsharded) state dicts (fsdp.gather_full_state), so the files are
the same whether one process, DDP or FSDP2 trained the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from encoders.checkpoint import save_encoder

#: test hook: "STEP:SECONDS" sleeps that long in the middle of saving step STEP (after some files
#: are written, before the rename), so a test can kill the process mid-save.
_STEP_RE = re.compile(r"^step_(\d+)$")
_TEMP_RE = re.compile(r"^\.(?:tmp|old)-step_\d+-(\d+)$")
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
TRAINER_STATE_NAME = "trainer_state.pt"
_HASH_CHUNK = 4 * 2**20


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped on resume (or a stale temp folder removed): the message says why."""


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
    # meta.json, then the manifest over everything, last: a folder without meta is never taken
    # for a checkpoint, and one whose files no longer match the manifest is skipped on resume
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2))
    write_manifest(tmp)
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


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; ValueError naming the file and what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text (damaged?)") from None
    except json.JSONDecodeError as err:
        where = f"{err.msg} at line {err.lineno}"
        raise ValueError(f"{path}: not valid JSON ({where}); truncated or damaged?") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_meta(ckpt: str | Path) -> dict:
    path = Path(ckpt) / "meta.json"
    if not path.is_file():
        raise ValueError(f"{ckpt} is not a Bridge checkpoint (no meta.json)")
    meta = read_json_object(path)
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{path}: 'step' must be an integer >= 0, got {str(step)[:50]!r}")
    return meta


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(state, str(path), metadata={"format": "pt"})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; ValueError naming the file when it is missing or damaged."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001  safetensors raises its own error types on bad bytes
        why = str(err)[:200]
        raise ValueError(f"{path}: not a valid safetensors file ({why}); truncated or damaged?") from None


def save_trainer_state(path: Path, optimizer: dict, scheduler: dict) -> None:
    """Optimizer, scheduler and RNG state: plain containers of tensors, numbers and strings, so
    `load_trainer_state` can read them back with weights_only=True."""
    torch.save({"optimizer": optimizer, "scheduler": scheduler, "torch_rng": torch.get_rng_state()}, path)


def load_trainer_state(path: Path) -> dict:
    """Read trainer_state.pt with `weights_only=True`: a planted pickle that would run code is
    refused (ValueError naming the file), never executed."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  unpickling errors come in many types
        raise ValueError(
            f"{path}: could not be read as trainer state with weights_only=True "
            f"({type(err).__name__}: {str(err)[:200]})"
        ) from None
    if not isinstance(state, dict) or not {"optimizer", "scheduler", "torch_rng"} <= set(state):
        raise ValueError(f"{path}: expected a dict with optimizer, scheduler and torch_rng")
    rng = state["torch_rng"]
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
        raise ValueError(f"{path}: torch_rng must be a uint8 tensor")
    return state


# ----------------------------------------------------------------------------- manifest


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _checkpoint_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def write_manifest(ckpt: Path) -> None:
    """manifest.json: size and sha256 of every file in the checkpoint folder."""
    files = {
        p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": _file_digest(p)}
        for p in _checkpoint_files(ckpt)
    }
    (ckpt / MANIFEST_NAME).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1))


def verify_checkpoint(ckpt: str | Path) -> list[str]:
    """What is wrong with a checkpoint folder (empty when it is intact): a missing or unreadable
    manifest, files missing, of the wrong size or checksum, or not listed in it."""
    ckpt = Path(ckpt)
    try:
        manifest = read_json_object(ckpt / MANIFEST_NAME)
    except FileNotFoundError:
        return [f"{ckpt / MANIFEST_NAME}: missing"]
    except ValueError as err:
        return [str(err)]
    files = manifest.get("files")
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        return [f"{ckpt / MANIFEST_NAME}: not a format-{MANIFEST_FORMAT} manifest"]
    problems = []
    for rel, entry in files.items():
        path = ckpt / rel
        if not isinstance(entry, dict) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            problems.append(f"{ckpt / MANIFEST_NAME}: malformed entry {str(rel)[:100]!r}")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != entry.get("size"):
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {entry.get('size')}")
        elif _file_digest(path) != entry.get("sha256"):
            problems.append(f"{path}: checksum differs from the manifest (modified or damaged)")
    listed = {ckpt / rel for rel in files}
    problems += [f"{p}: not listed in the manifest" for p in _checkpoint_files(ckpt) if p not in listed]
    return problems


def resumable_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies against its manifest; each newer one that does not is
    skipped with a CheckpointWarning naming what is wrong (one without any manifest, from before
    manifests, is used with a warning). None when there is no checkpoint;
    ValueError when there are some but none verifies (a run is never silently restarted)."""
    skipped = []
    for ckpt in reversed(list_checkpoints(output_dir)):
        if not (ckpt / MANIFEST_NAME).exists():  # written before checkpoints had manifests
            warnings.warn(f"{ckpt} has no {MANIFEST_NAME} (an older Bridge wrote it): resuming from it "
                          "unverified", CheckpointWarning, stacklevel=2)
            return ckpt
        problems = verify_checkpoint(ckpt)
        if not problems:
            return ckpt
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        warnings.warn(f"skipping damaged checkpoint {ckpt}: {shown}", CheckpointWarning, stacklevel=2)
        skipped.append(f"{ckpt.name}: {shown}")
    if skipped:
        raise ValueError(
            f"no intact checkpoint to resume from in {checkpoint_root(output_dir)} ("
            + " | ".join(skipped)
            + "); move the folder away to start over"
        )
    return None


def open_checkpoint(directory: str | Path, verify: bool = True) -> Path:
    """The checkpoint a load path reads: `directory` itself (a step_N folder), or a run folder's
    newest checkpoint. With `verify`, its files are checked against its manifest first and a
    mismatch is a ValueError naming each file that differs; a checkpoint without a manifest (an
    older Bridge wrote it) loads with a CheckpointWarning. Unlike resuming, loading never falls
    back to an older checkpoint: what was asked for is what is served, or an error."""
    directory = Path(directory)
    if not (directory / "meta.json").is_file():
        latest = latest_checkpoint(directory)
        if latest is None:
            raise ValueError(f"{directory} is neither a checkpoint (no meta.json) nor a run dir with one")
        directory = latest
    if not verify:
        return directory
    if not (directory / MANIFEST_NAME).exists():
        warnings.warn(f"{directory} has no {MANIFEST_NAME} (an older Bridge wrote it): loading it unverified",
                      CheckpointWarning, stacklevel=2)
        return directory
    problems = verify_checkpoint(directory)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ValueError(f"checkpoint {directory} does not match its manifest: {shown} (verify=False, "
                         f"or --no-verify on the command line, loads it anyway)")
    return directory


# ----------------------------------------------------------------------------- leftovers of killed runs


def remove_stale_temp_dirs(output_dir: str | Path) -> list[Path]:
    """Remove `.tmp-step_N-PID` / `.old-step_N-PID` folders left by saves that were killed
    (their PID is no longer running, or is this very process); returns what was removed."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    removed = []
    for child in root.iterdir():
        match = _TEMP_RE.match(child.name)
        if match and child.is_dir() and not _pid_running_elsewhere(int(match.group(1))):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def _pid_running_elsewhere(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's) or unknowable: leave it
    return True


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics rows up to `step` (the step a run resumes from), so a resumed run's curve
    has no duplicates. A line that is not a JSON object with a step, such as the partial last
    line of a process killed mid-write, is dropped (with a warning when it is not the last)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    keep = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row_step = row["step"] if isinstance(row, dict) else None
        except (json.JSONDecodeError, KeyError):
            row_step = None
        if isinstance(row_step, bool) or not isinstance(row_step, int):
            if lineno != len(lines):
                warnings.warn(f"{path}:{lineno}: dropping a malformed metrics line", CheckpointWarning,
                              stacklevel=2)
            continue
        if row_step <= step:
            keep.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)


def sub_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix` (e.g. "llm."), with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def save_encoder_state(encoder: Any, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Write an encoder checkpoint from full tensors, so a sharded encoder (whose own state dict
    holds shards) saves the same files; the one writer is `encoders.checkpoint.save_encoder`."""
    save_encoder(encoder, directory, state=state)


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
