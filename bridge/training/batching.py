"""Examples -> one training batch: token ids, labels, encoder inputs, and every index the step
needs, computed on the CPU.

The prompt part goes through `tokenize_prompt` (the same function generation uses), the target
gets EOS; each sample is then a token sequence with a loss mask (True on the tokens the model
learns to produce), so the layout does not care how many prompt/target segments a sample has.
Samples are laid out one per padded row or packed several to a row (packing.py); labels are
-100 except on loss tokens. Encoder inputs are preprocessed on the CPU and collated per modality
in the order the rows will be scattered back.

Why the index tensors (`row_slots`, `target_pos`, `target_ids`, `target_weight`): the step must
have no data-dependent shapes on the device. Boolean-mask indexing, `masked_select` and
`int(mask.sum())` each make the host wait for the GPU (a sync mid-step); here the positions are
known on the host already, so the device only ever sees `index_copy` / `index_select` with
index tensors that arrived with the batch.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bridge.data.conversation import conversation_segments
from bridge.data.example import Example
from bridge.data.tokenize import (
    Span,
    TokenizedPrompt,
    tokenize_prompt,
    tokenize_segments,
    tokenize_target,
)
from bridge.training.packing import IGNORE, layout_tensors, packed_layout, padded_layout

__all__ = ["IGNORE", "TokenizedExample", "TrainBatch", "collate_examples", "tokenize_example"]


@dataclass
class TokenizedExample:
    """One sample as the LLM reads it: the whole sequence (prompt and targets; its spans say where
    encoder rows go) and the loss mask (True on each token the model is trained to produce)."""

    seq: TokenizedPrompt
    loss: list[bool]


def tokenize_example(tokenizer, ex: Example, num_rows: Mapping[str, Any]) -> TokenizedExample:
    """Prompt (placeholders expanded) then target + EOS; the loss covers the target tokens. A
    conversation (`ex.turns`) is rendered (conversation.py) and the loss covers every assistant
    turn, its end-of-turn token included, and nothing else."""
    if ex.turns:
        seq, loss = tokenize_segments(tokenizer, conversation_segments(tokenizer, ex), ex.media, num_rows)
        return TokenizedExample(seq, loss)
    tp = tokenize_prompt(tokenizer, ex.prompt, ex.media, num_rows)
    target = tokenize_target(tokenizer, ex.target)
    seq = TokenizedPrompt(
        tp.ids + target,
        tp.is_token + [True] * len(target),
        [Span(s.modality, s.item_index, s.start, s.length) for s in tp.spans],
    )
    return TokenizedExample(seq, [False] * len(tp.ids) + [True] * len(target))


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (R, L) long; placeholder ids at encoder positions, pad after
    is_token: torch.Tensor  # (R, L) bool; False where an encoder row goes
    attention_mask: torch.Tensor | None  # (R, L) long for padded rows; None when packed
    labels: torch.Tensor  # (R, L) long; IGNORE except target tokens
    prompts: list[TokenizedPrompt]  # per sample: the whole sequence (prompt and target)
    encoder_inputs: dict[str, Any]  # modality -> collated batch for that encoder
    first_item: dict[str, list[int]]  # modality -> index of each prompt's first item in the batch
    num_items: dict[str, int]
    # tower-output caching (train.cache_tower_outputs): every item's cache key, in batch order, and
    # the keys of the items that were preprocessed (not cached yet) in `encoder_inputs` order
    item_keys: dict[str, list[Any]] | None = None
    new_keys: dict[str, list[Any]] | None = None
    # host-computed indices (see the module docstring); flat positions index a (B * L, ...) view
    row_slots: torch.Tensor | None = None  # (R,) long; flat positions of encoder rows, row-major
    target_pos: torch.Tensor | None = None  # (N,) long; flat positions t whose next token is a target
    target_ids: torch.Tensor | None = None  # (N,) long; the target token predicted at target_pos
    target_weight: torch.Tensor | None = None  # (N,) float32; 1 / (targets of its sample * B)
    target_counts: list[int] | None = None  # loss tokens per sample, in sample (= target_pos) order
    # packed rows (see packing.py): positions restart per sample, attention stays inside a sample
    position_ids: torch.Tensor | None = None  # (R, L) long
    segment_ids: torch.Tensor | None = None  # (R, L) long; sample index, -1 on a row's padding tail
    cu_seqlens: torch.Tensor | None = None  # (S + 1,) int32; segment bounds in the flat R * L stream
    max_seqlen: int = 0  # longest segment
    #: bad rows passed over to build this batch (data.skip_bad_rows), "file:line: why" each
    skipped: tuple[str, ...] = ()

    TENSOR_FIELDS = (
        "input_ids",
        "is_token",
        "attention_mask",
        "labels",
        "row_slots",
        "target_pos",
        "target_ids",
        "target_weight",
        "position_ids",
        "segment_ids",
        "cu_seqlens",
    )

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of the batch, encoder inputs included."""
        for name in self.TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                yield value
        for batch in self.encoder_inputs.values():
            yield from _collated_tensors(batch)

    def pin_memory(self) -> TrainBatch:
        """Page-locked copies of every CPU tensor (what DataLoader(pin_memory=True) calls on a
        batch a worker sent), so the copy to the GPU can be asynchronous."""
        for name in self.TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _pin_collated(value))
        self.encoder_inputs = {m: _pin_collated(batch) for m, batch in self.encoder_inputs.items()}
        return self

    def to(self, device: torch.device) -> TrainBatch:
        """Move every tensor (encoder inputs included) to `device`: on a GPU from pinned memory
        with `non_blocking`, so the copies queue behind the step instead of stalling the host."""
        device = torch.device(device)
        for name in self.TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _to_device(value, device))
        self.encoder_inputs = {m: _move_collated(batch, device) for m, batch in self.encoder_inputs.items()}
        return self


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        if not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)
    return t.to(device)


