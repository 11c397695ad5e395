"""Encoder outputs cached by content, and the per-step gather of the rows a batch needs.

Why a cache: a media item's encoder output is needed for every chunk of its prompt that
chunked prefill schedules, and the same item (a system image, a repeated clip, a reused
prompt-embeds tensor) recurs across requests. Encoding once per content hash and serving rows
from device memory keeps the encoder off the per-step path.

Vocabulary (the same as vLLM's, on purpose):

- `PlaceholderRange(offset, length, is_embed)`: the prompt positions an item occupies.
  `is_embed` marks which of those positions take an encoder row (a placeholder may also hold
  positions that stay ordinary tokens, e.g. image-break tokens); None means all of them.
  The encoder output of an item is compact: `num_embeds` rows, one per True in `is_embed`.
- `MultiModalFeature(identifier, modality, placeholder, item)`: one item of one request.
  `identifier` is `"<modality>:<content hash>"`.
- `"prompt_embeds"` is the passthrough modality: the item is the tensor itself; it is moved to
  the cache's device and dtype once and no encoder runs.

The engine gathers item rows on the device (`runner.multimodal.item_table.ItemTable`, fed from
`get`). `gather` below is the host formulation of the same contract, kept as its reference: it
maps each request's scheduled window `[nc, nc + num_scheduled)` onto the features it overlaps
(found by bisect over features sorted by offset) and the window's slice of each placeholder onto
encoder-output rows through the cumulative sum of `is_embed`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY, EncoderProtocol, tensor_content_hash


@dataclass(frozen=True, eq=False)
class PlaceholderRange:
    """Prompt positions `[offset, offset + length)` held by one item; `is_embed` bool over them.

    `is_embed` is kept on the host (the gather does its index arithmetic there); None means
    every position takes an encoder row.
    """

    offset: int
    length: int
    is_embed: torch.Tensor | None = None
    # Host list: _embeds_cumsum[i] = number of embed positions in [0, i]. None when all embed.
    _embeds_cumsum: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"PlaceholderRange needs offset >= 0 and length > 0, got offset={self.offset}, "
                f"length={self.length}"
            )
        if self.is_embed is None:
            return
        mask = torch.as_tensor(self.is_embed).detach().to("cpu")
        if mask.dtype != torch.bool or mask.dim() != 1 or mask.numel() != self.length:
            raise ValueError(
                f"is_embed must be a 1-D bool tensor of the placeholder length {self.length}, got "
                f"dtype {mask.dtype}, shape {tuple(mask.shape)}"
            )
        cumsum = torch.cumsum(mask, 0, dtype=torch.int64).tolist()
        if cumsum[-1] == 0:
            raise ValueError("is_embed has no True position: the placeholder would take no encoder row")
        object.__setattr__(self, "is_embed", mask.contiguous())
        object.__setattr__(self, "_embeds_cumsum", cumsum)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Encoder-output rows this placeholder takes (the item's `num_rows`)."""
        return self.length if self._embeds_cumsum is None else self._embeds_cumsum[-1]

    def embeds_range(self, start_idx: int, end_idx: int) -> tuple[int, int]:
        """Encoder-output rows `[r0, r1)` behind placeholder positions `[start_idx, end_idx)`.

        Positions are relative to `offset`. Example: offset 2, length 5, is_embed
        [F, T, F, T, T]; positions [3, 5) hold the 2nd and 3rd embeds -> rows (1, 3).
        """
        if not 0 <= start_idx <= end_idx <= self.length:
            raise ValueError(
                f"range [{start_idx}, {end_idx}) is outside the placeholder length {self.length}"
            )
        cumsum = self._embeds_cumsum
        if cumsum is None:
            return start_idx, end_idx
        r0 = cumsum[start_idx - 1] if start_idx > 0 else 0
        r1 = cumsum[end_idx - 1] if end_idx > 0 else 0
        return r0, r1


