"""LLaVA conversations -> conversation Examples (`data.source: llava`).

The file is LLaVA's JSON (one array of rows, as `llava_v1_5_mix665k.json`) or JSONL (one row a line):

    {"id": "0001", "image": "coco/train2017/0001.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is on the table?"},
                       {"from": "gpt", "value": "A red mug."},
                       {"from": "human", "value": "What colour is the wall?"},
                       {"from": "gpt", "value": "White."}]}

"human" (or "user") turns are the prompt, "gpt" (or "assistant") turns are learned, an optional
first "system" turn is prompt too. `image` (or `audio`, `graph`) is a path or a list of paths
relative to `data.media_root` (default: the file's folder), one per placeholder of the human
turns, in order. A row without media is a text-only conversation.

Rows are named `file:line` (a JSON array's rows by the line each starts on and its index,
`file:line (row i)`, since a minified file is one line). A syntax error in a JSON array is the
whole file's problem: no row after it can be found. Each row is kept as its JSON text and parsed
again when it is read: a few hundred thousand conversations as text take a fraction of the memory
of the same rows as Python dicts and lists, and forked loader workers share it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bridge.data.bad_rows import BadRow
from bridge.data.conversation import conversation_example, format_user_turn
from bridge.data.example import PLACEHOLDER_RE, PLACEHOLDERS, Example, Turn, target_words
from bridge.data.jsonl_check import TARGET_TOKEN_SLACK, DataScan, path_problem
from encoders.media_budget import MediaLimits

MEDIA_KEYS = tuple(PLACEHOLDERS.values())
#: a row's "from" -> the turn's role
ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_SHOWN = 120
_decoder = json.JSONDecoder()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def iter_rows(path: Path) -> Iterator[tuple[str, str, Any, str | None]]:
    """(where, the row's JSON text, the row or None, its problem or None) for every row of a LLaVA
    JSON array or JSONL file. Raises ValueError for a problem of the whole file (unreadable, not
    UTF-8, a JSON array with a syntax error)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
    first = _first_non_space(data)
    if data[first:first + 1] != b"[":
        yield from _jsonl_rows(path, data)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    data = b""  # the text holds it now
    pos = text.index("[") + 1
    line = 1 + text.count("\n", 0, pos)
    index = 0
    while True:
        start = _skip_space(text, pos)
        line += text.count("\n", pos, start)
        if start >= len(text):
            raise ValueError(f"{path}: the JSON array is not closed (the file ends at line {line})")
        if text[start] == "]" and index == 0:
            close = start
            break
        try:
            row, end = _decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                             "no row after it can be read") from None
        yield f"{path}:{line} (row {index})", text[start:end], row, None
        index += 1
        pos = _skip_space(text, end)
        line += text.count("\n", start, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1
            continue
        if pos < len(text) and text[pos] == "]":
            close = pos
            break
        raise ValueError(f"{path}:{line}: not valid JSON (expected ',' or ']' after row {index - 1}); "
                         "no row after it can be read")
    if text[close + 1:].strip():
        raise ValueError(f"{path}: text after the JSON array's closing ']'")


def _first_non_space(data: bytes) -> int:
    pos = 0
    while pos < len(data) and data[pos : pos + 1] in (b" ", b"\t", b"\r", b"\n"):
        pos += 1
    return pos


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _jsonl_rows(path: Path, data: bytes) -> Iterator[tuple[str, str, Any, str | None]]:
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield where, "", None, f"not UTF-8 text (byte {exc.start})"
            continue
        try:
            row = _decoder.decode(line)
        except json.JSONDecodeError as exc:
            yield where, line, None, f"not valid JSON: {exc.msg} at column {exc.colno}"
            continue
        yield where, line, row, None


def parse_row(row: Any) -> tuple[tuple[Turn, ...], dict[str, list[str]]]:
    """A LLaVA row -> its turns (text stripped) and media paths per modality; ValueError saying
    what is wrong (without where)."""
    if not isinstance(row, dict):
        raise ValueError("each row must be a JSON object")
    conv = row.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise ValueError("missing 'conversations' (a list of {\"from\", \"value\"} turns)")
    turns = []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ValueError(f"conversations[{i}] must be an object with a string 'value'")
        role = ROLE_OF.get(turn.get("from"))  # type: ignore[arg-type]
        if role is None:
            raise ValueError(f"conversations[{i}]: 'from' is {_short(turn.get('from'))}; expected human or "
                             "gpt")
        turns.append(Turn(role, turn["value"].strip()))
    body = turns[1:] if turns[0].role == "system" else turns
    for i, turn in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if turn.role != want:
            at = i + len(turns) - len(body)
            raise ValueError(f"conversations[{at}] is a {_role_name(turn.role)} turn where a "
                             f"{_role_name(want)} turn belongs (human and gpt alternate, human first)")
        if turn.role == "assistant" and PLACEHOLDER_RE.search(turn.text):
            at = i + len(turns) - len(body)
            raise ValueError(f"conversations[{at}] (gpt) holds a media placeholder; media go in human turns")
    if not body or body[-1].role != "assistant":
        raise ValueError("the conversation must end with a gpt turn (it is what the model learns)")
    media = {}
    for mod in MEDIA_KEYS:
        value = row.get(mod)
        if value is None:
            continue
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
            raise ValueError(f"{mod!r} must be a file path or a list of file paths, got {_short(value)}")
        if values:
            media[mod] = values
    wanted: dict[str, int] = {}
    for turn in turns:
        for m in PLACEHOLDER_RE.finditer(turn.text):
            wanted[PLACEHOLDERS[m.group(0)]] = wanted.get(PLACEHOLDERS[m.group(0)], 0) + 1
    given = {mod: len(v) for mod, v in media.items()}
    if wanted != given:
        raise ValueError(f"the human turns hold placeholders {wanted or '{}'} but the row's media are "
                         f"{given or '{}'}: each <image>/<audio>/<graph> takes one item of its modality")
    return tuple(turns), media


def _role_name(role: str) -> str:
    return {"user": "human", "assistant": "gpt"}.get(role, role)


def conversation_text_bytes(turns: tuple[Turn, ...]) -> int:
    return sum(len(t.text.encode()) + 1 for t in turns)


def scan_llava(
    path: str | Path,
    *,
    prompt: str,
    media_root: str | Path | None = None,
    max_target_tokens: int | None = None,
    checked: dict[tuple[str, str], str | None] | None = None,
) -> DataScan:
    """The check before a run (bridge.run_check): every row's structure, placeholders and media
    paths (exist, readable, a file), no media file opened. A conversation whose text alone may not
    fit `max_target_tokens` is kept in `long_targets`."""
    path = Path(path)
    scan = DataScan(path)
    problem = path_problem(path)
    if problem:
        scan.add(f"{path}: {problem}")
        return scan
    try:
        format_user_turn(prompt, "")
    except ValueError as exc:
        scan.add(f"data.prompt: {exc}")
        return scan
    root = str(Path(media_root) if media_root else path.parent)
    checked = {} if checked is None else checked
    try:
        for where, _, row, why in iter_rows(path):
            scan.rows += 1
            if why is None:
                try:
                    turns, media = parse_row(row)
                except ValueError as exc:
                    why = str(exc)
            if why is not None:
                scan.add(f"{where}: {why}", where)
                continue
            if max_target_tokens is not None and \
                    conversation_text_bytes(turns) > max_target_tokens - TARGET_TOKEN_SLACK:
                scan.long_targets.append((where, " ".join(t.text for t in turns)))
            scan.check_media_paths(root, media, where, where, checked)
    except ValueError as exc:
        scan.add(str(exc))
        return scan
    if scan.rows == 0:
        scan.add(f"{path}: no rows")
    return scan


def assistant_texts(path: str | Path) -> Iterator[str]:
    """The gpt turns of every good row (a tiny model's vocabulary comes from them)."""
    for _, _, row, why in iter_rows(Path(path)):
        if why is None:
            try:
                turns, _ = parse_row(row)
            except ValueError:
                continue
            yield from (t.text for t in turns if t.role == "assistant")


class LlavaDataset:
    """A LLaVA JSON / JSONL file as conversation Examples (see the module docstring). Everything
    cheap is checked at load, each error naming its row: structure, placeholders, each media file's
    header and the row's media budget. Media are decoded when a row is read."""

    def __init__(
        self,
        path: str | Path,
        *,
        prompt: str = "{value}",
        media_root: str | Path | None = None,
        media_limits: MediaLimits | None = None,
        skip_bad_rows: bool = False,
    ):
        """`prompt`: the user-turn format used when the tokenizer has no chat template."""
        self.path = Path(path)
        problem = path_problem(self.path)
        if problem:
            raise ValueError(f"data file {self.path}: {problem}")
        format_user_turn(prompt, "")
        self.turn_format = prompt
        self.media_root = Path(media_root) if media_root else self.path.parent
        self.media_limits = media_limits or MediaLimits()
        self.skip_bad_rows = skip_bad_rows
        self.skipped: list[str] = []
        self._raw: list[str] = []
        self._where: list[str] = []
        for where, raw, row, why in iter_rows(self.path):
            try:
                if why is not None:
                    raise BadRow(f"{where}: {why}")
                self._check(where, row)
            except BadRow as exc:
                if not skip_bad_rows:
                    raise
                self.skipped.append(str(exc))
                continue
            self._raw.append(raw)
            self._where.append(where)
        if not self._raw:
            left = " left after skipping bad ones" if self.skipped else ""
            raise ValueError(f"{self.path}: no rows{left}")

    def _check(self, where: str, row: Any) -> None:
        from bridge.data.media import check_row_media

        try:
            _, media = parse_row(row)
        except ValueError as exc:
            raise BadRow(f"{where}: {exc}") from None
        check_row_media(media, self.media_root, self.media_limits, where)

    def __len__(self) -> int:
        return len(self._raw)

    def _parsed(self, index: int) -> tuple[str, tuple[Turn, ...], dict[str, list[str]]]:
        where = self._where[index]
        turns, media = parse_row(json.loads(self._raw[index]))
        return where, turns, media

    def __getitem__(self, index: int) -> Example:
        from bridge.data.media import load_media

        where, turns, paths = self._parsed(index)
        media: dict[str, list[Any]] = {}
        for mod, rels in paths.items():
            items = []
            for rel in rels:
                file = self.media_root / rel
                try:
                    items.append(load_media(mod, file))
                except ValueError as exc:
                    raise BadRow(f"{where}: {mod} file {file}: {exc}") from None
            media[mod] = items
        return conversation_example(turns, media, self.turn_format)

    def vocab_words(self) -> list[str]:
        return target_words(
            t.text for i in range(len(self)) for t in self._parsed(i)[1] if t.role == "assistant"
        )

    def check_all_items(self) -> None:
        """Decode every item as its encoder will (the eval set, before training): the first failure
        raises BadRow naming the row, or with skip_bad_rows the row is dropped."""
        from bridge.data.media import decode_fully

        keep = []
        for index in range(len(self)):
            where, _, paths = self._parsed(index)
            try:
                for mod, rels in paths.items():
                    for rel in rels:
                        try:
                            decode_fully(mod, self.media_root / rel)
                        except ValueError as exc:
                            raise BadRow(f"{where}: {mod} file {self.media_root / rel}: {exc}") from None
            except BadRow as exc:
                if not self.skip_bad_rows:
                    raise
                self.skipped.append(str(exc))
                continue
            keep.append(index)
        if len(keep) < len(self):
            self._raw = [self._raw[i] for i in keep]
            self._where = [self._where[i] for i in keep]
            if not self._raw:
                raise ValueError(f"{self.path}: no rows left after skipping bad rows")


__all__ = ["LlavaDataset", "assistant_texts", "iter_rows",
           "parse_row", "scan_llava"]