def _move_collated(batch: Any, device: torch.device) -> Any:
    """An encoder's collated batch with its tensors on `device` (the encoder's own move is then a
    no-op); anything that is not a tensor (e.g. pieces-per-item lists) stays as it is."""
    if isinstance(batch, torch.Tensor):
        return _to_device(batch, device)
    if isinstance(batch, dict):
        return {k: _move_collated(v, device) for k, v in batch.items()}
    return batch


def _collated_tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _collated_tensors(value)


def _pin_collated(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory() if batch.device.type == "cpu" else batch
    if isinstance(batch, dict):
        return {k: _pin_collated(v) for k, v in batch.items()}
    return batch


def collate_examples(
    examples: Sequence[Example],
    tokenizer,
    encoders: Mapping[str, Any],
    keys: Sequence[Any] | None = None,
    cached: Container | None = None,
    *,
    pack: bool = False,
    pack_length: int | str | None = None,
) -> TrainBatch:
    """Build a TrainBatch. `keys[i]` identifies example i across epochs (its dataset index); items
    whose key `(modality, keys[i], j)` is in `cached` (the trainer's tower-output cache) are not
    preprocessed at all. `pack`: samples share rows of `pack_length` tokens (None: one row for
    the whole micro-batch; "longest": rows of the longest sample), see packing.py; else one
    padded row per sample."""
    if not examples:
        raise ValueError("collate_examples needs at least one example")
    num_rows = {m: enc.num_rows for m, enc in encoders.items()}
    prompts, seqs = [], []
    processed: dict[str, list[Any]] = {m: [] for m in encoders}
    first_item: dict[str, list[int]] = {m: [] for m in encoders}
    all_keys: dict[str, list[Any]] = {m: [] for m in encoders}
    new_keys: dict[str, list[Any]] = {m: [] for m in encoders}
    for i, ex in enumerate(examples):
        te = tokenize_example(tokenizer, ex, num_rows)
        prompts.append(te.seq)
        seqs.append((te.seq.ids, te.seq.is_token, te.loss))
        for m in encoders:
            first_item[m].append(len(all_keys[m]))
            for j, item in enumerate(ex.media.get(m, [])):
                key = None if keys is None else (m, keys[i], j)
                all_keys[m].append(key)
                if cached is not None and key in cached:
                    continue
                new_keys[m].append(key)
                processed[m].append(encoders[m].preprocess(item))
    lengths = [len(ids) for ids, _, _ in seqs]
    layout = packed_layout(lengths, pack_length) if pack else padded_layout(lengths)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tensors = layout_tensors(seqs, layout, pad)
    encoder_inputs = {m: encoders[m].collate(items) for m, items in processed.items() if items}
    return TrainBatch(
        tensors["input_ids"],
        tensors["is_token"],
        tensors["attention_mask"],
        tensors["labels"],
        prompts,
        encoder_inputs,
        first_item,
        {m: len(v) for m, v in all_keys.items()},
        item_keys=all_keys if cached is not None else None,
        new_keys=new_keys if cached is not None else None,
        row_slots=tensors["row_slots"],
        target_pos=tensors["target_pos"],
        target_ids=tensors["target_ids"],
        target_weight=tensors["target_weight"],
        target_counts=tensors["target_counts"],
        position_ids=tensors["position_ids"],
        segment_ids=tensors["segment_ids"],
        cu_seqlens=tensors["cu_seqlens"],
        max_seqlen=tensors["max_seqlen"],
        skipped=tuple(s for ex in examples for s in ex.skipped),
    )
