"""Every field of a request is honoured, refused or logged: never dropped without a word.

The request models (`protocol.py`) declare the fields this server implements and keep the rest
(`extra="allow"`). Those go through `check_request_fields`:

- vLLM's fields this server does not implement (`UNSUPPORTED`) answer 400 naming the field, unless
  sent with a value that asks for nothing (`min_p: 0`, `logit_bias: {}`, `use_beam_search: false`,
  ...): a client that sets one would otherwise get an answer that silently ignored it.
- Fields that change nothing in the answer (`NO_EFFECT`: `user`, `request_id`, ...) are accepted.
- Anything else is unknown: logged once per field name (a warning) and otherwise ignored, as vLLM
  logs the fields it ignores. The names logged are bounded, so a client inventing names cannot grow
  the server's memory or its log without end.

Structured outputs (`response_format` and its kin) are decided in `structured_outputs.py`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from bridge.messages import bounded
from bridge.serve.errors import ApiError
from bridge.serve.structured_outputs import STRUCTURED_OUTPUT_FIELDS, check_structured_outputs

logger = logging.getLogger("bridge.serve")

MAX_LOGGED_NAMES = 256
"""Distinct unknown field names logged per process; later ones are counted, not logged."""


def _is_none(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _number(default: float) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return value is None or (type(value) in (int, float) and value == default)
    return check


def _flag(default: bool) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return value is None or value is default
    return check


def _one_of(*allowed: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return value is None or (isinstance(value, str) and value in allowed)
    return check


UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # name: (the value asks for nothing, why it cannot be honoured)
    "min_p": (_number(0), "min-p sampling is not implemented"),
    "logit_bias": (_empty, "logit biases are not implemented"),
    "allowed_token_ids": (_is_none, "restricting the vocabulary is not implemented"),
    "bad_words": (_empty, "bad words are not implemented"),
    "logprob_token_ids": (_is_none, "logprobs of chosen token ids are not implemented"),
    "use_beam_search": (_flag(False), "beam search is not implemented"),
    "best_of": (_number(1), "best_of is not implemented"),
    "length_penalty": (_number(1), "beam search is not implemented"),
    "early_stopping": (_flag(False), "beam search is not implemented"),
    "watermarking": (_flag(False), "watermarking is not implemented"),
    "spaces_between_special_tokens": (_flag(True), "special tokens are always joined without spaces"),
    "truncate_prompt_tokens": (_is_none, "prompts are never truncated (a prompt over the context is a 400)"),
    "suffix": (_is_none, "suffix is not supported"),
    "priority": (_number(0), "this server does not schedule by priority"),
    "cache_salt": (_is_none, "the prefix cache cannot be salted per request"),
    "tools": (_is_none, "tool calling is not implemented"),
    "tool_choice": (_one_of("none"), "tool calling is not implemented"),
    "functions": (_is_none, "function calling is not implemented"),
    "function_call": (_one_of("none"), "function calling is not implemented"),
    "reasoning_effort": (_is_none, "no reasoning parser is configured"),
    "include_reasoning": (_flag(True), "no reasoning parser is configured"),
    "thinking_token_budget": (lambda v: v is None or (type(v) is int and v == -1),
                              "no reasoning parser is configured"),
    "chat_template": (_is_none, "a request may not bring its own chat template (start the server with "
                                "--chat-template FILE)"),
    "return_prompt_text": (_flag(False), "return_prompt_text is not implemented"),
    "media_io_kwargs": (_empty, "media loading options are not implemented"),
    "mm_processor_kwargs": (_empty, "multimodal processor options are not implemented"),
    "kv_transfer_params": (_is_none, "KV transfer is not implemented"),
    "ec_transfer_params": (_is_none, "encoder-cache transfer is not implemented"),
    "vllm_xargs": (_empty, "vllm_xargs are not implemented"),
    "logits_processors": (_empty, "logits processors are not implemented"),
    "repetition_detection": (_is_none, "repetition detection is not implemented"),
    "routed_experts_prompt_start": (_number(0), "routed-expert data is not implemented"),
}

NO_EFFECT: dict[str, str] = {
    # name: why accepting it changes nothing in the answer
    "request_id": "the answer's id is the server's own",
    "session_id": "a routing hint; one engine serves every session",
    "stream_interval": "a streaming cadence hint; the server sends what each engine step produced",
    "parallel_tool_calls": "tool calling is off (tools are refused)",
    "truncation_side": "used only with truncate_prompt_tokens (refused)",
    "return_token_offsets": "vLLM uses it on its render endpoints only",
    "return_mm_kwargs": "vLLM uses it on its render endpoints only",
}

_MESSAGE_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tool_calls": (_empty, "tool calling is not implemented"),
    "function_call": (_is_none, "function calling is not implemented"),
}


class _UnknownFieldLog:
    """Logs each unknown field name once per process, up to `MAX_LOGGED_NAMES` names."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.unlogged = 0

    def note(self, name: str) -> None:
        with self._lock:
            if name in self._seen:
                return
            if len(self._seen) >= MAX_LOGGED_NAMES:
                self.unlogged += 1
                if self.unlogged == 1:
                    logger.warning("more than %d distinct unknown request fields: further ones are ignored "
                                   "without a log line", MAX_LOGGED_NAMES)
                return
            self._seen.add(name)
        logger.warning("request field %s is not one this server knows: ignored (logged once per name)",
                       bounded(repr(name), 120))

    def reset(self) -> None:
        """Forget the names seen (tests)."""
        with self._lock:
            self._seen.clear()
            self.unlogged = 0


