"""The request fields of structured outputs this server does not take, refused in one place.

`structured_outputs` and `response_format` are declared request fields (`bridge.serve.structured` turns
them into the engine's constraint). vLLM's older `guided_*` fields and `structural_tag` are answered 400
naming the field and the field to use instead: an answer that ignored the constraint would look like a
valid one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from bridge.serve.errors import ApiError

STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                            "guided_choice", "guided_grammar", "guided_json_object",
                            "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag")
NOT_IMPLEMENTED = "not taken by this server; constrain the output with structured_outputs or response_format"


def _asks_nothing(name: str, value: Any) -> bool:
    if value is None:
        return True
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text" and len(value) == 1
    if name in ("guided_decoding_backend", "guided_whitespace_pattern"):
        return True  # options of a constraint: refused with the constraint itself, harmless alone
    return name == "guided_json_object" and value is False


def check_structured_outputs(body: BaseModel) -> None:
    """400 naming the first structured-output field `body` sets (see the module docstring)."""
    extra = body.model_extra or {}
    for name in STRUCTURED_OUTPUT_FIELDS:
        if name in extra and not _asks_nothing(name, extra[name]):
            kind = extra[name].get("type") if name == "response_format" and isinstance(extra[name], dict) \
                else None
            what = f"{name} of type {kind!r}" if isinstance(kind, str) else name
            raise ApiError(400, f"{what[:120]}: {NOT_IMPLEMENTED}", param=name)


__all__ = ["NOT_IMPLEMENTED", "STRUCTURED_OUTPUT_FIELDS", "check_structured_outputs"]
