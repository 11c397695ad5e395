"""The trainable joint: encoders + a Hugging Face causal LM, computing the caption loss.

Why not `llm(inputs_embeds=..., labels=...)`: that computes logits over the whole vocabulary at
every position, prompt included. Here the decoder runs once and the LM head is applied only at
the positions that predict a target token, which is most of the step's cost saved for a 150k
vocabulary. The loss is the per-sample mean token cross-entropy averaged over samples, so a
batch split across ranks (DDP averages per-rank means) gives the same loss and gradients as
the whole batch on one rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bridge.data.prompt_embeds import ordered_rows, scatter_rows
from bridge.training.batching import IGNORE, TrainBatch


class BridgeModel(nn.Module):
    def __init__(self, encoders: dict[str, nn.Module], llm: nn.Module):
        super().__init__()
        self.encoders = nn.ModuleDict(encoders)
        self.llm = llm
        #: frozen-tower outputs by item key (train.cache_tower_outputs); None = no caching
        self.tower_cache: dict | None = None

    def encoder_rows(self, modality: str, batch: TrainBatch) -> list[torch.Tensor]:
        """Rows of every item of `modality` in the batch. With the tower cache on, only items seen
        for the first time run the (frozen) tower; every item runs the projector."""
        enc = self.encoders[modality]
        if self.tower_cache is None or batch.item_keys is None:
            return enc(batch.encoder_inputs[modality])
        if modality in batch.encoder_inputs:
            with torch.no_grad():
                fresh = enc.tower_rows(batch.encoder_inputs[modality])
            for key, feats in zip(batch.new_keys[modality], fresh):
                self.tower_cache[key] = feats.detach()
        return enc.project_rows([self.tower_cache[k] for k in batch.item_keys[modality]])

    def input_embeds(self, batch: TrainBatch) -> torch.Tensor:
        embed = self.llm.get_input_embeddings()
        safe_ids = batch.input_ids.masked_fill(~batch.is_token, 0)
        token_embeds = embed(safe_ids)
        rows_by_modality = {m: self.encoder_rows(m, batch) for m, n in batch.num_items.items() if n}
        rows = ordered_rows(batch.prompts, rows_by_modality, batch.first_item)
        return scatter_rows(token_embeds, batch.is_token, rows)

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        embeds = self.input_embeds(batch)
        decoder = self.llm.get_decoder()
        hidden = decoder(inputs_embeds=embeds, attention_mask=batch.attention_mask, use_cache=False)
        hidden = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
        # position t predicts token t + 1
        targets = batch.labels[:, 1:]
        where = targets != IGNORE
        picked = hidden[:, :-1][where]
        logits = self.llm.get_output_embeddings()(picked).float()
        token_loss = F.cross_entropy(logits, targets[where], reduction="none")
        sample_of = torch.arange(targets.shape[0], device=targets.device)[:, None].expand_as(targets)[where]
        per_sample = torch.zeros(targets.shape[0], device=token_loss.device).index_add_(
            0, sample_of, token_loss
        )
        counts = where.sum(dim=1).clamp(min=1)
        return (per_sample / counts).mean()
