"""End-of-run evaluation: generate for held-out items through runner.LLM with prompt embeds
(via `Bridge`, the same path users call) and score exact match against the targets.

With `eval.structured_outputs` (a `StructuredOutputsParams` mapping: `{choice: [...]}`, `{json: schema}`,
`{regex: ...}`) generation is constrained, so a classification eval scores answers the model could
give rather than free text: a choice or regex answer is compared as text, a JSON answer as parsed JSON
(against the target parsed as JSON when it is, else against a JSON string's value). `valid` is the
fraction of outputs that are complete answers (a choice, a full regex match, JSON that parses); an
answer cut by `max_tokens` is neither valid nor a match.

eval.json keeps the first `num_samples` generations and every miss (target and output), so a
score below 1.0 can be read item by item, and under "engine" the settings its generations depend on
(`batch_invariant` among them: off, an item's output may change with the batch it was generated in)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bridge.api import Bridge
from bridge.atomic_files import write_text_atomic
from bridge.backends import LocalBackend
from bridge.data.conversation import example_prompt
from bridge.data.example import normalize_text
from runner.sampling_params import StructuredOutputsParams

_NOT_JSON = object()


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


class AnswerScorer:
    """Whether an output is a complete answer and whether it matches its target (see the module doc)."""

    def __init__(self, constraint: StructuredOutputsParams | None) -> None:
        self.constraint = constraint

    def valid(self, output: str) -> bool:
        c = self.constraint
        if c is None:
            return True
        if c.kind == "choice":
            return output in c.choice
        if c.kind == "regex":
            return re.fullmatch(c.regex, output) is not None
        if c.kind in ("json", "json_object"):
            return _json_value(output) is not _NOT_JSON
        return True  # a grammar: its end is the model's EOS, which the engine allowed only there

    def match(self, output: str, target: str) -> bool:
        c = self.constraint
        if c is None or c.kind not in ("json", "json_object"):
            return normalize_text(output) == normalize_text(target)
        got, want = _json_value(output), _json_value(target)
        if got is _NOT_JSON:
            return False
        if want is not _NOT_JSON:
            return got == want
        return isinstance(got, str) and normalize_text(got) == normalize_text(target)


def structured_outputs_of(eval_cfg: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The recipe's `eval.structured_outputs` (None when unset)."""
    value = eval_cfg.get("structured_outputs")
    if value is None:
        return None
    return StructuredOutputsParams(**value)


def evaluate_bridge(
    bridge, dataset, *, num_items: int, max_tokens: int, num_samples: int = 10, chunk: int = 256,
    structured_outputs: StructuredOutputsParams | None = None,
) -> dict[str, Any]:
    n = min(num_items, len(dataset))
    if n < 1:
        raise ValueError("the evaluation set is empty")
    examples = [dataset[i] for i in range(n)]
    # a conversation is generated from its turns before the last answer, rendered as in training
    prompts = [example_prompt(bridge.tokenizer, ex) for ex in examples]
    texts: list[str] = []
    extra = {} if structured_outputs is None else {"structured_outputs": structured_outputs}
    for start in range(0, n, chunk):
        part = examples[start : start + chunk]
        outs = bridge.generate(
            [{"prompt": p, **ex.media} for p, ex in zip(prompts[start : start + chunk], part)],
            max_tokens=max_tokens, temperature=0.0, **extra,
        )
        texts.extend(o.outputs[0].text for o in outs)
    scorer = AnswerScorer(structured_outputs)
    hits = [scorer.match(t, ex.target) for t, ex in zip(texts, examples)]
    samples = [
        {"prompt": p, "target": ex.target, "output": t, "match": h}
        for p, ex, t, h in list(zip(prompts, examples, texts, hits))[:num_samples]
    ]
    misses = [
        {"index": i, "prompt": p, "target": ex.target, "output": t}
        for i, (p, ex, t, h) in enumerate(zip(prompts, examples, texts, hits))
        if not h
    ]
    report = {
        "exact_match": sum(hits) / n,
        "n": n,
        "num_misses": len(misses),
        "samples": samples,
        "misses": misses,
    }
    if structured_outputs is not None:
        report["structured_outputs"] = structured_outputs.kind
        report["valid"] = sum(map(scorer.valid, texts)) / n
    return report


def engine_settings(bridge: Bridge, backend: Any = None) -> dict[str, Any]:
    """What the outputs of an evaluation depend on besides the checkpoint and the data: the engine
    settings that change a generation's arithmetic (`runner.config.EngineConfig.determinism_settings`,
    read from the local engine), or for a remote backend what was asked of it here (the server's own
    flags decide the rest)."""
    if backend is None and isinstance(bridge.backend, LocalBackend):
        return bridge.engine.engine_config.determinism_settings()
    return {"batch_invariant": bridge.batch_invariant, "dtype": bridge.dtype, "remote": True}


def evaluate_checkpoint(
    ckpt: str | Path,
    dataset,
    eval_cfg,
    device: torch.device,
    out_path: str | Path | None = None,
    backend: Any = None,
    verify: bool = True,
) -> dict[str, Any]:
    """`backend` (else the recipe's `eval.backend`): a vLLM-compatible server's URL to generate on;
    the encoders run here either way. `verify`: check the checkpoint against its manifest first."""
    backend = backend if backend is not None else eval_cfg.get("backend")
    bridge = Bridge.from_checkpoint(
        ckpt, device=device, enforce_eager=eval_cfg.enforce_eager, backend=backend, verify=verify,
        batch_invariant=eval_cfg.get("batch_invariant", False),
    )
    try:
        report = evaluate_bridge(
            bridge,
            dataset,
            num_items=eval_cfg.num_items,
            max_tokens=eval_cfg.max_tokens,
            num_samples=eval_cfg.num_samples,
            structured_outputs=structured_outputs_of(eval_cfg),
        )
    finally:
        if backend is not None:
            bridge.backend.close()
    report["checkpoint"] = str(ckpt)
    report["engine"] = engine_settings(bridge, backend)
    if backend is not None:
        report["backend"] = backend if isinstance(backend, str) else repr(backend)
    if out_path is not None:
        write_text_atomic(out_path, json.dumps(report, indent=2))
    return report
