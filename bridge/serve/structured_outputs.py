"""Structured outputs: the one place a request's output constraints are decided.

vLLM constrains decoding from `response_format` (`json_object`, `json_schema`, `structural_tag`),
`structured_outputs` and, in older versions, the `guided_*` fields. This server has no constrained
decoding yet, so each of those answers 400 naming the field: an answer that ignored the constraint
would look like a valid one. `response_format: {"type": "text"}` constrains nothing and is accepted.

When constrained decoding lands, `check_structured_outputs` becomes the function that turns these
fields into the engine's constraint; nothing else in the server looks at them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from bridge.serve.errors import ApiError

STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                            "guided_choice", "guided_grammar", "guided_json_object",
                            "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag")
NOT_IMPLEMENTED = "structured outputs (constrained decoding) are not implemented on this server"


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
