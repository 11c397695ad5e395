"""Examples -> one padded training batch: token ids, is_token mask, labels, encoder inputs.

The prompt part goes through `tokenize_prompt` (the same function generation uses), the target
gets EOS, labels are -100 on the prompt and on padding. Encoder inputs are preprocessed on the
CPU and collated per modality in the order the rows will be scattered back.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
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

    def to(self, device: torch.device) -> TrainBatch:
        for name in ("input_ids", "is_token", "attention_mask", "labels"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        return self


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
    num_rows = {m: enc.num_rows for m, enc in encoders.items()}
    prompts, seqs, labels = [], [], []
    processed: dict[str, list[Any]] = {m: [] for m in encoders}
    first_item: dict[str, list[int]] = {m: [] for m in encoders}
    all_keys: dict[str, list[Any]] = {m: [] for m in encoders}
    new_keys: dict[str, list[Any]] = {m: [] for m in encoders}
    for i, ex in enumerate(examples):
        tp = tokenize_prompt(tokenizer, ex.prompt, ex.media, num_rows)
        target = tokenize_target(tokenizer, ex.target)
        prompts.append(tp)
        seqs.append((tp.ids + target, tp.is_token + [True] * len(target)))
        labels.append([IGNORE] * len(tp.ids) + target)
        for m in encoders:
            first_item[m].append(len(all_keys[m]))
            for j, item in enumerate(ex.media.get(m, [])):
                key = None if keys is None else (m, keys[i], j)
                all_keys[m].append(key)
                if cached is not None and key in cached:
                    continue
                new_keys[m].append(key)
                processed[m].append(encoders[m].preprocess(item))
    longest = max(len(ids) for ids, _ in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    b = len(seqs)
    input_ids = torch.full((b, longest), pad, dtype=torch.long)
    is_token = torch.ones((b, longest), dtype=torch.bool)
    attention = torch.zeros((b, longest), dtype=torch.long)
    label_t = torch.full((b, longest), IGNORE, dtype=torch.long)
    for i, ((ids, mask), lab) in enumerate(zip(seqs, labels)):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        is_token[i, :n] = torch.tensor(mask)
        attention[i, :n] = 1
        label_t[i, :n] = torch.tensor(lab)
    encoder_inputs = {m: encoders[m].collate(items) for m, items in processed.items() if items}
    return TrainBatch(
        input_ids,
        is_token,
        attention,
        label_t,
        prompts,
        encoder_inputs,
        first_item,
        {m: len(v) for m, v in all_keys.items()},
        item_keys=all_keys if cached is not None else None,
        new_keys=new_keys if cached is not None else None,
    )
