"""The trainable joint: encoders + a Hugging Face causal LM, computing the caption loss.

Why not `llm(inputs_embeds=..., labels=...)`: that computes logits over the whole vocabulary at
every position, prompt included. Here the decoder runs once, the hidden states of the positions
that predict a target token are gathered, and the LM head and cross-entropy run fused over those
rows only (loss_head.py: chunk by chunk, no logits kept for the backward). The loss is the
per-sample mean token cross-entropy averaged over samples, so a batch split across ranks (DDP
averages per-rank means) gives the same loss and gradients as the whole batch on one rank.

A frozen tower runs under `inference_mode` (no autograd records, no saved activations; under
bf16 autocast its matmuls are bf16); its features are cloned into ordinary tensors for the
trained projector. Packed batches (several samples per row) reach the decoder with restarting
positions and sample boundaries (packed_attention.py).

No host syncs in the step: where the encoder rows go and which positions predict targets come
as index tensors from the collate (bridge/training/batching.py), so the device sees only
`index_copy` / `index_select` and the host never waits for a data-dependent shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bridge.data.prompt_embeds import ordered_rows
from bridge.training.batching import TrainBatch
from bridge.training.loss_head import fused_linear_cross_entropy, plain_linear_cross_entropy
from bridge.training.packed_attention import decoder_kwargs


class BridgeModel(nn.Module):
    def __init__(self, encoders: dict[str, nn.Module], llm: nn.Module):
        super().__init__()
        self.encoders = nn.ModuleDict(encoders)
        self.llm = llm
        #: frozen-tower outputs by item key (train.cache_tower_outputs); None = no caching
        self.tower_cache: dict | None = None
        #: how packed batches keep samples apart (packed_attention.MODES); set with use_mode()
        self.attention_mode = "sdpa"
        #: LM head + cross-entropy fused and chunked (loss_head.py); False: the plain reference
        self.fused_loss = True
        self.sliding_window = getattr(getattr(llm, "config", None), "sliding_window", None)

    def encoder_rows(self, modality: str, batch: TrainBatch) -> list[torch.Tensor]:
        """Rows of every item of `modality` in the batch. With the tower cache on, only items seen
        for the first time run the (frozen) tower; every item runs the projector."""
        enc = self.encoders[modality]
        if self.tower_cache is None or batch.item_keys is None:
            inputs = batch.encoder_inputs[modality]
            if any(p.requires_grad for p in enc.tower.parameters()):
                return enc(inputs)
            with torch.inference_mode():
                feats, lengths = enc.tower_features(inputs)
            feats = feats.clone()  # an ordinary tensor: the projector saves it for its backward
            lengths = lengths.clone() if lengths is not None else None
            out, lengths = enc.projector(feats, lengths)
            return enc._split(out, lengths, inputs.get("_pieces_per_item"))
        if modality in batch.encoder_inputs:
            with torch.no_grad():
                fresh = enc.tower_rows(batch.encoder_inputs[modality])
            for key, feats in zip(batch.new_keys[modality], fresh):
                self.tower_cache[key] = feats.detach()
        return enc.project_rows([self.tower_cache[k] for k in batch.item_keys[modality]])

    def input_embeds(self, batch: TrainBatch) -> torch.Tensor:
        """(B, L, H): token embeddings, with the encoder rows copied in at `batch.row_slots`
        (differentiable with respect to the rows)."""
        embed = self.llm.get_input_embeddings()
        safe_ids = batch.input_ids.masked_fill(~batch.is_token, 0)
        token_embeds = embed(safe_ids)
        rows_by_modality = {m: self.encoder_rows(m, batch) for m, n in batch.num_items.items() if n}
        rows = ordered_rows(batch.prompts, rows_by_modality, batch.first_item)
        if not rows:
            return token_embeds
        source = torch.cat(rows, dim=0).to(token_embeds.dtype)
        slots = batch.row_slots
        if slots is None or slots.shape[0] != source.shape[0]:  # shapes only: no device sync
            have = "no" if slots is None else slots.shape[0]
            raise ValueError(f"{have} placeholder positions but {source.shape[0]} encoder rows")
        b, length, hidden = token_embeds.shape
        flat = token_embeds.reshape(b * length, hidden).index_copy(0, slots, source)
        return flat.view(b, length, hidden)

    def target_hidden(self, batch: TrainBatch) -> torch.Tensor:
        """(N, H): the decoder's last hidden state at each position that predicts a target."""
        embeds = self.input_embeds(batch)
        decoder = self.llm.get_decoder()
        kwargs = decoder_kwargs(batch, self.attention_mode, self.sliding_window)
        hidden = decoder(inputs_embeds=embeds, use_cache=False, **kwargs)
        hidden = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
        # position t predicts token t + 1; target_pos lists those t (flat over R * L)
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.target_pos)

    def token_losses(self, batch: TrainBatch) -> torch.Tensor:
        """(N,) fp32 cross-entropy of every target token, in target_pos order (per sample:
        `batch.target_counts` of them)."""
        logits = self.llm.get_output_embeddings()(self.target_hidden(batch)).float()
        return F.cross_entropy(logits, batch.target_ids, reduction="none")

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        picked = self.target_hidden(batch)
        head = self.llm.get_output_embeddings()
        bias = getattr(head, "bias", None)
        # target_weight = 1 / (targets of the sample * B): the mean over samples of per-sample means
        loss_fn = fused_linear_cross_entropy if self.fused_loss else plain_linear_cross_entropy
        return loss_fn(picked, head.weight, bias, batch.target_ids, batch.target_weight)
