"""Prompts with media: placeholder expansion and the features of one request.

A multimodal prompt is text (or token ids) holding one placeholder token per item, plus
`multi_modal_data = {modality: [item, ...]}`. Before anything runs, each placeholder expands to
the number of rows its item will produce (`encoder.num_rows(item)`, or the passthrough tensor's
row count), so the request's length, its KV blocks and its positions are final when it is
scheduled. Items are matched to placeholders of their modality in order; a count mismatch is a
`ValueError`.

The expanded prompt keeps the placeholder id at every item position (so prefix-cache keys and
penalties see a stable id) and marks those positions False in `is_token_ids`: assembly never
embeds them, penalties never count them, and the encoder-cache gather fills them.

Placeholder tokens: `<image>`, `<audio>`, `<graph>`, `<embeds>` (for the passthrough modality
"prompt_embeds"), or `<modality>` in general; an encoder may name its own with a `placeholder`
attribute. An encoder may also offer `grid_thw(item) -> (t, h, w)` (in LLM tokens, `t*h*w ==
num_rows`): on an M-RoPE model such items get 3-D positions; everything else is positioned as text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runner.multimodal.encoder_cache import MultiModalFeature, PlaceholderRange, make_feature, sort_features
from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY, EncoderProtocol
from runner.multimodal.mrope import MRopeItem

DEFAULT_PLACEHOLDERS = {"image": "<image>", "audio": "<audio>", "graph": "<graph>",
                        PROMPT_EMBEDS_MODALITY: "<embeds>"}


def placeholder_token(modality: str, encoder: Any = None) -> str:
    """The placeholder token text of a modality (an encoder's own `placeholder` wins)."""
    own = getattr(encoder, "placeholder", None)
    if isinstance(own, str) and own:
        return own
    return DEFAULT_PLACEHOLDERS.get(modality, f"<{modality}>")


@dataclass
class ExpandedPrompt:
    """A multimodal prompt after expansion: ids, the token mask, features (sorted), M-RoPE items."""

    token_ids: list[int]
    is_token_ids: torch.Tensor
    features: list[MultiModalFeature]
    mrope_items: list[MRopeItem] = field(default_factory=list)


def check_dense_tensor(tensor: torch.Tensor, where: str) -> None:
    """A caller's tensor must hold real, dense data: no sparse, nested or meta tensors (their
    operations raise NotImplementedError or RuntimeError deep inside torch)."""
    if tensor.is_nested:
        raise ValueError(f"{where} must be a dense tensor, got a nested tensor")
    if tensor.layout != torch.strided:
        raise ValueError(f"{where} must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.device.type == "meta":
        raise ValueError(f"{where} is a meta tensor: it has no data")


def fits_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A device bool: every value is finite and stays finite when cast to `dtype` (1e39 in float64
    is finite but becomes Inf in bfloat16). NaN compares False, so it fails too."""
    limit = torch.finfo(tensor.dtype).max
    if dtype is not None and dtype.is_floating_point:
        limit = min(limit, torch.finfo(dtype).max)
    return (tensor.abs() <= limit).all()


def check_passthrough_item(tensor: Any, hidden_size: int, where: str,
                           dtype: torch.dtype | None = None) -> None:
    """A "prompt_embeds" item must be a dense 2-D floating tensor of the model's hidden size whose
    values are finite in the model dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{where}: a prompt_embeds item must be a torch.Tensor, got {type(tensor).__name__}")
    check_dense_tensor(tensor, f"{where}: a prompt_embeds item")
    if tensor.dim() != 2 or not tensor.is_floating_point():
        raise ValueError(f"{where}: a prompt_embeds item must be a 2-D floating tensor, got "
                         f"{tensor.dtype} of shape {tuple(tensor.shape)}")
    if tensor.shape[0] == 0 or tensor.shape[1] != hidden_size:
        raise ValueError(f"{where}: a prompt_embeds item must be (n >= 1, hidden={hidden_size}), got "
                         f"{tuple(tensor.shape)}")
    if not bool(fits_dtype(tensor, dtype)):
        raise ValueError(f"{where}: a prompt_embeds item contains NaN or Inf (or values beyond the range of "
                         f"the model dtype {dtype})")


def item_num_rows(modality: str, item: Any, encoders: Mapping[str, EncoderProtocol], hidden_size: int,
                  where: str, dtype: torch.dtype | None = None) -> int:
    if modality == PROMPT_EMBEDS_MODALITY:
        check_passthrough_item(item, hidden_size, where, dtype)
        return int(item.shape[0])
    encoder = encoders.get(modality)
    if encoder is None:
        raise ValueError(f"{where}: no encoder registered for modality {modality!r} (pass "
                         "LLM(..., encoders={...}) or call llm.register_encoder)")
    n = encoder.num_rows(item)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: encoder for {modality!r} says the item has {n!r} rows; need an int >= 1")
    return n


def item_grid(modality: str, item: Any, encoders: Mapping[str, EncoderProtocol], num_rows: int,
              where: str) -> tuple[int, int, int] | None:
    """(t, h, w) in LLM tokens from the encoder's optional `grid_thw(item)`, checked against the rows."""
    encoder = encoders.get(modality)
    grid_fn = getattr(encoder, "grid_thw", None)
    if modality == PROMPT_EMBEDS_MODALITY or not callable(grid_fn):
        return None
    grid = grid_fn(item)
    if grid is None:
        return None
    t, h, w = (int(v) for v in grid)
    if t * h * w != num_rows:
        raise ValueError(f"{where}: grid_thw {(t, h, w)} has {t * h * w} cells, the item {num_rows} rows")
    return t, h, w


def expand_mm_prompt(
    token_ids: Sequence[int],
    mm_data: Mapping[str, Any],
    placeholder_ids: Mapping[str, int],
    encoders: Mapping[str, EncoderProtocol],
    hidden_size: int,
    *,
    where: str = "prompt",
    placeholder_positions: Sequence[tuple[int, str]] | None = None,
    dtype: torch.dtype | None = None,
) -> ExpandedPrompt:
    """Expand every placeholder of `token_ids` to its item's rows; build the features.

    Placeholders are found by id (`placeholder_ids[modality]` is the id of the modality's
    placeholder token) or, for text split at placeholder strings
    (`runner.multimodal.prompt_text.split_at_placeholders`), given as `placeholder_positions`
    [(position, modality)]. Items of a modality are matched to its placeholders in order. Raises
    `ValueError` for an unknown modality, a count mismatch, or a bad item.
    """
    if not isinstance(mm_data, Mapping):
        raise ValueError(f"{where}: multi_modal_data must be a dict {{modality: [items]}}")
    items: dict[str, list[Any]] = {}
    for modality, value in mm_data.items():
        if modality not in placeholder_ids:
            raise ValueError(f"{where}: modality {modality!r} has no encoder and no placeholder token; "
                             f"known: {sorted(placeholder_ids)}")
        seq = list(value) if isinstance(value, list | tuple) else [value]
        items[modality] = seq
    if placeholder_positions is None:
        modality_of_id = {pid: m for m, pid in placeholder_ids.items() if m in items}
        modality_at = [modality_of_id.get(t) for t in token_ids]
    else:
        modality_at = [None] * len(token_ids)
        for pos, m in placeholder_positions:
            modality_at[pos] = m
    counts = {m: 0 for m in items}
    for m in modality_at:
        if m is not None:
            if m not in counts:
                raise ValueError(f"{where}: a {m!r} placeholder but no {m!r} items in multi_modal_data")
            counts[m] += 1
    for modality, seq in items.items():
        if counts[modality] != len(seq):
            raise ValueError(f"{where}: {counts[modality]} placeholder(s) for modality {modality!r} but "
                             f"{len(seq)} item(s) in multi_modal_data")

    out_ids: list[int] = []
    mask: list[bool] = []
    features: list[MultiModalFeature] = []
    mrope_items: list[MRopeItem] = []
    used = {m: 0 for m in items}
    for t, m in zip(token_ids, modality_at):
        if m is None:
            out_ids.append(int(t))
            mask.append(True)
            continue
        item = items[m][used[m]]
        item_where = f"{where}: {m} item {used[m]}"
        used[m] += 1
        offset = len(out_ids)
        try:  # num_rows, content_hash and grid_thw are the encoder's own code: any error names the item
            n = item_num_rows(m, item, encoders, hidden_size, item_where, dtype)
            features.append(make_feature(m, item, PlaceholderRange(offset, n), encoders))
            mrope_items.append(MRopeItem(offset, n, item_grid(m, item, encoders, n, item_where)))
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - a user's encoder may raise anything
            raise ValueError(f"{item_where}: the {m} encoder failed on it: {type(err).__name__}: "
                             f"{str(err)[:200]}") from None
        out_ids.extend([int(t)] * n)
        mask.extend([False] * n)
    return ExpandedPrompt(out_ids, torch.tensor(mask, dtype=torch.bool), sort_features(features), mrope_items)


__all__ = ["DEFAULT_PLACEHOLDERS", "ExpandedPrompt", "check_passthrough_item", "expand_mm_prompt",
           "placeholder_token"]