@dataclass(eq=False)
class MultiModalFeature:
    """One item of one request: where it sits in the prompt and how to get its rows.

    `item` is what the encoder takes (the tensor itself for "prompt_embeds"); it may be set to
    None once the cache holds the identifier, since a referenced entry is never evicted.
    """

    identifier: str
    modality: str
    placeholder: PlaceholderRange
    item: Any = None


def feature_identifier(
    modality: str, item: Any, encoders: Mapping[str, EncoderProtocol] | None = None
) -> str:
    """`"<modality>:<content hash>"`: the cache key. Passthrough tensors hash their bytes;
    other items use their encoder's `content_hash`. The modality prefix keeps two modalities
    whose hashes happen to agree apart."""
    if modality == PROMPT_EMBEDS_MODALITY:
        return f"{modality}:{tensor_content_hash(item)}"
    encoder = (encoders or {}).get(modality)
    if encoder is None:
        raise ValueError(f"no encoder registered for modality {modality!r}")
    return f"{modality}:{encoder.content_hash(item)}"


def make_feature(
    modality: str,
    item: Any,
    placeholder: PlaceholderRange,
    encoders: Mapping[str, EncoderProtocol] | None = None,
) -> MultiModalFeature:
    """Build a feature with its content-hash identifier (see `feature_identifier`)."""
    return MultiModalFeature(feature_identifier(modality, item, encoders), modality, placeholder, item)


def sort_features(features: Iterable[MultiModalFeature]) -> list[MultiModalFeature]:
    """Sort a request's features by offset and check that no two placeholders overlap.

    The gather bisects over this order, so do it once when the request is added (and again
    when a realtime request appends a feature), not per step.
    """
    ordered = sorted(features, key=lambda f: f.placeholder.offset)
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.placeholder.offset < prev.placeholder.end:
            raise ValueError(
                f"placeholders overlap: {prev.identifier} at [{prev.placeholder.offset}, "
                f"{prev.placeholder.end}) and {cur.identifier} at [{cur.placeholder.offset}, "
                f"{cur.placeholder.end})"
            )
    return ordered


@dataclass
class RequestWindow:
    """What the gather needs of one scheduled request (built by the engine each step).

    `features` sorted by offset and non-overlapping (`sort_features`); the request's tokens of
    this step are prompt/sequence positions `[num_computed_tokens, num_computed_tokens +
    num_scheduled_tokens)`; `prompt_len` tells prefill (nc < prompt_len) from decode.
    """

    features: Sequence[MultiModalFeature]
    num_computed_tokens: int
    num_scheduled_tokens: int
    prompt_len: int


@dataclass
class GatheredEmbeds:
    """A step's encoder rows in step-token order, and where they go.

    `mm_embeds` (k, hidden) and `is_mm_embed` (num_tokens,) bool are on the cache device and
    satisfy `is_mm_embed.sum() == k`; `is_mm_embed_cpu` is the same mask on the host (for
    M-RoPE, penalties and prefix hashing without a device read). All three are None when the
    step has no encoder rows (`has_embeds` False): assembly then skips the scatter.
    """

    mm_embeds: torch.Tensor | None = None
    is_mm_embed: torch.Tensor | None = None
    is_mm_embed_cpu: torch.Tensor | None = None

    @property
    def has_embeds(self) -> bool:
        return self.mm_embeds is not None


def _offset_of(feature: MultiModalFeature) -> int:
    return feature.placeholder.offset


class EncoderFailure(ValueError):
    """Encoding failed for some items: `failed` maps each item's identifier to what went wrong.

    Raised by `EncoderCache.ensure` after the items that did encode were cached; the engine fails
    the requests that hold the bad items and runs the others on.
    """

    def __init__(self, failed: Mapping[str, str]) -> None:
        self.failed = dict(failed)
        first = next(iter(self.failed.items()))
        super().__init__(f"{len(self.failed)} item(s) failed to encode; {first[0][:80]}: {first[1]}")


