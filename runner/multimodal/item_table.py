"""Per-slot spans of item rows, and the per-step device gather of those rows into `inputs_embeds`.

An item (an encoder's output, a passthrough `"prompt_embeds"` tensor) sits behind a placeholder at
prompt positions `[offset, offset + length)`. Once its rows are resident in the encoder cache and
the request's window first reaches it, `MultimodalState` registers it here: ONE entry in the
request's slot row of a small int64 device table (offset, length, address of the cached rows,
address of a position -> row map when the placeholder has `is_embed`). After that the request's
item rows cost the host nothing per step: every step, one Triton launch
(`runner.layers.item_gather_kernel`) reads each batch row's window through `idx_mapping`,
`query_start_loc` and `num_computed_tokens` (the overlay's inputs) and copies the rows of the
tokens that fall in a span. Positions outside every span keep their token embedding.

Table updates are batched: `register` and `release` write a host mirror and mark the slot dirty;
`apply` uploads the dirty rows (one host-to-device copy, one `index_copy_`) before it launches, so
a step pays one small copy however many items were registered or released, and nothing when none
were.

Memory safety (the prompt-embeds overlay's argument, `runner/worker/prompt_embeds.py`): the
kernel reaches rows only through a table entry, and this object keeps every registered rows
tensor alive (a Python reference) until its slot is released. A released slot's device row still
holds stale addresses until the next upload, but nothing reads it before then: the only launch
is in `apply`, which uploads first. Memory freed meanwhile goes, through PyTorch's caching
allocator, only to work enqueued later on the same stream, so a launch already in flight finishes
reading first. The launch is never part of a CUDA graph (prefill steps are not captured; realtime
rows of a decode step are gathered before the graph replays), so apply refuses to run while the
stream captures.

CPU (or `use_triton=False`): the same contract in torch, from the host-side spans (the index
tensors are read on the host, a sync on a GPU). `use_triton=True` on a CPU device needs
`TRITON_INTERPRET=1` set before triton is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from runner.layers.overlay_kernel import OverlayConfig
    from runner.multimodal.encoder_cache import PlaceholderRange

__all__ = ["ItemTable"]

_FIELDS = 4  # per span: offset, length, rows address, map address


class ItemTable:
    """Registered item spans by batch slot (module docstring).

    Args:
        max_num_reqs: slots to start with (the table grows if a larger slot is registered).
        hidden_size, dtype, device: of the rows and of `apply`'s `inputs_embeds`.
        use_triton: the kernel (default: when `device` is CUDA) or the torch path.
        kernel_config: optional tile shape (`runner.layers.overlay_kernel.OverlayConfig`).
    """

    def __init__(self, max_num_reqs: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 *, use_triton: bool | None = None, kernel_config: OverlayConfig | None = None) -> None:
        if not isinstance(max_num_reqs, int) or max_num_reqs <= 0:
            raise ValueError(f"max_num_reqs must be a positive int, got {max_num_reqs!r}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.device = device
        self.use_triton = device.type == "cuda" if use_triton is None else bool(use_triton)
        self.kernel_config = kernel_config
        self._launch = None
        if self.use_triton:
            # Lazily, so TRITON_INTERPRET can be set first and the torch path never needs triton.
            from runner.layers.item_gather_kernel import launch_item_gather

            self._launch = launch_item_gather
        # Host side, by slot: (placeholder, rows, device map or None) per span, in offset order.
        self._spans: list[list[tuple[PlaceholderRange, torch.Tensor, torch.Tensor | None]]] = []
        self._capacity = 1  # spans per slot row of the table (a power of two)
        self._host = np.zeros((0, 1 + _FIELDS), dtype=np.int64)
        self._table: torch.Tensor | None = None
        self._dirty: set[int] = set()
        self._num_live = 0  # slots holding at least one span
        self.num_launches = 0
        self.num_table_writes = 0  # table uploads (launches after something was registered or released)
        self._resize(max_num_reqs, 1)

    # ------------------------------------------------------------------ bookkeeping

    @property
    def num_slots(self) -> int:
        return len(self._spans)

    @property
    def num_live_slots(self) -> int:
        """Slots holding item spans (0: `apply` launches nothing)."""
        return self._num_live

    def num_spans(self, slot: int) -> int:
        return len(self._spans[slot]) if 0 <= slot < len(self._spans) else 0

    def _resize(self, num_slots: int, capacity: int) -> None:
        old, old_cap = self._host, self._capacity
        host = np.zeros((num_slots, 1 + _FIELDS * capacity), dtype=np.int64)
        host[: old.shape[0], : 1 + _FIELDS * old_cap] = old
        self._host, self._capacity = host, capacity
        self._spans.extend([] for _ in range(num_slots - len(self._spans)))
        if self.use_triton:  # a fresh device table: every slot row is uploaded before the next launch
            self._table = torch.zeros(host.shape, dtype=torch.int64, device=self.device)
            self._dirty.update(range(num_slots))

    def register(self, slot: int, placeholder: PlaceholderRange, rows: torch.Tensor) -> None:
        """Serve `rows` (the item's `(num_embeds, hidden)` rows) at the placeholder's positions of the
        request in `slot`, from the next `apply` on. Spans of a slot go in offset order."""
        if not isinstance(slot, int) or slot < 0:
            raise ValueError(f"slot must be an int >= 0, got {slot!r}")
        if rows.dim() != 2 or tuple(rows.shape) != (placeholder.num_embeds, self.hidden_size):
            raise ValueError(f"rows of shape {tuple(rows.shape)} do not fit a placeholder of "
                             f"{placeholder.num_embeds} embeds and hidden size {self.hidden_size}")
        if rows.dtype != self.dtype or rows.device != self.device:
            raise ValueError(f"rows must be {self.dtype} on {self.device}, got {rows.dtype} on {rows.device}")
        if slot >= self.num_slots:
            self._resize(max(slot + 1, 2 * self.num_slots), self._capacity)
        spans = self._spans[slot]
        if spans and placeholder.offset < spans[-1][0].end:
            raise ValueError(f"span at {placeholder.offset} registered out of order (the slot's last span "
                             f"ends at {spans[-1][0].end})")
        if not rows.is_contiguous() or rows.data_ptr() % 16:
            # The kernel reads rows at `address + row * hidden`, 16-byte aligned: a fresh allocation
            # is (the cache's own tensors always are; a caller's strided view may not be).
            rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device).copy_(rows)
        row_map = None
        if self.use_triton and placeholder.is_embed is not None:
            mask = placeholder.is_embed
            host_map = torch.where(mask, torch.cumsum(mask, 0, dtype=torch.int32) - 1, -1).to(torch.int32)
            row_map = host_map.to(self.device) if self.device.type != "cuda" else (
                host_map.pin_memory().to(self.device, non_blocking=True))
        if len(spans) == self._capacity:
            self._resize(self.num_slots, 2 * self._capacity)
        if not spans:
            self._num_live += 1
        i = len(spans)
        spans.append((placeholder, rows, row_map))
        host = self._host[slot]
        host[0] = len(spans)
        map_addr = 0 if row_map is None else row_map.data_ptr()
        entry = (placeholder.offset, placeholder.length, rows.data_ptr(), map_addr)
        host[1 + _FIELDS * i : 1 + _FIELDS * (i + 1)] = entry
        self._dirty.add(slot)

    def release(self, slot: int) -> None:
        """Drop every span of `slot` (the request left it). Safe to call for an empty slot."""
        if not 0 <= slot < self.num_slots or not self._spans[slot]:
            return
        self._spans[slot] = []
        self._host[slot] = 0
        self._dirty.add(slot)
        self._num_live -= 1

    def reset(self) -> None:
        """Release every slot."""
        for slot in range(self.num_slots):
            self.release(slot)

    def _flush(self) -> None:
        """Write the dirty slot rows into the device table: one copy and one `index_copy_`."""
        if not self._dirty:
            return
        slots = np.fromiter(sorted(self._dirty), dtype=np.int64, count=len(self._dirty))
        self._dirty.clear()
        on_gpu = self.device.type == "cuda"
        staged = torch.empty((len(slots), 1 + self._host.shape[1]), dtype=torch.int64, pin_memory=on_gpu)
        block = staged.numpy()
        block[:, 0] = slots
        block[:, 1:] = self._host[slots]
        # Pinned memory from torch's caching host allocator: not reused before the copy has run.
        dev = staged.to(self.device, non_blocking=on_gpu)
        self._table.index_copy_(0, dev[:, 0], dev[:, 1:])
        self.num_table_writes += 1

    # ------------------------------------------------------------------ the gather

    def apply(self, inputs_embeds: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
              num_computed_tokens: torch.Tensor) -> None:
        """Write the item rows of the scheduled windows into `inputs_embeds`, in place.

        The overlay's arguments (`PromptEmbedsState.apply`): `inputs_embeds` `(num_tokens, hidden)`
        in the table's dtype, `idx_mapping` `(num_reqs,)` slots, `query_start_loc` `(num_reqs + 1,)`,
        `num_computed_tokens` by slot; int32, contiguous, on the table's device. Batch row b in slot
        s with `nc` computed tokens: scheduled token t at position `p = nc + t` takes row
        `rows[map(p - offset)]` of the span holding p, if any (map: identity, or the cumulative
        count of `is_embed`; a position with `is_embed` False is not written).
        """
        self._check_args(inputs_embeds, idx_mapping, query_start_loc, num_computed_tokens)
        if self._num_live == 0:
            return
        if not self.use_triton:
            self._apply_torch(inputs_embeds, idx_mapping, query_start_loc, num_computed_tokens)
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the item gather is never captured in a CUDA graph (apply it before replay)")
        self._flush()
        log_spans = (self._capacity - 1).bit_length()  # binary-search steps over capacity spans
        self._launch(inputs_embeds, idx_mapping, query_start_loc, num_computed_tokens, self._table,
                     log_spans, self.kernel_config)
        self.num_launches += 1

    def _apply_torch(self, inputs_embeds: torch.Tensor, idx_mapping: torch.Tensor,
                     query_start_loc: torch.Tensor, num_computed_tokens: torch.Tensor) -> None:
        starts = query_start_loc.tolist()
        computed = num_computed_tokens.tolist()
        for b, slot in enumerate(idx_mapping.tolist()):
            if not 0 <= slot < self.num_slots or not self._spans[slot]:
                continue
            start, end = computed[slot], computed[slot] + starts[b + 1] - starts[b]
            for ph, rows, _ in self._spans[slot]:
                if ph.offset >= end:
                    break
                if ph.end <= start:
                    continue
                j0, j1 = max(start - ph.offset, 0), min(end - ph.offset, ph.length)
                r0, r1 = ph.embeds_range(j0, j1)
                tok0 = starts[b] + ph.offset + j0 - start
                dst = inputs_embeds[tok0 : tok0 + j1 - j0]
                if ph.is_embed is None:
                    dst.copy_(rows[r0:r1])
                else:
                    dst[ph.is_embed[j0:j1].to(dst.device)] = rows[r0:r1]

    def _check_args(self, inputs_embeds: torch.Tensor, idx_mapping: torch.Tensor,
                    query_start_loc: torch.Tensor, num_computed_tokens: torch.Tensor) -> None:
        if inputs_embeds.dim() != 2 or inputs_embeds.shape[1] != self.hidden_size:
            raise ValueError(f"inputs_embeds must be (num_tokens, {self.hidden_size}), got "
                             f"{tuple(inputs_embeds.shape)}")
        if inputs_embeds.dtype != self.dtype or inputs_embeds.stride(1) != 1:
            raise ValueError(f"inputs_embeds must be {self.dtype} and contiguous along the hidden dimension")
        for name, t in (("inputs_embeds", inputs_embeds), ("idx_mapping", idx_mapping),
                        ("query_start_loc", query_start_loc), ("num_computed_tokens", num_computed_tokens)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the item table is on {self.device}")
            if name != "inputs_embeds" and (t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous 1-D int32 tensor, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if query_start_loc.shape[0] != idx_mapping.shape[0] + 1:
            raise ValueError(f"query_start_loc must have num_reqs + 1 = {idx_mapping.shape[0] + 1} entries")
        if num_computed_tokens.shape[0] < self.num_slots:
            raise ValueError(f"num_computed_tokens is indexed by slot and needs {self.num_slots} entries, "
                             f"got {num_computed_tokens.shape[0]}")
