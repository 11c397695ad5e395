"""Sampling parameters, shaped like vLLM's so that its users need nothing new.

Validation happens here, at construction, so that a bad value is a `ValueError` naming the field
(type, finiteness, range) before any request is scheduled: a NaN temperature or a string
`max_tokens` would otherwise surface as garbage tokens or a TypeError deep in the sampler.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    `temperature == 0` is greedy. `top_k <= 0` (or -1) disables top-k; `top_p == 1` disables
    top-p. `seed` gives the request its own generator: the same seed gives the same output
    whatever else is in the batch. `logprobs` asks for the log-probability of each sampled
    token (an int k >= 0 also returns the top-k alternatives' values when supported; 0 means
    only the sampled token). `prompt_logprobs` is accepted for token prompts only.
    Penalties follow vLLM/OpenAI: `repetition_penalty` (> 0, 1 = off) scales logits of tokens
    seen in the prompt or the output; `presence_penalty` and `frequency_penalty` subtract for
    tokens already generated. Positions of a prompt that carry embeddings instead of tokens
    never count as "seen". A stop string is cut from the text, unless `include_stop_str_in_output`
    (vLLM's field): then the text ends with it. `structured_outputs` constrains the output to a JSON
    schema, a regex, a list of choices or a grammar (`StructuredOutputsParams`; a mapping of its fields
    is accepted too).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.max_tokens = _int_field("max_tokens", self.max_tokens, low=1)
        self.temperature = _float_field("temperature", self.temperature, low=0.0)
        self.top_p = _float_field("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        self.top_k = -1 if self.top_k is None else _int_field("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            self.top_k = -1
        if self.seed is not None:
            self.seed = _int_field("seed", self.seed, low=_SEED_MIN, high=_SEED_MAX)
        self.ignore_eos = _bool_field("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _bool_field("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool_field("include_stop_str_in_output",
                                                      self.include_stop_str_in_output)
        self._stop_list = _stop_strings(self.stop)
        self.stop_token_ids = _token_id_list("stop_token_ids", self.stop_token_ids)
        if self.logprobs is not None:
            self.logprobs = _int_field("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int_field("prompt_logprobs", self.prompt_logprobs, low=0)
        self.repetition_penalty = _float_field(
            "repetition_penalty", self.repetition_penalty, low=0.0, low_open=True
        )
        self.presence_penalty = _float_field("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = _float_field("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        self.min_tokens = _int_field("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens:
            # The grammar decides where the output may end: below min_tokens its only allowed token
            # (EOS, once the grammar is complete) would be suppressed and nothing would be left to sample.
            raise ValueError("min_tokens cannot be combined with structured_outputs (the grammar decides "
                             "where the output ends); leave min_tokens at 0")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output, vLLM's `StructuredOutputsParams`: exactly one of

    - `json`: a JSON schema (a dict, or its JSON text); the output is a JSON value valid against it;
    - `regex`: the output matches the regular expression in full;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: an EBNF grammar (xgrammar's dialect, GBNF-like, rule `root`), or a Lark grammar;
    - `json_object=True`: any JSON object or array.

    `disable_any_whitespace`: JSON output without free whitespace between tokens (compact), as in vLLM.
    Only the form of each field is checked here; the engine compiles the grammar when the request is
    added (`LLM.generate` / `add_request`), so a schema, regex or grammar it cannot compile is a
    `ValueError` naming the field before anything is scheduled. The output stops when the grammar is
    complete and the model samples EOS (allowed only then), or when the grammar cannot go on.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        where = "structured_outputs"
        if self.json is not None:
            self.json = _json_schema(self.json, f"{where}.json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{where}.{name} must be a non-empty string, got {type(value).__name__} "
                                 f"{_shown(value)}")
        if self.choice is not None:
            self.choice = _choices(self.choice, f"{where}.choice")
        if self.json_object is not None:
            _bool_field(f"{where}.json_object", self.json_object)
        _bool_field(f"{where}.disable_any_whitespace", self.disable_any_whitespace)
        given = self.constraints
        if len(given) != 1:
            raise ValueError(f"{where} takes exactly one of json, regex, choice, grammar, json_object=true; "
                             f"got {', '.join(given) if given else 'none'}")

    @property
    def constraints(self) -> list[str]:
        """The constraint fields set (exactly one once constructed)."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return given + (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return self.constraints[0]

    @property
    def json_text(self) -> str:
        """The JSON schema as compact JSON text (what the grammar compiler reads and caches by)."""
        return json.dumps(self.json, separators=(",", ":"), sort_keys=True)

    def to_dict(self) -> dict:
        """The set fields as vLLM's request body spells them (`structured_outputs` of a completion)."""
        out: dict = {self.kind: True if self.kind == "json_object" else getattr(self, self.kind)}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def _json_schema(value: object, where: str) -> dict:
    """A JSON schema as a dict: a dict is kept (it must be JSON data), JSON text is parsed; a schema is
    an object (`true`/`false` schemas constrain nothing useful and are refused)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a JSON schema object (a dict or its JSON text), got "
                         f"{type(value).__name__} {_shown(value)}")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} must hold JSON data only: {exc}") from None


def _choices(value: object, where: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where} must be a non-empty list of strings, got {type(value).__name__} "
                         f"{_shown(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ValueError(f"{where}[{i}] must be a non-empty string, got {type(item).__name__} "
                             f"{_shown(item)}")
    return list(value)


def _structured_outputs(value: object) -> StructuredOutputsParams | None:
    """`structured_outputs` as a StructuredOutputsParams; a mapping of its fields is converted."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, Mapping):
        known = set(StructuredOutputsParams.__dataclass_fields__)
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {unknown[:5]}; expected some of "
                             f"{sorted(known)}")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams (or a dict of its fields), got "
                     f"{type(value).__name__}")


_MAX_INT = 2**63 - 1  # ids, counts and seeds end up in int64 tensors
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
_MAX_SHOWN = 200  # characters of a caller's value echoed in an error message


def _shown(value: object) -> str:
    """repr of a caller's value, cut to a bounded length for error messages."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + f"... ({len(text)} chars)"


def _int_field(name: str, value: object, *, low: int, high: int = _MAX_INT) -> int:
    """An integer (a bool is not one) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {_shown(value)}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {_shown(value)}")
    return value


def _float_field(
    name: str, value: object, *, low: float, high: float = math.inf, low_open: bool = False
) -> float:
    """A finite real number in [low, high] ((low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {_shown(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if (value <= low if low_open else value < low) or value > high:
        span = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
        raise ValueError(f"{name} must be in {span}, got {value}")
    return value


def _bool_field(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {type(value).__name__} {_shown(value)}")
    return value


def _stop_strings(stop: object) -> list[str]:
    """`stop` as a list of non-empty strings. An empty stop string is refused: it would match
    at once (or, in a list, be silently ignored), and neither is what anyone asking for it means."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise ValueError(f"stop[{i}] must be a string, got {type(s).__name__} {_shown(s)}")
        if not s:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise ValueError(f"{where} is an empty string; give non-empty stop strings (or none)")
    return list(items)


def _token_id_list(name: str, ids: object) -> list[int]:
    """Integer ids in int64 range; an id outside the vocabulary (such as -1) simply never matches."""
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    return [_int_field(f"{name}[{i}]", t, low=-_MAX_INT - 1) for i, t in enumerate(ids)]
