"""The structured-outputs validity suite's constraints and checks, shared by the CPU and GPU tests
(imported as `structured_cases`: pytest puts `tests/` on the path).

Twenty constraints (JSON schemas with and without free whitespace, regexes, choice lists, EBNF and
Lark grammars), each with a check written independently of the engine: `json.loads` + `jsonschema`,
`re.fullmatch`, membership, and a Python regex equal to each grammar's language. Every constraint's
language is finite or ends with high probability within `MAX_TOKENS` even for a random model at
temperature 1, so every generation must finish with "stop" and pass its check.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema
import torch

from runner.sampling_params import SamplingParams, StructuredOutputsParams

MAX_TOKENS = 96
VOCAB_WORDS = ("cat", "dog", "yes", "no", "true", "false", "null", "name", "red", "blue")


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


_SCHEMAS: list[tuple[dict, bool]] = [  # (schema, disable_any_whitespace)
    (_obj({"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                            "maximum": 120}}), True),
    (_obj({"label": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"}}), True),
    ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
      "maxItems": 3}, True),
    (_obj({"point": _obj({"x": {"type": "integer", "minimum": -5, "maximum": 5},
                          "y": {"type": "integer", "minimum": -5, "maximum": 5}}),
           "tag": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}), True),
    ({"enum": ["red", "green", "blue"]}, True),
    ({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}, True),
    (_obj({"flag": {"type": "boolean"}}), False),  # free whitespace between tokens
    (_obj({"v": {"const": "x"}, "n": {"type": "integer", "minimum": 1, "maximum": 3}}), False),
]
_REGEXES = [
    r"[0-9]{3}-[a-z]{2,4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5}){0,2}",
    r"[0-9]{1,3}\.[0-9]{1,3}",
    r"(ab|cd){1,3}x",
    r"#[0-9a-f]{6}",
]
_CHOICES = [
    ["cat", "dog"],
    ["yes", "no", "maybe"],
    ["A", "B", "C", "D"],
    ['New "York"', "back\\slash", "tab\there"],  # quotes, backslashes and controls need escaping
]
_GRAMMARS = [  # (grammar, the same language as a Python regex)
    ('root ::= "(" num ("+" num){0,2} ")"\nnum ::= [1-9] [0-9]?', r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)"),
    ('start: NUM "," NUM\nNUM: /[0-9]{1,3}/\n', r"[0-9]{1,3},[0-9]{1,3}"),  # Lark
]


def _json_check(schema: dict) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


def cases() -> list[tuple[str, StructuredOutputsParams, Callable[[str], bool]]]:
    """(name, constraint, check of an output text): twenty of them."""
    out = []
    for k, (schema, compact) in enumerate(_SCHEMAS):
        out.append((f"json{k}", StructuredOutputsParams(json=schema, disable_any_whitespace=compact),
                    _json_check(schema)))
    for k, rx in enumerate(_REGEXES):
        out.append((f"regex{k}", StructuredOutputsParams(regex=rx),
                    lambda t, rx=rx: re.fullmatch(rx, t) is not None))
    for k, options in enumerate(_CHOICES):
        out.append((f"choice{k}", StructuredOutputsParams(choice=options), lambda t, o=options: t in o))
    for k, (grammar, rx) in enumerate(_GRAMMARS):
        out.append((f"grammar{k}", StructuredOutputsParams(grammar=grammar),
                    lambda t, rx=rx: re.fullmatch(rx, t) is not None))
    assert len(out) == 20
    return out


def prompt_of(kind: str, j: int, hidden: int, *, dtype: torch.dtype = torch.float32) -> dict:
    """Prompt `j` of a kind: token ids, a whole-prompt embeds tensor, or text with an `<embeds>` item."""
    g = torch.Generator().manual_seed(1000 + j)
    if kind == "ids":
        return {"prompt_token_ids": torch.randint(20, 250, (3 + j % 7,), generator=g).tolist()}
    rows = (torch.randn(2 + j % 5, hidden, generator=g) * 0.5).to(dtype)
    if kind == "embeds":
        return {"prompt_embeds": rows}
    return {"prompt": "answer <embeds> now", "multi_modal_data": {"prompt_embeds": [rows]}}


def run_suite(llm, kinds: tuple[str, ...], per_case: int, *, seed0: int = 0,
              dtype: torch.dtype = torch.float32):
    """Generate `per_case` outputs per case (prompt kinds in turn, temperature 1, a seed each) in one
    `generate` call; returns [(case name, kind, output)]."""
    prompts, params, meta = [], [], []
    hidden = llm.hidden_size
    for c, (name, so, _) in enumerate(cases()):
        for j in range(per_case):
            kind = kinds[j % len(kinds)]
            prompts.append(prompt_of(kind, c * per_case + j, hidden, dtype=dtype))
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0,
                                         seed=seed0 + c * per_case + j, structured_outputs=so))
            meta.append((name, kind))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(name, kind, o.outputs[0]) for (name, kind), o in zip(meta, outs)]


def failures(results, eos_ids, special_ids) -> list[str]:
    """What is wrong with each result that is wrong: not finished by the grammar, failing its check, or
    holding a special token (EOS only as the last token)."""
    checks = {name: check for name, _, check in cases()}
    bad = []
    for name, kind, out in results:
        ids = out.token_ids
        inner = ids[:-1] if ids and ids[-1] in eos_ids else ids
        if out.finish_reason != "stop" or not checks[name](out.text) or set(inner) & special_ids:
            bad.append(f"{name}/{kind}: {out.finish_reason} {out.text!r} {ids}")
    return bad
