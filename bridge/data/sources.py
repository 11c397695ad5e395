"""Recipe `data:` section -> (train, eval) datasets of Examples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from encoders.registry import resolve_reference


def build_datasets(data: Mapping[str, Any], seed: int) -> tuple[Any, Any]:
    """The training set and the held-out set named by a validated recipe's `data` section."""
    source = data["source"]
    options = dict(data.get("options") or {})
    if source == "jsonl":
        from bridge.data.jsonl import JsonlDataset

        if options:
            raise ValueError(f"data.options: the jsonl source takes no options, got {sorted(options)}")
        kw = dict(prompt=data["prompt"], target_field=data["target_field"], media_root=data.get("media_root"))
        train = JsonlDataset(data["train"], **kw)
        held_out = JsonlDataset(data["eval"], **kw) if data.get("eval") else None
        if held_out is not None:  # evaluated only after training: find a corrupt item now
            held_out.check_all_items()
        return train, held_out
    cls = _synthetic_class(source)
    try:
        train = cls(data["num_train"], seed=seed, split="train", prompt=data["prompt"], **options)
        held_out = cls(data["num_eval"], seed=seed, split="eval", prompt=data["prompt"], **options)
    except TypeError as exc:
        raise ValueError(f"data.options for source {source!r}: {exc}") from exc
    return train, held_out


def _synthetic_class(source: str):
    if ":" in source:  # "package.module:ClassName": a dataset class of the user's own
        return resolve_reference(source, "data.source")
    if source == "shapes":
        from bridge.data.synthetic_shapes import ShapesDataset

        return ShapesDataset
    if source == "tones":
        from bridge.data.synthetic_tones import TonesDataset

        return TonesDataset
    if source == "graphs":
        from bridge.data.synthetic_graphs import GraphsDataset

        return GraphsDataset
    raise ValueError(f"unknown data.source {source!r}")
