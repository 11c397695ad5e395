"""What `bridge train` checks after the recipe and before it writes anything: the output folder can
be made and written to, and the recipe's data files can be read (every row, every media path) and
fit the model's context.

Each problem is one line naming the folder or `file:line` (a tar shard's sample: `shard:key`); all
of them are found in one pass and the caller shows the first few with a count (`RunCheck.lines`).
With `data.skip_bad_rows` a malformed row is not a problem but a note (the run skips it); a file
that cannot be read stays a problem. Nothing here creates the output folder: a refused run leaves the
disk as it was.
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

from bridge.data.jsonl_check import KEEP_PROBLEMS, DataScan, scan_jsonl

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
        words = target_words(target_texts(recipe.data))
    return build_tokenizer(words)


def target_texts(data):
    """The targets of the training set, as the data set reads them (for a tiny model's vocabulary):
    what `vocab_words` of the run's data set will see."""
    if data.source == "jsonl":
        with Path(data.train).open("rb") as handle:
            for raw in handle:
                if raw.strip():
                    try:
                        row = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and isinstance(row.get(data.target_field), str):
                        yield row[data.target_field]
    elif data.source == "llava":
        from bridge.data.llava import assistant_texts

        yield from assistant_texts(data.train)
    elif data.source == "hf":
        from bridge.data.hf import hf_target_texts

        yield from hf_target_texts(data.train, target_field=data.target_field, columns=data.columns)
    elif data.source == "webdataset":
        from bridge.data.tar_shards import shard_target_texts

        yield from shard_target_texts(data.train, prompt=data.prompt, target_field=data.target_field,
                                      columns=data.columns)


def scan_data_file(data, name: str, context: int | None, checked: dict) -> DataScan:
    """The pass over `data[name]` (train or eval) for the recipe's file source."""
    source = data.source
    if source == "jsonl":
        return scan_jsonl(data[name], prompt=data.prompt, target_field=data.target_field,
                          media_root=data.media_root, max_target_tokens=context, checked=checked)
    if source == "llava":
        from bridge.data.llava import scan_llava

        return scan_llava(data[name], prompt=data.prompt, media_root=data.media_root,
                          max_target_tokens=context, checked=checked)
    if source == "hf":
        from bridge.data.hf import scan_hf

        return scan_hf(data[name], prompt=data.prompt, target_field=data.target_field, columns=data.columns,
                       media_root=data.media_root, max_target_tokens=context, checked=checked)
    from bridge.data.tar_shards import scan_shards

    return scan_shards(data[name], prompt=data.prompt, target_field=data.target_field, columns=data.columns,
                       max_target_tokens=context)


def check_data(recipe, check: RunCheck) -> None:
    """Every row and media path of the recipe's train and eval data (file sources), and their
    targets against the model's context (`data.truncate` decides between a problem and a note).
    With `data.skip_bad_rows` malformed rows become a note; a bad file stays a problem, and so does
    a file whose every row is bad."""
    data = recipe.data
    if data.source not in ("jsonl", "llava", "hf", "webdataset"):
        return
    context = recipe_context(recipe)
    checked: dict[tuple[str, str], str | None] = {}
    long_rows: list[tuple[str, str]] = []
    skipped: list[tuple[str, DataScan]] = []
    for name in ("train", "eval"):
        if data.get(name) is None:
            continue
        scan = scan_data_file(data, name, context, checked)
        if data.skip_bad_rows:
            for problem in scan.file_problems:
                check.add(problem)
            if scan.bad_rows and not scan.file_problems:
                if scan.bad_rows >= scan.rows:
                    check.add(f"{scan.path}: every row is malformed (data.skip_bad_rows leaves nothing); "
                              f"the first: {scan.problems[0]}")
                else:
                    skipped.append((name, scan))
        else:
            for problem in scan.problems:
                check.add(problem)
            check.num_problems += scan.num_problems - len(scan.problems)
        long_rows += scan.long_targets
    if skipped:
        counts = ", ".join(f"{name}: {scan.bad_rows}" for name, scan in skipped)
        total = sum(scan.bad_rows for _, scan in skipped)
        first = next(p for _, scan in skipped for p in scan.problems if p not in scan.file_problems)
        check.notes.append(f"data.skip_bad_rows: {total} malformed row(s) will be skipped ({counts}); the "
                           f"first: {first}")
    if long_rows and context is not None:
        _check_target_lengths(recipe, long_rows, context, check)


def _check_target_lengths(recipe, rows: list[tuple[str, str]], context: int, check: RunCheck) -> None:
    from bridge.data.tokenize import tokenize_target

    try:
        tokenizer = _recipe_tokenizer(recipe)
    except Exception as exc:  # noqa: BLE001  transformers raises many types for a broken tokenizer
        where, _ = rows[0]
        check.add(f"{where}: the target may be longer than the model's context ({context}), and the "
                  f"tokenizer to count it could not be loaded: {type(exc).__name__}: {str(exc)[:200]}")
        return
    over = []
    for where, target in rows:
        n = len(tokenize_target(tokenizer, target))
        if n > context:
            over.append((where, n))
    if not over:
        return
    if recipe.data.truncate:
        where, n = over[0]
        check.notes.append(
            f"data.truncate: {len(over)} target(s) longer than the model's context ({context} tokens) "
            f"are cut to fit (the first: {where}, {n} tokens)"
        )
        return
    what = "conversation's text" if recipe.data.source == "llava" else "target"
    for where, n in over:
        check.add(f"{where}: the {what} is {n} tokens (with EOS), longer than the model's context "
                  f"({context}); shorten it, or set data.truncate: true to cut such targets")


def check_run(recipe, output_dir: str | Path) -> RunCheck:
    """Everything `bridge train` checks before it writes anything (see the module docstring)."""
    check = RunCheck()
    for problem in output_dir_problems(output_dir):
        check.add(problem)
    check_data(recipe, check)
    return check
