"""JSONL rows with text and media paths -> Examples.

One JSON object per line. The target is `row[target_field]` (default "text"); media paths are
under the modality's key, a string or a list of strings, relative to `media_root` (default: the
JSONL file's folder). A row may carry its own "prompt"; otherwise the recipe's template is
rendered with the row's fields. Example line:

    {"image": "imgs/001.png", "text": "a red circle"}
    {"audio": "clips/7.wav", "prompt": "<audio> transcribe:", "text": "hello"}
    {"graph": "graphs/3.json", "text": "a ring of 6 atoms"}

Everything that can be checked cheaply is checked when the file is loaded, each error naming
`file:line` (and the media file): JSON, the target, media values (path strings), a media path
under a key that is not a modality (`{"img": ...}`), the prompt's placeholders against the
row's media, and each media file's header (image header, WAV header, the whole graph JSON).
Images are decoded lazily, on access; a file that fails then names `file:line` the same way.
`check_all_items` decodes every item up front (the eval set does, before training starts).

A row's own problem raises `BadRow` (a ValueError); with `skip_bad_rows` the row is dropped and named
in `skipped` instead (bridge.data.bad_rows). A file that cannot be read is never skipped.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from bridge.data.bad_rows import BadRow
from bridge.data.example import PLACEHOLDERS, Example, check_media_matches_prompt, render_prompt
from bridge.data.media import MEDIA_SUFFIXES, check_row_media, decode_fully, load_media
from encoders.media_budget import MediaLimits

MEDIA_KEYS = tuple(PLACEHOLDERS.values())
_SHOWN = 120  # characters of a row's value quoted in an error


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


class JsonlDataset:
    def __init__(
        self,
        path: str | Path,
        *,
        prompt: str,
        target_field: str = "text",
        media_root: str | Path | None = None,
        media_limits: MediaLimits | None = None,
        skip_bad_rows: bool = False,
    ):
        """`media_limits`: what one row's media may add up to (pixels, samples, nodes), from headers.
        `skip_bad_rows`: drop a malformed row (named in `skipped`) instead of raising BadRow."""
        self.path = Path(path)
        self.media_limits = media_limits or MediaLimits()
        if not self.path.is_file():
            raise ValueError(f"data file not found: {self.path}")
        self.prompt = prompt
        self.target_field = target_field
        self.media_root = Path(media_root) if media_root else self.path.parent
        self._template_fields = {name for _, name, _, _ in string.Formatter().parse(prompt) if name}
        self.rows: list[dict] = []
        self.line_numbers: list[int] = []
        self.skip_bad_rows = skip_bad_rows
        #: "file:line: why" of every row dropped (skip_bad_rows)
        self.skipped: list[str] = []
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{self.path}: cannot be read ({exc.strerror})") from None
        # lines end at "\n" only, as JSONL says: splitlines() would also cut at U+2028 and other
        # separators that JSON allows inside strings, and misnumber every later line. Each line is
        # decoded on its own (as the check before the run does), so one bad line is one bad row.
        for lineno, raw in enumerate(data.split(b"\n"), start=1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise BadRow(f"{self.path}:{lineno}: not UTF-8 text (byte {exc.start})") from None
                self.rows.append(self._check_row(line, lineno))
            except BadRow as exc:
                if not skip_bad_rows:
                    raise
                self.skipped.append(str(exc))
                continue
            self.line_numbers.append(lineno)
        if not self.rows:
            left = " left after skipping bad ones" if self.skipped else ""
            raise ValueError(f"{self.path}: no rows{left}")

    def _check_row(self, line: str, lineno: int) -> dict:
        where = f"{self.path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadRow(f"{where}: not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(row, dict):
            raise BadRow(f"{where}: each line must be a JSON object")
        if not isinstance(row.get(self.target_field), str):
            raise BadRow(f"{where}: missing string field {self.target_field!r}")
        if "prompt" in row and not isinstance(row["prompt"], str):
            raise BadRow(f"{where}: 'prompt' must be a string, got {type(row['prompt']).__name__}")
        media = {}
        for mod in MEDIA_KEYS:
            media[mod] = _media_paths(row, mod, where)
        self._check_unknown_media_keys(row, where)
        try:
            prompt = row.get("prompt") or render_prompt(self.prompt, row)
            check_media_matches_prompt(prompt, media)
        except ValueError as exc:
            raise BadRow(f"{where}: {exc}") from None
        check_row_media(media, self.media_root, self.media_limits, where)
        return row

    def _check_unknown_media_keys(self, row: dict, where: str) -> None:
        """A key that is not a modality (nor the target, "prompt" or a template field) but holds a
        media path (`{"img": "a.png"}`) is a typo that would otherwise surface mid-training as a
        placeholder without an item, or as media silently left out."""
        known = {*MEDIA_KEYS, self.target_field, "prompt", *self._template_fields}
        for key, value in row.items():
            if key in known:
                continue
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, str) and Path(v).suffix.lower() in MEDIA_SUFFIXES for v in values):
                raise BadRow(
                    f"{where}: unknown media key {_short(key)}; media keys are {', '.join(MEDIA_KEYS)}"
                )

    def __len__(self) -> int:
        return len(self.rows)

    def vocab_words(self) -> list[str]:
        from bridge.data.example import target_words

        return target_words(r[self.target_field] for r in self.rows)

    def __getitem__(self, index: int) -> Example:
        row = self.rows[index]
        where = f"{self.path}:{self.line_numbers[index]}"
        prompt = row.get("prompt") or render_prompt(self.prompt, row)
        media = {}
        for mod in MEDIA_KEYS:
            items = []
            for rel in _media_paths(row, mod, where):
                file = self.media_root / rel
                try:
                    items.append(load_media(mod, file))
                except ValueError as exc:
                    raise BadRow(f"{where}: {mod} file {file}: {exc}") from None
            if items:
                media[mod] = items
        return Example(prompt, row[self.target_field], media)

    def check_all_items(self) -> None:
        """Decode every item as its encoder will, raising the first failure (naming file:line and
        the media file). A cheap pass for a small set such as the eval set, so a corrupt item is
        found before training starts rather than at the end of the run. With skip_bad_rows such a row
        is dropped (and named in `skipped`) instead."""
        keep = []
        for index, row in enumerate(self.rows):
            where = f"{self.path}:{self.line_numbers[index]}"
            try:
                for mod in MEDIA_KEYS:
                    for rel in _media_paths(row, mod, where):
                        file = self.media_root / rel
                        try:
                            decode_fully(mod, file)
                        except ValueError as exc:
                            raise BadRow(f"{where}: {mod} file {file}: {exc}") from None
            except BadRow as exc:
                if not self.skip_bad_rows:
                    raise
                self.skipped.append(str(exc))
                continue
            keep.append(index)
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            self.line_numbers = [self.line_numbers[i] for i in keep]
            if not self.rows:
                raise ValueError(f"{self.path}: no rows left after skipping bad rows")


def _media_paths(row: dict, modality: str, where: str) -> list[str]:
    """The row's media paths for `modality`: a string or a list of non-empty strings."""
    value = row.get(modality)
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise BadRow(
            f"{where}: {modality!r} must be a file path or a list of file paths (strings), got "
            f"{_short(value)}"
        )
    return values
