"""The pass over a JSONL data file that runs before a run writes anything.

It reads every row (JSON object, target string, media values, placeholders against the row's
media) and checks every media path: it exists, is a regular file (not a folder) and is readable.
Every problem is collected, each naming `file:line`, so one `bridge train` lists everything to
fix; the caller shows the first few and a count.

Why a pass of its own: `JsonlDataset` stops at the first bad row and opens each media file to read
its header, which for a million rows takes minutes. This pass opens no media file and asks the
filesystem about each distinct path once, so a set that names a few thousand files a million times
costs a few thousand `stat` calls; its cost is parsing the JSON.

Targets: a row whose target may be longer than `max_target_tokens` is kept for an exact count
(`long_targets`). The test is a bound that needs no tokenizer: a target of B UTF-8 bytes never
makes more than B + 2 tokens (a leading space and EOS; byte-level BPE, SentencePiece and word-level
tokenizers emit at least one byte per token), so only rows above the bound are tokenized.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bridge.data.example import PLACEHOLDER_RE, PLACEHOLDERS

MEDIA_KEYS = tuple(PLACEHOLDERS.values())
#: problems kept verbatim per scan (the rest are only counted): enough to see the pattern
KEEP_PROBLEMS = 20
#: tokens a target may take beyond its UTF-8 bytes (the leading space and EOS)
TARGET_TOKEN_SLACK = 2
_SHOWN = 120
#: json.loads without its per-call checks (the bytes are decoded as UTF-8 first, as JSONL is)
_decode = json.JSONDecoder().decode


@dataclass
class DataScan:
    """What the pass found in one data file (or set of shards)."""

    path: Path
    rows: int = 0
    #: the first KEEP_PROBLEMS problems, "file:line: what"
    problems: list[str] = field(default_factory=list)
    num_problems: int = 0
    #: problems of the whole file (unreadable, corrupt, a missing column): never skipped
    file_problems: list[str] = field(default_factory=list)
    #: rows with at least one problem (what data.skip_bad_rows would pass over)
    bad_rows: int = 0
    #: (where, text) of rows whose target may exceed the token limit (see the module docstring)
    long_targets: list[tuple[str, str]] = field(default_factory=list)
    #: distinct media paths checked
    media_files: int = 0
    #: problems kept verbatim (the rest are only counted)
    keep: int = KEEP_PROBLEMS
    _last_bad: object = None

    def check_media_paths(self, root: str, media: Mapping[str, list[str]], where: str, row: object,
                          checked: dict) -> None:
        """Each media path of a row exists and is a readable file (`path_problem`); a path already
        looked at (`checked`, shared across rows: (root, path) -> problem) is not looked at again."""
        for mod, rels in media.items():
            for rel in rels:
                key = (root, rel)
                why = checked.get(key, key)
                if why is key:
                    why = checked[key] = path_problem(os.path.join(root, rel))
                    self.media_files += 1
                if why:
                    self.add(f"{where}: {mod} file {Path(root) / rel}: {why}", row)

    def add(self, problem: str, row: object = None) -> None:
        """One problem; `row` identifies the row it belongs to (None: the whole file's)."""
        self.num_problems += 1
        if len(self.problems) < self.keep:
            self.problems.append(problem)
        if row is None:
            self.file_problems.append(problem)
        elif row != self._last_bad:
            self.bad_rows += 1
            self._last_bad = row


#: the JSONL pass's result (the name it had before other sources shared it)
JsonlScan = DataScan


def path_problem(path: Path | str) -> str | None:
    """Why `path` cannot be read as a data file (None when it can): missing, a folder, a symlink
    loop, not a regular file, or not readable."""
    try:
        info = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink loop (too many levels of symbolic links)"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "file not found"
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISDIR(info.st_mode):
        return "is a folder, not a file"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if not os.access(path, os.R_OK):
        return "not readable (permission denied)"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


class _Placeholders:
    """Placeholder counts per prompt text, memoised: most rows share the recipe's template."""

    def __init__(self) -> None:
        self._memo: dict[str, dict[str, int]] = {}

    def counts(self, prompt: str) -> dict[str, int]:
        hit = self._memo.get(prompt)
        if hit is None:
            hit = {}
            for m in PLACEHOLDER_RE.finditer(prompt):
                mod = PLACEHOLDERS[m.group(0)]
                hit[mod] = hit.get(mod, 0) + 1
            if len(self._memo) < 4096:
                self._memo[prompt] = hit
        return hit


def scan_jsonl(
    path: str | Path,
    *,
    prompt: str,
    target_field: str = "text",
    media_root: str | Path | None = None,
    max_target_tokens: int | None = None,
    checked: dict[tuple[str, str], str | None] | None = None,
) -> DataScan:
    """Check every row of the JSONL file at `path` (see the module docstring). `checked` maps the
    (media root, row path) pairs already checked to their problem (shared between the train and
    eval files); keyed by the strings as written, since building a Path per row would cost more
    than the rest of the row's check."""
    path = Path(path)
    scan = DataScan(path)
    problem = path_problem(path)
    if problem:
        scan.add(f"{path}: {problem}")
        return scan
    root = str(Path(media_root) if media_root else path.parent)
    name = str(path)
    checked = {} if checked is None else checked
    fields = [name for _, name, _, _ in string.Formatter().parse(prompt) if name]
    placeholders = _Placeholders()
    byte_limit = None if max_target_tokens is None else max_target_tokens - TARGET_TOKEN_SLACK
    try:
        handle = path.open("rb")
    except OSError as exc:
        scan.add(f"{path}: cannot be read ({exc.strerror})")
        return scan
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            scan.rows += 1
            where = f"{name}:{lineno}"
            try:
                row = _decode(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                scan.add(f"{where}: not UTF-8 text (byte {exc.start})", lineno)
                continue
            except json.JSONDecodeError as exc:
                scan.add(f"{where}: not valid JSON: {exc.msg} at column {exc.colno}", lineno)
                continue
            if not isinstance(row, dict):
                scan.add(f"{where}: each line must be a JSON object", lineno)
                continue
            target = row.get(target_field)
            if not isinstance(target, str):
                scan.add(f"{where}: missing string field {target_field!r}", lineno)
            elif byte_limit is not None and len(target) > byte_limit // 4:  # UTF-8: <= 4 bytes a char
                if len(target.encode()) > byte_limit:
                    scan.long_targets.append((where, target))
            media = _row_media(row, where, scan, lineno)
            if media is None:
                continue
            _check_placeholders(row, media, prompt, fields, placeholders, where, scan, lineno)
            scan.check_media_paths(root, media, where, lineno, checked)
    if scan.rows == 0:
        scan.add(f"{path}: no rows")
    return scan


def _row_media(row: Mapping, where: str, scan: DataScan, lineno: int) -> dict[str, list[str]] | None:
    """The row's media paths per modality (None, with the problem added, when a value is not a
    path string or a list of them)."""
    media: dict[str, list[str]] = {}
    for mod in MEDIA_KEYS:
        value = row.get(mod)
        if value is None:
            continue
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
            scan.add(f"{where}: {mod!r} must be a file path or a list of file paths (strings), got "
                     f"{_short(value)}", lineno)
            return None
        if values:
            media[mod] = values
    return media


def _check_placeholders(row: Mapping, media: Mapping[str, list[str]], template: str, fields: list[str],
                        placeholders: _Placeholders, where: str, scan: DataScan, lineno: int) -> None:
    own = row.get("prompt")
    if own is not None and not isinstance(own, str):
        scan.add(f"{where}: 'prompt' must be a string, got {type(own).__name__}", lineno)
        return
    if own:
        text = own
    elif fields:
        missing = [n for n in fields if n not in row]
        if missing:
            scan.add(f"{where}: prompt template {_short(template)} references {missing}, which the row lacks",
                     lineno)
            return
        try:
            text = template.format_map(row)
        except (ValueError, KeyError, IndexError, AttributeError) as exc:
            scan.add(f"{where}: prompt template {_short(template)}: {exc}", lineno)
            return
    else:
        text = template
    wanted = placeholders.counts(text)
    given = {mod: len(items) for mod, items in media.items()}
    if wanted != given:
        scan.add(f"{where}: prompt {_short(text)} has placeholders {wanted or '{}'} but the row's items are "
                 f"{given or '{}'}: each <image>/<audio>/<graph> takes one item of its modality", lineno)
