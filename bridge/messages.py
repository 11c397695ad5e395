"""Error messages that quote what a caller or a server sent, cut to a bound: hostile or broken input
must not make our exceptions, logs and HTTP answers arbitrarily large."""

from __future__ import annotations

MAX_MESSAGE_CHARS = 500


def bounded(text: object, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` as a string of at most `limit` characters (plus a note of how many were cut), with lone
    surrogates replaced so it can always go out as JSON."""
    text = str(text).encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more chars)"
