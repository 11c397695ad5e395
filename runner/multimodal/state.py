"""The runner's multimodal state: encoders, the encoder cache, and what each step needs from them.

Why a separate object: the model runner asks one question per step ("which encoder rows go
where in this step, and at which positions?") and should not know how media items, passthrough
tensors, realtime streams and M-RoPE grids answer it. `MultimodalState` owns:

- the registered encoders (anything meeting `EncoderProtocol`) and one `EncoderCache`;
- encoder-cache references: a request references its items' identifiers from admission to
  release (finish, abort or preemption), so a running request's rows are never evicted;
- the item table (`ItemTable`): per slot, the spans of the request's items whose rows are
  resident, gathered into `inputs_embeds` on the device by one launch per step;
- per step (`gather_step`), host work only for items a window reaches for the first time in this
  admission: `ensure` them (one batched `encode` per modality for whatever is missing, no
  encoder at all for passthrough items), then register them in the item table, once. Requests
  whose items are all registered, or behind their window, cost nothing; a step where no
  scheduled request has item positions ahead returns at once. Items only a realtime encoder
  streams into a live request (`append_feature`) join the same path and reach its decode steps;
- M-RoPE positions: `(3, T)` for steps with prefill windows, per-request decode deltas otherwise.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runner.multimodal.encoder_cache import (
    EncoderCache,
    MultiModalFeature,
    PlaceholderRange,
    make_feature,
    sort_features,
)
from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY, EncoderProtocol, check_encoders
from runner.multimodal.item_table import ItemTable
from runner.multimodal.mrope import compute_mrope_positions, mrope_positions_window
from runner.request import Request


@dataclass(eq=False)
class _RequestItems:
    """One admitted request's items: those not registered yet (offset order) and the registered
    spans' offsets and ends (for the host's overlap test)."""

    request: Request
    pending: deque = field(default_factory=deque)
    offsets: list = field(default_factory=list)
    ends: list = field(default_factory=list)

    def overlaps(self, start: int, end: int) -> bool:
        """Does a registered span meet positions `[start, end)`?"""
        i = bisect_right(self.ends, start)  # first span ending after `start`
        return i < len(self.ends) and self.offsets[i] < end

    def done_by(self, end: int) -> bool:
        """Nothing pending and every registered span behind position `end`."""
        return not self.pending and (not self.ends or self.ends[-1] <= end)


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
        max_num_seqs: int = 256,
        encode_alone: bool = False,
    ) -> None:
        self.hidden_size = hidden_size
        self.device = device
        self.uses_mrope = uses_mrope
        self.supports_realtime = supports_realtime
        self.encoders: dict[str, EncoderProtocol] = {}
        self.cache = EncoderCache(budget_tokens, hidden_size, dtype, device, encode_alone=encode_alone)
        self.items = ItemTable(max_num_seqs, hidden_size, dtype, device)
        self._requests: dict[str, _RequestItems] = {}  # admitted requests with items
        self._ahead: dict[str, _RequestItems] = {}  # ... of which some have item positions still ahead
        # Counters for tests and metrics.
        self.num_gathers = 0  # steps that gathered encoder rows
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
        """A request got a slot: reference its items; each is registered once a window reaches it."""
        if request.mm_features:
            self.cache.add_request_refs(request.request_id, (f.identifier for f in request.mm_features))
            rec = _RequestItems(request, deque(request.mm_features))
            self._requests[request.request_id] = self._ahead[request.request_id] = rec

    def remove_request(self, request: Request) -> None:
        """Before the slot goes back: its item spans go first, then the cache references."""
        rec = self._requests.pop(request.request_id, None)
        self._ahead.pop(request.request_id, None)
        if rec is not None and request.slot is not None:
            self.items.release(request.slot)
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
        if request.slot is not None:  # running: hold its rows from now on; gathered once reached
            self.cache.add_request_refs(request.request_id, [feature.identifier])
            rec = self._requests.get(request.request_id)
            if rec is None:
                rec = self._requests[request.request_id] = _RequestItems(request)
            rec.pending.append(feature)
            self._ahead[request.request_id] = rec
        return feature

    def has_pending_rows(self, requests: Sequence[Request]) -> bool:
        """Some request still has encoder rows at positions it has not fed yet (decode windows,
        which skip the gather, must then not run)."""
        return any(r.mm_features and r.mm_features[-1].placeholder.end > r.num_computed_tokens
                   for r in requests)

    # ----------------------------------------------------------------------------- per step
    def gather_step(self, requests: Sequence[Request], num_scheduled: Sequence[int]) -> ItemTable | None:
        """Prepare the step's item rows; the item table to `apply` after the token lookup, or None
        when no scheduled window meets an item.

        Host work only for requests with item positions ahead (`_ahead`): items a window reaches for
        the first time are made resident (`ensure`, one batched `encode` per modality) and registered
        in the item table; an `EncoderFailure` leaves everything as it was. Items wholly behind a
        window (a prefix-cache hit) are dropped unencoded; a request past its last item leaves `_ahead`.
        """
        if not self._ahead:
            return None
        hits: list[tuple[_RequestItems, int, int, int]] = []
        needed: list[MultiModalFeature] = []
        for req, n in zip(requests, num_scheduled):
            rec = self._ahead.get(req.request_id)
            if rec is None or n <= 0:
                continue
            nc = req.num_computed_tokens
            end = nc + n
            pending = rec.pending
            while pending and pending[0].placeholder.end <= nc:
                pending.popleft()  # behind the window: not needed in this admission
            k = 0
            while k < len(pending) and pending[k].placeholder.offset < end:
                needed.append(pending[k])
                k += 1
            hits.append((rec, nc, end, k))
        if needed:
            self.cache.ensure(needed, self.encoders)
        launch = past_prefill = False
        for rec, nc, end, k in hits:
            req = rec.request
            for _ in range(k):
                feature = rec.pending.popleft()
                ph = feature.placeholder
                rows = self.cache.get(feature.identifier)
                if rows is None:
                    raise RuntimeError(f"{feature.identifier} is not in the encoder cache after ensure()")
                self.items.register(req.slot, ph, rows)
                rec.offsets.append(ph.offset)
                rec.ends.append(ph.end)
            if rec.overlaps(nc, end):
                launch = True
                past_prefill = past_prefill or nc >= req.num_prompt_tokens
            if rec.done_by(end):
                del self._ahead[req.request_id]
        if not launch:
            return None
        self.num_gathers += 1
        self.num_decode_gathers += past_prefill
        return self.items

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
