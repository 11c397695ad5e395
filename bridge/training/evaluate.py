"""End-of-run evaluation: generate for held-out items through runner.LLM with prompt embeds
(via `Bridge`, the same path users call) and score exact match against the targets.

eval.json keeps the first `num_samples` generations and every miss (target and output), so a
score below 1.0 can be read item by item, and under "engine" the settings its generations depend on
(`batch_invariant` among them: off, an item's output may change with the batch it was generated in)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bridge.api import Bridge
from bridge.atomic_files import write_text_atomic
from bridge.backends import LocalBackend
from bridge.data.conversation import example_prompt
from bridge.data.example import normalize_text


def evaluate_bridge(
    bridge, dataset, *, num_items: int, max_tokens: int, num_samples: int = 10, chunk: int = 256
) -> dict[str, Any]:
    n = min(num_items, len(dataset))
    if n < 1:
        raise ValueError("the evaluation set is empty")
    examples = [dataset[i] for i in range(n)]
    # a conversation is generated from its turns before the last answer, rendered as in training
    prompts = [example_prompt(bridge.tokenizer, ex) for ex in examples]
    texts: list[str] = []
    for start in range(0, n, chunk):
        part = examples[start : start + chunk]
        outs = bridge.generate(
            [{"prompt": p, **ex.media} for p, ex in zip(prompts[start : start + chunk], part)],
            max_tokens=max_tokens, temperature=0.0,
        )
        texts.extend(o.outputs[0].text for o in outs)
    hits = [normalize_text(t) == normalize_text(ex.target) for t, ex in zip(texts, examples)]
    samples = [
        {"prompt": p, "target": ex.target, "output": t, "match": h}
        for p, ex, t, h in list(zip(prompts, examples, texts, hits))[:num_samples]
    ]
    misses = [
        {"index": i, "prompt": p, "target": ex.target, "output": t}
        for i, (p, ex, t, h) in enumerate(zip(prompts, examples, texts, hits))
        if not h
    ]
    return {
        "exact_match": sum(hits) / n,
        "n": n,
        "num_misses": len(misses),
        "samples": samples,
        "misses": misses,
    }


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
