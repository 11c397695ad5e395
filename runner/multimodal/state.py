"""The runner's multimodal state: encoders, the encoder cache, and what each step needs from them.

Why a separate object: the model runner asks one question per step ("which encoder rows go
where in this step, and at which positions?") and should not know how media items, passthrough
tensors, realtime streams and M-RoPE grids answer it. `MultimodalState` owns:

- the registered encoders (anything meeting `EncoderProtocol`) and one `EncoderCache`;
- encoder-cache references: a request references its items' identifiers from admission to
  release (finish, abort or preemption), so a running request's rows are never evicted;
- per step: `ensure` the features the scheduled windows overlap (one batched `encode` per
  modality for whatever is missing, no encoder at all for passthrough items), then `gather`
  the rows in step-token order. Non-realtime engines skip decoding requests (the cache returns
  at once when every request decodes); with a realtime encoder registered every window is
  searched, so rows streamed into a live request (`append_feature`) reach its decode steps;
- M-RoPE positions: `(3, T)` for steps with prefill windows, per-request decode deltas otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from runner.engine.request import Request
from runner.multimodal.encoder_cache import (
    EncoderCache,
    GatheredEmbeds,
    MultiModalFeature,
    PlaceholderRange,
    RequestWindow,
    make_feature,
    sort_features,
)
from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY, EncoderProtocol, check_encoders
from runner.multimodal.mrope import compute_mrope_positions, mrope_positions_window


class MultimodalState:
    """Encoders + encoder cache + per-step gather and M-RoPE positions (see the module docstring)."""

    def __init__(
        self,
        encoders: Mapping[str, Any] | None,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_tokens: int,
        uses_mrope: bool = False,
        supports_realtime: bool = True,
    ) -> None:
        self.hidden_size = hidden_size
        self.device = device
        self.uses_mrope = uses_mrope
        self.supports_realtime = supports_realtime
        self.encoders: dict[str, EncoderProtocol] = {}
        self.cache = EncoderCache(budget_tokens, hidden_size, dtype, device)
        # Counters for tests and metrics.
        self.num_gathers = 0  # steps that scattered encoder rows
        self.num_decode_gathers = 0  # ... of which some rows went to a request past its prefill
        for encoder in check_encoders(encoders).values():
            self.register_encoder(encoder)

    # ----------------------------------------------------------------------------- encoders
    def register_encoder(self, encoder: EncoderProtocol) -> None:
        """Add (or replace) the encoder of `encoder.modality`."""
        modality = getattr(encoder, "modality", None)
        checked = check_encoders({modality: encoder})[modality]
        if checked.is_realtime and not self.supports_realtime:
            raise ValueError(f"realtime encoder for {modality!r} refused: this model state does not support "
                             "realtime (decode-step) embeddings")
        self.encoders[modality] = checked

    @property
    def realtime(self) -> bool:
        """Whether decode steps gather too (some registered encoder is realtime)."""
        return any(e.is_realtime for e in self.encoders.values())

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        if request.mm_features:
            self.cache.add_request_refs(request.request_id, (f.identifier for f in request.mm_features))

    def remove_request(self, request: Request) -> None:
        self.cache.release_request(request.request_id)

    def set_mrope_positions(self, request: Request, mrope_items: Sequence) -> None:
        if self.uses_mrope:
            request.mrope_positions, request.mrope_delta = compute_mrope_positions(
                request.num_prompt_tokens, mrope_items)

    def append_feature(self, request: Request, modality: str, item: Any) -> MultiModalFeature:
        """Stream an item of a realtime encoder into a live request.

        Its rows take the request's next positions that have no token yet (from `num_tokens`, or
        right after the previous streamed item): each decode step that feeds one of those positions
        feeds the streamed row instead of the sampled token's embedding. The sampled tokens stay
        the request's output.
        """
        encoder = self.encoders.get(modality)
        if modality == PROMPT_EMBEDS_MODALITY or encoder is None:
            raise ValueError(f"no realtime encoder registered for modality {modality!r}")
        if not encoder.is_realtime:
            raise ValueError(f"the encoder for {modality!r} is not realtime: streamed input needs an encoder "
                             "with is_realtime=True")
        n = encoder.num_rows(item)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"encoder for {modality!r} says the chunk has {n!r} rows; need an int >= 1")
        start = request.num_tokens
        if request.mm_features:
            start = max(start, request.mm_features[-1].placeholder.end)
        feature = make_feature(modality, item, PlaceholderRange(start, n), self.encoders)
        request.mm_features = sort_features([*request.mm_features, feature])
        if request.slot is not None:  # running: hold its rows from now on
            self.cache.add_request_refs(request.request_id, [feature.identifier])
        return feature

    def has_pending_rows(self, requests: Sequence[Request]) -> bool:
        """Some request still has encoder rows at positions it has not fed yet (decode windows,
        which skip the gather, must then not run)."""
        return any(r.mm_features and r.mm_features[-1].placeholder.end > r.num_computed_tokens
                   for r in requests)

    # ----------------------------------------------------------------------------- per step
    def gather_step(self, requests: Sequence[Request], num_scheduled: Sequence[int]) -> GatheredEmbeds | None:
        """Encoder rows of a step (None when it has none): ensure what the windows need, then gather."""
        if not any(r.mm_features for r in requests):
            return None
        realtime = self.realtime
        windows: list[RequestWindow] = []
        needed: list[MultiModalFeature] = []
        for req, n in zip(requests, num_scheduled):
            nc, prompt_len = req.num_computed_tokens, req.num_prompt_tokens
            windows.append(RequestWindow(req.mm_features, nc, n, prompt_len))
            if req.mm_features and (realtime or nc < prompt_len):
                end = nc + n
                needed.extend(f for f in req.mm_features
                              if f.placeholder.offset < end and f.placeholder.end > nc)
        if not needed:
            return None
        self.cache.ensure(needed, self.encoders)
        gathered = self.cache.gather(windows, realtime=realtime)
        if not gathered.has_embeds:
            return None
        self.num_gathers += 1
        start = 0
        for window in windows:  # did rows go to a request past its prefill?
            end = start + window.num_scheduled_tokens
            past_prefill = window.num_computed_tokens >= window.prompt_len
            if past_prefill and bool(gathered.is_mm_embed_cpu[start:end].any()):
                self.num_decode_gathers += 1
                break
            start = end
        return gathered

    def step_positions(self, requests: Sequence[Request], num_scheduled: Sequence[int]) -> torch.Tensor:
        """(3, T) int64 M-RoPE positions of a step, on the device."""
        pieces = []
        for req, n in zip(requests, num_scheduled):
            nc = req.num_computed_tokens
            if req.mrope_positions is None:
                pieces.append(torch.arange(nc, nc + n, dtype=torch.int64).expand(3, n))
            else:
                pieces.append(mrope_positions_window(req.mrope_positions, req.mrope_delta, nc, n))
        return torch.cat(pieces, dim=1).to(self.device, non_blocking=True)

    def decode_deltas(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """Per-request M-RoPE decode deltas (a decode position is `index + delta` in all three rows),
        or None when every delta is 0."""
        deltas = [req.mrope_delta for req in requests]
        if not any(deltas):
            return None
        return torch.tensor(deltas, dtype=torch.int64).to(self.device, non_blocking=True)


__all__ = ["MultimodalState"]
