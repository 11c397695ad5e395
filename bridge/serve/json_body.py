"""Request bodies whose long base64 strings skip `json.loads`'s character-by-character string scan.

Why: a prompt-embeds request is a body of megabytes that is almost all one base64 string, and
`json.loads` reads a string one character at a time, checking each for a quote, an escape or a control
character: a large share of the CPU an API process spends per such request. Base64 text needs none of
those checks: its alphabet has no quote, backslash or
control character.

`loads_body(body)` equals `json.loads(body)`. It finds the body's strings with `bytes.find` (C speed),
keeps those of at least `LONG_STRING_BYTES` that are strict base64 (`pybase64` validates at about
15 GB/s), replaces each by a short marker (a per-call random nonce: a client cannot send one), parses
what is left with `json.loads`, and puts the strings back (`str(buffer, "ascii")`, a copy at memcpy
speed; each carries the bytes its check decoded, as a `bridge.wire.Base64Text`, so `load_prompt_embeds`
does not decode it again). Only string contents change, and only to other valid string contents inside
the same quotes, so the short body is valid JSON exactly when the body is. Anything unusual takes
`json.loads(body)` itself, so an invalid body raises json's own error with its own message: a body that
is not UTF-8, a marker used as an object key, a failed short parse, or more quotes and backslashes than
`LEXER_BUDGET` (so a hostile body costs about what `json.loads` would).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import pybase64

from bridge.wire import Base64Text

FAST_BODY_BYTES = 64 * 1024
"""Bodies below this go straight to `json.loads` (nothing long enough to gain on)."""
LONG_STRING_BYTES = 16 * 1024
"""Strings at least this long (in bytes between the quotes) are candidates."""
LEXER_BUDGET = 1024
"""Quotes and backslashes the lexer may look at in one body (a Python loop step each) before it gives
the body to `json.loads`."""


def loads_body(body: bytes | bytearray | str) -> Any:
    """`json.loads(body)`, faster on bodies that carry long base64 strings (see the module docstring)."""
    if not isinstance(body, (bytes, bytearray)) or len(body) < FAST_BODY_BYTES:
        return json.loads(body)
    if json.detect_encoding(body) != "utf-8":
        return json.loads(body)
    spans = _long_base64_strings(body)
    if not spans:
        return json.loads(body)
    nonce = secrets.token_hex(8)
    markers: dict[str, tuple[int, int, bytes]] = {}
    pieces: list[bytes] = []
    view = memoryview(body)
    last = 0
    for i, (start, end, decoded) in enumerate(spans):
        pieces += [view[last:start].tobytes(), f"\\u0000bridge-json:{nonce}:{i}".encode()]
        markers[f"\x00bridge-json:{nonce}:{i}"] = (start, end, decoded)
        last = end
    pieces.append(view[last:].tobytes())
    try:
        data = json.loads(b"".join(pieces))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return json.loads(body)
    restored = _restore(data, markers, view)
    return json.loads(body) if restored is _GIVE_UP else restored


def _long_base64_strings(body: bytes | bytearray) -> list[tuple[int, int, bytes]]:
    """(start, end, decoded bytes) of the contents of the body's long strict-base64 strings; [] to give up.

    Each quote looked at and each backslash counted spends one unit of `LEXER_BUDGET`: a body of many
    short strings, escaped quotes or backslashes gives up early instead of costing a Python loop per
    byte (json.loads reads such a body at C speed)."""
    spans: list[tuple[int, int, bytes]] = []
    budget = LEXER_BUDGET
    pos = 0
    while True:
        start = body.find(b'"', pos) + 1
        if start == 0:
            return spans
        end = start
        while True:  # the first quote not escaped by an odd run of backslashes
            end = body.find(b'"', end)
            budget -= 1
            if end < 0 or budget < 0:
                return []  # unterminated (json.loads says so), or too much work
            run = 0
            while run <= budget and end - run - 1 >= start and body[end - run - 1] == 0x5C:
                run += 1
            budget -= run
            if budget < 0:
                return []
            if run % 2 == 0:
                break
            end += 1
        if end - start >= LONG_STRING_BYTES:
            decoded = _strict_base64(body, start, end)
            if decoded is not None:
                spans.append((start, end, decoded))
        pos = end + 1


def _strict_base64(body: bytes | bytearray, start: int, end: int) -> bytes | None:
    """The decoded bytes of `body[start:end]`, or None when it is not strict base64."""
    try:
        return pybase64.b64decode(memoryview(body)[start:end], validate=True)
    except ValueError:  # binascii.Error is a ValueError
        return None


_GIVE_UP = object()


def _restore(data: Any, markers: dict[str, tuple[int, int, bytes]], view: memoryview) -> Any:
    """`data` with every marker value replaced by its string; `_GIVE_UP` when a marker is an object key.
    A marker that is gone (a duplicate key's earlier value) is gone from `json.loads(body)` too."""

    def text(marker: str) -> str:
        start, end, decoded = markers[marker]
        return Base64Text.carrying(str(view[start:end], "ascii"), decoded)

    if isinstance(data, str):
        return text(data) if data in markers else data
    stack = [data]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if isinstance(key, str) and key in markers:
                return _GIVE_UP
            if isinstance(value, str):
                if value in markers:
                    node[key] = text(value)
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return data


__all__ = ["FAST_BODY_BYTES", "LONG_STRING_BYTES", "loads_body"]