class EncoderCache:
    """Device-resident encoder outputs keyed by identifier, with a row budget and LRU eviction.

    Only entries that no running request references are evicted: an entry referenced through
    `add_request_refs` stays until every referencing request is released. The budget is
    enforced against unreferenced entries; a working set of referenced entries larger than the
    budget is kept (correctness first) and counted in `num_over_budget_inserts`. The engine
    keeps the working set bounded at admission with `fits` and `check_item_rows`.

    Counters for tests and metrics: `num_uploads` (passthrough tensors stored),
    `num_encoder_calls` (batched `encode` calls), `num_encoded_items`, `num_evictions`,
    `num_over_budget_inserts`.
    """

    def __init__(
        self,
        budget_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        encode_alone: bool = False,
    ) -> None:
        """`encode_alone` (`EngineConfig.batch_invariant`): one `encode` call per item, so an item's rows
        never depend on the items encoded beside it (an encoder's own kernels pick by batch size too)."""
        if budget_tokens <= 0:
            raise ValueError(f"encoder cache budget must be positive, got {budget_tokens}")
        self.budget_tokens = int(budget_tokens)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.device = torch.device(device)
        self.encode_alone = encode_alone
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # LRU order: oldest first
        self._refcount: dict[str, int] = {}
        self._request_refs: dict[str, set[str]] = {}
        self.num_cached_tokens = 0
        self.num_uploads = 0
        self.num_encoder_calls = 0
        self.num_encoded_items = 0
        self.num_evictions = 0
        self.num_over_budget_inserts = 0

    # ---- lookup -------------------------------------------------------------------------

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, identifier: str) -> torch.Tensor | None:
        """The cached rows of an identifier (marks it recently used), or None."""
        rows = self._entries.get(identifier)
        if rows is not None:
            self._entries.move_to_end(identifier)
        return rows

    # ---- references ---------------------------------------------------------------------

    def add_request_refs(self, req_id: str, identifiers: Iterable[str]) -> None:
        """Record that request `req_id` needs these identifiers (additive; a repeated identifier
        in one request counts once). Identifiers need not be cached yet."""
        refs = self._request_refs.setdefault(req_id, set())
        for identifier in identifiers:
            if identifier not in refs:
                refs.add(identifier)
                self._refcount[identifier] = self._refcount.get(identifier, 0) + 1

    def release_request(self, req_id: str, identifiers: Iterable[str] | None = None) -> None:
        """Drop `req_id`'s references (all, or only `identifiers`). Entries stay cached and
        become evictable when no other request references them. Unknown ids are ignored, so
        releasing twice is safe."""
        refs = self._request_refs.get(req_id)
        if refs is None:
            return
        to_drop = set(refs) if identifiers is None else refs.intersection(identifiers)
        for identifier in to_drop:
            refs.discard(identifier)
            count = self._refcount[identifier] - 1
            if count:
                self._refcount[identifier] = count
            else:
                del self._refcount[identifier]
        if not refs:
            del self._request_refs[req_id]

    def is_referenced(self, identifier: str) -> bool:
        return identifier in self._refcount

    # ---- budget -------------------------------------------------------------------------

    @property
    def num_evictable_tokens(self) -> int:
        return sum(rows.shape[0] for ident, rows in self._entries.items() if ident not in self._refcount)

    def fits(self, num_rows: int) -> bool:
        """Would `num_rows` new rows fit within the budget after evicting every unreferenced
        entry? For admission control in the scheduler."""
        return self.num_cached_tokens - self.num_evictable_tokens + num_rows <= self.budget_tokens

    def check_item_rows(self, num_rows: int) -> None:
        """ValueError when one item alone is larger than the whole budget (it could never be
        cached within it); call when a request is added."""
        if num_rows > self.budget_tokens:
            raise ValueError(
                f"an item of {num_rows} rows exceeds the encoder cache budget of {self.budget_tokens} "
                "tokens; raise the budget or shrink the item"
            )

    def _make_room(self, num_rows: int, pinned: set[str]) -> None:
        if self.num_cached_tokens + num_rows <= self.budget_tokens:
            return
        for identifier in list(self._entries):  # oldest first
            if identifier in self._refcount or identifier in pinned:
                continue
            self.num_cached_tokens -= self._entries.pop(identifier).shape[0]
            self.num_evictions += 1
            if self.num_cached_tokens + num_rows <= self.budget_tokens:
                return
        self.num_over_budget_inserts += 1

    def _insert(self, identifier: str, rows: torch.Tensor, pinned: set[str]) -> None:
        self._make_room(rows.shape[0], pinned)
        self._entries[identifier] = rows
        self.num_cached_tokens += rows.shape[0]

    def evict_unreferenced(self) -> None:
        """Free every entry that no request references."""
        for identifier in [i for i in self._entries if i not in self._refcount]:
            self.num_cached_tokens -= self._entries.pop(identifier).shape[0]
            self.num_evictions += 1

    # ---- filling ------------------------------------------------------------------------

    def _check_rows(self, feature: MultiModalFeature, rows: Any, source: str) -> None:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or not rows.is_floating_point():
            desc = (
                f"{rows.dtype} tensor of shape {tuple(rows.shape)}"
                if isinstance(rows, torch.Tensor)
                else type(rows).__name__
            )
            raise ValueError(f"{source} for {feature.identifier} must be a 2-D floating tensor, got {desc}")
        expected = (feature.placeholder.num_embeds, self.hidden_size)
        if tuple(rows.shape) != expected:
            raise ValueError(
                f"{source} for {feature.identifier} has shape {tuple(rows.shape)}; its placeholder "
                f"expects {expected} (num_embeds, hidden_size)"
            )

    def ensure(
        self,
        features: Iterable[MultiModalFeature],
        encoders: Mapping[str, EncoderProtocol] | None = None,
    ) -> None:
        """Make every feature's rows resident. Cached identifiers are only touched (LRU);
        missing passthrough items are moved to the device/dtype once; missing items of each
        other modality go through ONE batched `encode` call per modality (one per item with
        `encode_alone`). A batch of only passthrough items calls no encoder. Entries touched here
        are not evicted by this call."""
        missing: dict[str, MultiModalFeature] = {}
        pinned: set[str] = set()
        for feature in features:
            identifier = feature.identifier
            pinned.add(identifier)
            if identifier in self._entries:
                self._entries.move_to_end(identifier)
            elif identifier not in missing:
                if feature.item is None:
                    raise ValueError(f"{identifier} is not in the encoder cache and its feature has no item")
                missing[identifier] = feature
        if not missing:
            return

        by_modality: dict[str, list[MultiModalFeature]] = {}
        for feature in missing.values():
            if feature.modality == PROMPT_EMBEDS_MODALITY:
                self._insert(feature.identifier, self._upload(feature), pinned)
            else:
                by_modality.setdefault(feature.modality, []).append(feature)

        failed: dict[str, str] = {}
        for modality, items in by_modality.items():
            encoder = (encoders or {}).get(modality)
            if encoder is None:
                raise ValueError(f"no encoder registered for modality {modality!r}")
            for group in ([[f] for f in items] if self.encode_alone else [items]):
                try:
                    self._encode_group(modality, encoder, group, pinned)
                except Exception:  # noqa: BLE001 - any encoder error: find the items that cause it
                    for feature in group:  # one by one, so that only the prompts of bad items fail
                        try:
                            self._encode_group(modality, encoder, [feature], pinned)
                        except Exception as err:  # noqa: BLE001
                            failed[feature.identifier] = f"{type(err).__name__}: {str(err)[:200]}"
        if failed:
            raise EncoderFailure(failed)

    def _encode_group(self, modality: str, encoder: EncoderProtocol, group: list[MultiModalFeature],
                      pinned: set[str]) -> None:
        """One batched `encode` call; every output checked (shape, NaN/Inf after the cast to the
        cache dtype) before any is cached."""
        outputs = encoder.encode([f.item for f in group])
        self.num_encoder_calls += 1
        self.num_encoded_items += len(group)
        if not isinstance(outputs, Sequence) or len(outputs) != len(group):
            got = len(outputs) if isinstance(outputs, Sequence) else type(outputs).__name__
            raise ValueError(f"encoder for {modality!r} returned {got} outputs for {len(group)} items")
        rows_of = []
        for feature, rows in zip(group, outputs):
            self._check_rows(feature, rows, f"{modality!r} encoder output")
            rows_of.append(rows.to(device=self.device, dtype=self.dtype))
        finite = torch.stack([torch.isfinite(r).all() for r in rows_of]).tolist()
        if not all(finite):
            raise ValueError(f"{modality!r} encoder output contains NaN or Inf (in the cache dtype "
                             f"{self.dtype})")
        for feature, rows in zip(group, rows_of):
            self._insert(feature.identifier, rows, pinned)

    def _upload(self, feature: MultiModalFeature) -> torch.Tensor:
        tensor = feature.item
        self._check_rows(feature, tensor, "prompt_embeds item")
        rows = tensor.detach().to(device=self.device, dtype=self.dtype)
        if rows.data_ptr() == tensor.data_ptr():
            # Already on the device in the cache dtype: own a copy, so the caller mutating its
            # tensor later cannot change what this content hash serves.
            rows = rows.clone()
        self.num_uploads += 1
        return rows

    # ---- gather -------------------------------------------------------------------------

    def gather(self, windows: Sequence[RequestWindow], *, realtime: bool = False) -> GatheredEmbeds:
        """Encoder rows for a step, in step-token order, plus the `is_mm_embed` mask.

        Requests are laid out in `windows` order, each taking `num_scheduled_tokens` rows of the
        step. Non-realtime: a request past its prefill (`nc >= prompt_len`) is skipped, and an
        all-decode step returns at once without touching the cache. Realtime: every window is
        searched, so rows of items streamed into a decoding request are gathered.
        """
        if not realtime and all(w.num_computed_tokens >= w.prompt_len for w in windows):
            return GatheredEmbeds()
        num_tokens = sum(w.num_scheduled_tokens for w in windows)
        # Pinned when the cache lives on a GPU, so the mask's upload below is asynchronous.
        mask = torch.zeros(num_tokens, dtype=torch.bool, pin_memory=self.device.type == "cuda")
        pieces: list[torch.Tensor] = []
        step_start = 0
        for window in windows:
            nc, num_sched = window.num_computed_tokens, window.num_scheduled_tokens
            if window.features and num_sched > 0 and (realtime or nc < window.prompt_len):
                self._gather_window(window.features, nc, nc + num_sched, step_start, mask, pieces)
            step_start += num_sched
        if not pieces:
            return GatheredEmbeds()
        mm_embeds = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return GatheredEmbeds(mm_embeds, mask.to(self.device, non_blocking=True), mask)

    def _gather_window(
        self,
        features: Sequence[MultiModalFeature],
        start: int,
        end: int,
        step_start: int,
        mask: torch.Tensor,
        pieces: list[torch.Tensor],
    ) -> None:
        # Sorted, non-overlapping features: the one before the first offset > start is the only
        # earlier feature that can still reach into the window.
        first = max(bisect_right(features, start, key=_offset_of) - 1, 0)
        for feature in features[first:]:
            ph = feature.placeholder
            if ph.offset >= end:
                break
            if ph.end <= start:
                continue
            start_idx = max(start - ph.offset, 0)
            end_idx = min(end - ph.offset, ph.length)
            r0, r1 = ph.embeds_range(start_idx, end_idx)
            if r0 == r1:
                continue
            rows = self._entries.get(feature.identifier)
            if rows is None:
                raise RuntimeError(
                    f"{feature.identifier} is scheduled but not in the encoder cache; call ensure() "
                    "for the step's features before gather()"
                )
            self._entries.move_to_end(feature.identifier)
            tok0 = step_start + ph.offset + start_idx - start
            tok1 = tok0 + end_idx - start_idx
            mask[tok0:tok1] = True if ph.is_embed is None else ph.is_embed[start_idx:end_idx]
            pieces.append(rows[r0:r1])