UNKNOWN_FIELDS = _UnknownFieldLog()


def check_request_fields(body: BaseModel) -> None:
    """Refuse what cannot be honoured (400 naming the field), log what is unknown; see the docstring."""
    check_structured_outputs(body)
    for name, value in (body.model_extra or {}).items():
        if name in STRUCTURED_OUTPUT_FIELDS or name in NO_EFFECT:
            continue
        rule = UNSUPPORTED.get(name)
        if rule is None:
            UNKNOWN_FIELDS.note(name)
        elif not rule[0](value):
            raise ApiError(400, f"{name}: {rule[1]}; this server does not accept it", param=name)
    for where, name, value in _nested_extras(body):
        rule = _MESSAGE_UNSUPPORTED.get(name) if where.startswith("messages[") and where.count(".") == 0 \
            else None
        if rule is not None and not rule[0](value):
            raise ApiError(400, f"{where}.{name}: {rule[1]}; this server does not accept it",
                           param=f"{where}.{name}")
        if rule is None:
            UNKNOWN_FIELDS.note(_generic(where) + "." + name)


def _nested_extras(body: BaseModel) -> Iterator[tuple[str, str, Any]]:
    """(where, name, value) of every undeclared field below the top level (messages, their parts,
    stream_options, ...); prompt_embeds strings and token lists hold no models and are not walked."""
    stack: list[tuple[str, Any]] = [(name, getattr(body, name)) for name in type(body).model_fields]
    while stack:
        where, value = stack.pop()
        if isinstance(value, BaseModel):
            for name, extra in (value.model_extra or {}).items():
                yield where, name, extra
            stack.extend((f"{where}.{name}", getattr(value, name)) for name in type(value).model_fields)
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))


def _generic(where: str) -> str:
    """`messages[3].content[1]` -> `messages[].content[]`: one log line per kind of place."""
    out, depth = [], 0
    for ch in where:
        if ch == "[":
            depth += 1
            out.append("[")
        elif ch == "]":
            depth -= 1
            out.append("]")
        elif depth == 0:
            out.append(ch)
    return "".join(out)


__all__ = ["NO_EFFECT", "UNKNOWN_FIELDS", "UNSUPPORTED", "check_request_fields"]
