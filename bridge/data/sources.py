"""Recipe `data:` section -> (train, eval) datasets of Examples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bridge.data.bad_rows import SkipBadRows
from encoders.registry import resolve_reference

FILE_SOURCES = ("jsonl", "llava", "hf", "webdataset")


def build_datasets(data: Mapping[str, Any], seed: int) -> tuple[Any, Any]:
    """The training set and the held-out set named by a validated recipe's `data` section. With
    `data.skip_bad_rows` the sets leave out the malformed rows they find (each names them in
    `skipped`) and the training set passes over a row that fails only when read (bad_rows.py)."""
    source = data["source"]
    options = dict(data.get("options") or {})
    if source in FILE_SOURCES:
        if options:
            raise ValueError(f"data.options: the {source} source takes no options, got {sorted(options)}")
        skip = bool(data.get("skip_bad_rows"))
        make = _file_source(source, data, skip)
        train = make(data["train"])
        held_out = make(data["eval"]) if data.get("eval") else None
        if held_out is not None:  # evaluated only after training: find a corrupt item now
            held_out.check_all_items()
        return (SkipBadRows(train) if skip else train), held_out
    cls = _synthetic_class(source)
    try:
        train = cls(data["num_train"], seed=seed, split="train", prompt=data["prompt"], **options)
        held_out = cls(data["num_eval"], seed=seed, split="eval", prompt=data["prompt"], **options)
    except TypeError as exc:
        raise ValueError(f"data.options for source {source!r}: {exc}") from exc
    return train, held_out


def _file_source(source: str, data: Mapping[str, Any], skip: bool):
    """path -> the data set of `source` over that file (or pattern)."""
    prompt = data.get("prompt") or ("{value}" if source == "llava" else "<image>")
    common = dict(media_root=data.get("media_root"), skip_bad_rows=skip)
    if source == "jsonl":
        from bridge.data.jsonl import JsonlDataset

        return lambda path: JsonlDataset(path, prompt=prompt, target_field=data["target_field"], **common)
    if source == "llava":
        from bridge.data.llava import LlavaDataset

        return lambda path: LlavaDataset(path, prompt=prompt, **common)
    if source == "hf":
        from bridge.data.hf import HFDataset

        return lambda path: HFDataset(path, prompt=prompt, target_field=data["target_field"],
                                      columns=data.get("columns") or {}, **common)
    from bridge.data.tar_shards import ShardDataset

    return lambda path: ShardDataset(path, prompt=prompt, target_field=data["target_field"],
                                     columns=data.get("columns") or {}, **common)


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
