"""What `bridge train` checks after the recipe and before it writes anything: the output folder can
be made and written to, and the recipe's JSONL data can be read (every row, every media path) and
fits the model's context.

Each problem is one line naming the folder or `file:line`; all of them are found in one pass and
the caller shows the first few with a count (`RunCheck.lines`). Nothing here creates the output
folder: a refused run leaves the disk as it was.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.data.jsonl_check import KEEP_PROBLEMS, scan_jsonl

#: the tiny-model builder's context when `model.tiny.max_position_embeddings` is not set
TINY_DEFAULT_CONTEXT = 1024
#: config.json keys that hold a model's context length, in the order they are tried
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass
class RunCheck:
    problems: list[str] = field(default_factory=list)
    num_problems: int = 0
    #: things the run does about the data that its user should know (not problems)
    notes: list[str] = field(default_factory=list)

    def add(self, problem: str) -> None:
        self.num_problems += 1
        if len(self.problems) < KEEP_PROBLEMS:
            self.problems.append(problem)

    def lines(self) -> list[str]:
        """The problems to print: the first KEEP_PROBLEMS and a count of the rest."""
        more = self.num_problems - len(self.problems)
        return self.problems + ([f"... and {more} more"] if more > 0 else [])


def output_dir_problems(output_dir: str | Path) -> list[str]:
    """Why a run could not create or write `output_dir` (empty when it can): the path is a file, a
    parent is a file, a symlink loop, or the folder (or the nearest existing parent, which would
    hold it) cannot be written. Writability is tried with a temp file, removed at once, because
    permission bits say nothing on a read-only filesystem and nothing to root."""
    out = Path(os.path.abspath(os.path.expanduser(str(output_dir))))
    label = f"output folder {output_dir}"
    existing = out
    while True:
        try:
            os.stat(existing)
            break
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return [f"{label}: symlink loop at {existing}"]
            if exc.errno == errno.ENOTDIR:
                existing = existing.parent
                continue
            if exc.errno != errno.ENOENT:
                return [f"{label}: cannot be used ({exc.strerror})"]
        if existing.parent == existing:
            return [f"{label}: no existing parent folder"]
        existing = existing.parent
    if not os.path.isdir(existing):
        if existing == out:
            return [f"{label}: is a file, not a folder"]
        return [f"{label}: cannot be created, {existing} is a file"]
    try:
        fd, probe = tempfile.mkstemp(prefix=".bridge-write-check-", dir=existing)
    except OSError as exc:
        where = "" if existing == out else f" (its parent {existing})"
        return [f"{label}: cannot write there{where}: {exc.strerror}"]
    os.close(fd)
    os.unlink(probe)
    return []


def model_context(config: Mapping[str, Any]) -> int | None:
    """The context length a model config.json declares (its text config's for a multimodal one)."""
    from runner.hf_config import text_config  # here: the run check is on the CLI's fast path

    source = text_config(config)
    for key in _CONTEXT_KEYS:
        value = source.get(key) if isinstance(source, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def recipe_context(recipe) -> int | None:
    """The context of the recipe's LLM, read without loading it (None when it says none)."""
    if recipe.model.tiny is not None:
        return int(recipe.model.tiny.get("max_position_embeddings", TINY_DEFAULT_CONTEXT))
    try:
        config = json.loads((Path(recipe.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the recipe check names a model dir it cannot read
    return model_context(config) if isinstance(config, dict) else None


def _recipe_tokenizer(recipe):
    """The tokenizer the run will use: the model dir's, or the tiny one built from the same words
    the tiny model will be built from (in memory, nothing written)."""
    if recipe.model.tiny is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(recipe.model.path)
    from bridge.data.example import target_words
    from bridge.tiny_models import build_tokenizer

    words = recipe.model.tiny.get("vocab_words")
    if words is None:
        words = target_words(_targets(Path(recipe.data.train), recipe.data.target_field))
    return build_tokenizer(words)


def _targets(path: Path, target_field: str):
    with path.open("rb") as handle:
        for raw in handle:
            if raw.strip():
                row = json.loads(raw)
                if isinstance(row, dict) and isinstance(row.get(target_field), str):
                    yield row[target_field]


def check_data(recipe, check: RunCheck) -> None:
    """Every row and media path of the recipe's JSONL train and eval files, and their targets
    against the model's context (`data.truncate` decides between a problem and a note)."""
    data = recipe.data
    if data.source != "jsonl":
        return
    context = recipe_context(recipe)
    checked: dict[tuple[str, str], str | None] = {}
    long_rows: list[tuple[Path, int, str]] = []
    for name in ("train", "eval"):
        if data.get(name) is None:
            continue
        scan = scan_jsonl(data[name], prompt=data.prompt, target_field=data.target_field,
                          media_root=data.media_root, max_target_tokens=context, checked=checked)
        for problem in scan.problems:
            check.add(problem)
        check.num_problems += scan.num_problems - len(scan.problems)
        long_rows += [(scan.path, line, target) for line, target in scan.long_targets]
    if long_rows and context is not None:
        _check_target_lengths(recipe, long_rows, context, check)


def _check_target_lengths(recipe, rows: list[tuple[Path, int, str]], context: int, check: RunCheck) -> None:
    from bridge.data.tokenize import tokenize_target

    try:
        tokenizer = _recipe_tokenizer(recipe)
    except Exception as exc:  # noqa: BLE001  transformers raises many types for a broken tokenizer
        path, line, _ = rows[0]
        check.add(f"{path}:{line}: the target may be longer than the model's context ({context}), and the "
                  f"tokenizer to count it could not be loaded: {type(exc).__name__}: {str(exc)[:200]}")
        return
    over = []
    for path, line, target in rows:
        n = len(tokenize_target(tokenizer, target))
        if n > context:
            over.append((path, line, n))
    if not over:
        return
    if recipe.data.truncate:
        path, line, n = over[0]
        check.notes.append(
            f"data.truncate: {len(over)} target(s) longer than the model's context ({context} tokens) "
            f"are cut to fit (the first: {path}:{line}, {n} tokens)"
        )
        return
    for path, line, n in over:
        check.add(f"{path}:{line}: the target is {n} tokens (with EOS), longer than the model's context "
                  f"({context}); shorten it, or set data.truncate: true to cut such targets")


def check_run(recipe, output_dir: str | Path) -> RunCheck:
    """Everything `bridge train` checks before it writes anything (see the module docstring)."""
    check = RunCheck()
    for problem in output_dir_problems(output_dir):
        check.add(problem)
    check_data(recipe, check)
    return check
