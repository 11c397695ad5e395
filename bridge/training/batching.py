"""Examples -> one padded training batch: token ids, labels, encoder inputs, and every index the
step needs, computed on the CPU.

The prompt part goes through `tokenize_prompt` (the same function generation uses), the target
gets EOS, labels are -100 on the prompt and on padding. Encoder inputs are preprocessed on the
CPU and collated per modality in the order the rows will be scattered back.

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

from bridge.data.example import Example
from bridge.data.tokenize import TokenizedPrompt, tokenize_prompt, tokenize_target

IGNORE = -100


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, L) long; placeholder ids at encoder positions, pad after
    is_token: torch.Tensor  # (B, L) bool; False where an encoder row goes
    attention_mask: torch.Tensor  # (B, L) long
    labels: torch.Tensor  # (B, L) long; IGNORE except target tokens
    prompts: list[TokenizedPrompt]
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

    TENSOR_FIELDS = (
        "input_ids",
        "is_token",
        "attention_mask",
        "labels",
        "row_slots",
        "target_pos",
        "target_ids",
        "target_weight",
    )

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
) -> TrainBatch:
    """Build a TrainBatch. `keys[i]` identifies example i across epochs (its dataset index); items
    whose key `(modality, keys[i], j)` is in `cached` (the trainer's tower-output cache) are not
    preprocessed at all."""
    if not examples:
        raise ValueError("collate_examples needs at least one example")
    num_rows = {m: enc.num_rows for m, enc in encoders.items()}
    prompts, seqs = [], []
    processed: dict[str, list[Any]] = {m: [] for m in encoders}
    first_item: dict[str, list[int]] = {m: [] for m in encoders}
    all_keys: dict[str, list[Any]] = {m: [] for m in encoders}
    new_keys: dict[str, list[Any]] = {m: [] for m in encoders}
    for i, ex in enumerate(examples):
        tp = tokenize_prompt(tokenizer, ex.prompt, ex.media, num_rows)
        target = tokenize_target(tokenizer, ex.target)
        prompts.append(tp)
        seqs.append((tp, target))
        for m in encoders:
            first_item[m].append(len(all_keys[m]))
            for j, item in enumerate(ex.media.get(m, [])):
                key = None if keys is None else (m, keys[i], j)
                all_keys[m].append(key)
                if cached is not None and key in cached:
                    continue
                new_keys[m].append(key)
                processed[m].append(encoders[m].preprocess(item))
    tensors = _pad_and_index(seqs, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
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
    )


def _pad_and_index(seqs: list[tuple[TokenizedPrompt, list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """Padded (B, L) tensors and the flat index tensors, built from Python lists in one go (one
    `torch.tensor` per output, not per example)."""
    b = len(seqs)
    longest = max(len(tp.ids) + len(target) for tp, target in seqs)
    ids_rows, token_rows, mask_rows, label_rows = [], [], [], []
    row_slots, target_pos, target_ids, target_weight = [], [], [], []
    for i, (tp, target) in enumerate(seqs):
        n_prompt, n = len(tp.ids), len(tp.ids) + len(target)
        fill = longest - n
        ids_rows.append(tp.ids + target + [pad] * fill)
        token_rows.append(tp.is_token + [True] * (len(target) + fill))
        mask_rows.append([1] * n + [0] * fill)
        label_rows.append([IGNORE] * n_prompt + target + [IGNORE] * fill)
        base = i * longest
        # spans in sequence order, positions within a span consecutive: row-major order, the
        # order ordered_rows() concatenates the encoder rows in
        row_slots.extend(base + t for t, is_tok in enumerate(tp.is_token) if not is_tok)
        # position t predicts token t + 1: the targets are predicted from n_prompt - 1 .. n - 2
        target_pos.extend(range(base + n_prompt - 1, base + n - 1))
        target_ids.extend(target)
        target_weight.extend([1.0 / (len(target) * b)] * len(target))
    return {
        "input_ids": torch.tensor(ids_rows, dtype=torch.long),
        "is_token": torch.tensor(token_rows, dtype=torch.bool),
        "attention_mask": torch.tensor(mask_rows, dtype=torch.long),
        "labels": torch.tensor(label_rows, dtype=torch.long),
        "row_slots": torch.tensor(row_slots, dtype=torch.long),
        "target_pos": torch.tensor(target_pos, dtype=torch.long),
        "target_ids": torch.tensor(target_ids, dtype=torch.long),
        "target_weight": torch.tensor(target_weight, dtype=torch.float32),
    }
