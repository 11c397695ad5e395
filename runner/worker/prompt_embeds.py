"""Per-request user prompt embeddings and the per-step overlay onto `inputs_embeds`.

A request whose prompt arrives as an `(n, hidden)` embeddings tensor keeps that tensor on the
device for its whole life; every step the rows that fall into the request's scheduled window
replace the token embeddings computed for those positions (docs/ARCHITECTURE.md, "The prompt-embeds overlay").

Storage, and why: each live request owns one device tensor (copied once at `add_request`, cast
to the model dtype there). Three small per-slot device tables (rows address, row count, mask
address) let a single Triton launch serve the whole batch, and keep the launch CUDA-graph safe:
the tables live at fixed addresses, so a captured graph reads whatever the tables hold at replay.
Per-request tensors keep memory bounded by exactly the live requests (no pool to grow, compact
or size in advance); the price is that the kernel turns an int64 address back into a pointer,
which Triton supports (and the interpreter too).

Table writes are batched: `add_request` and releases only note the slot's new entry on the host,
and `sync_tables` (called by `apply` before its launch) writes every noted entry with one upload
and one scatter per table. Why: three one-element device writes per request, at admission and
again at release, were ~400 launches of host time per 64-request call, most of it with the GPU
idle (before the first step, after the last). A graph that captured `apply` reads the tables at
replay, so call `sync_tables` before replaying it after adding or removing requests.

Memory safety: the kernel only reaches a tensor through its slot's table entry, and every launch
is preceded by `sync_tables`, so a launch never reads an entry of a released request: releasing
a request notes a zero entry, which the next launch's `sync_tables` writes first. PyTorch's
caching allocator only hands the released memory to work enqueued later on the same stream, so
a launch already in flight finishes reading first. If `apply` ever ran on another stream (for
example a CUDA-graph capture stream), the released tensors are `record_stream`-ed on it, so the
allocator also waits for that stream. Table updates are stream-ordered, so requests should be
added/removed on the stream that launches (or replays) the overlay, which is the normal
single-stream runner set-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runner.layers.overlay_kernel import OverlayConfig
    from runner.worker.host_upload import HostUploader

__all__ = ["PromptEmbedsState"]


class PromptEmbedsState:
    """User prompt embeddings of the running requests, indexed by batch slot.

    Args:
        max_num_reqs: number of slots (the runner's maximum concurrent requests).
        hidden_size: the model's hidden size; every tensor must have this many columns.
        dtype: the model's embedding dtype; rows are cast to it once, at `add_request`.
        device: where the rows, the tables and `apply`'s tensors live.
        use_triton: run the Triton kernel (default: when `device` is CUDA). `False` selects the
            plain torch path, which reads the index tensors on the host (a sync on a GPU).
            `True` on a CPU device needs `TRITON_INTERPRET=1` set before triton is imported.
        kernel_config: optional `runner.layers.overlay_kernel.OverlayConfig` (tile shape) override.
    """

    def __init__(
        self,
        max_num_reqs: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        use_triton: bool | None = None,
        kernel_config: OverlayConfig | None = None,
        uploader: HostUploader | None = None,
    ) -> None:
        if not isinstance(max_num_reqs, int) or max_num_reqs <= 0:
            raise ValueError(f"max_num_reqs must be a positive int, got {max_num_reqs!r}")
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.max_num_reqs = max_num_reqs
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.use_triton = device.type == "cuda" if use_triton is None else bool(use_triton)
        self.kernel_config = kernel_config
        self.uploader = uploader
        self._launch = None
        if self.use_triton:
            # Imported lazily so TRITON_INTERPRET (read when kernels are decorated) can be set
            # by the caller first, and so the torch path never needs triton.
            from runner.layers.overlay_kernel import launch_overlay

            self._launch = launch_overlay

        self._rows: list[torch.Tensor | None] = [None] * max_num_reqs
        self._masks: list[torch.Tensor | None] = [None] * max_num_reqs
        self._req_ids: list[str | None] = [None] * max_num_reqs
        self._slot_of: dict[str, int] = {}
        self._num_with_embeds = 0  # host counter: the launch is skipped while it is 0
        self._apply_streams: set = set()
        # Device tables read by the kernel; 0 means "nothing here".
        self._rows_addr = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self._num_rows = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self._mask_addr = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        # slot -> (rows address, row count, mask address) not yet written to the tables
        self._unsynced: dict[int, tuple[int, int, int]] = {}

    # ------------------------------------------------------------------ bookkeeping

    @property
    def num_requests_with_embeds(self) -> int:
        """Live requests holding embeddings (0 means `apply` launches nothing)."""
        return self._num_with_embeds

    def slot_of(self, req_id: str) -> int | None:
        """The slot `req_id` occupies, or None when it is not registered."""
        return self._slot_of.get(req_id)

    def has_embeds(self, req_id: str) -> bool:
        slot = self._slot_of.get(req_id)
        return slot is not None and self._rows[slot] is not None

    def add_request(
        self,
        req_index: int,
        req_id: str,
        prompt_embeds: torch.Tensor | None,
        is_token_ids: torch.Tensor | None = None,
        *,
        owned: bool = False,
    ) -> None:
        """Put `req_id` in slot `req_index`, with its embeddings (or none, which clears the slot).

        Whatever occupied the slot before is released, so a reused slot never serves the
        previous occupant's rows; if `req_id` sat in another slot it moves here. `owned`: the
        tensor is the engine's own device copy (nobody else writes it), so a tensor already on the
        device in the model dtype is used as it is instead of copied.
        """
        if not isinstance(req_index, int) or not 0 <= req_index < self.max_num_reqs:
            raise ValueError(f"req_index must be an int in [0, {self.max_num_reqs}), got {req_index!r}")
        rows, mask = self._validated(prompt_embeds, is_token_ids)

        old_slot = self._slot_of.get(req_id)
        if old_slot is not None:
            self._release(old_slot)
        self._release(req_index)
        self._req_ids[req_index] = req_id
        self._slot_of[req_id] = req_index
        if rows is None:
            return

        # At most one copy per request, cast to the model dtype on the way; a host tensor goes
        # through the uploader's pinned ring and copy stream (the host never waits for the GPU).
        if owned and rows.device == self.device and rows.dtype == self.dtype:
            dev_rows = rows
        elif self.uploader is not None and rows.device.type == "cpu":
            dev_rows, _ = self.uploader.upload(rows, self.dtype)
        else:
            dev_rows = torch.empty(rows.shape, dtype=self.dtype, device=self.device)
            dev_rows.copy_(rows, non_blocking=not rows.is_pinned())
        dev_mask = None
        if mask is not None:
            dev_mask = torch.empty(mask.shape, dtype=torch.uint8, device=self.device)
            dev_mask.copy_(mask, non_blocking=not mask.is_pinned())
        self._rows[req_index] = dev_rows
        self._masks[req_index] = dev_mask
        self._num_with_embeds += 1
        if self.use_triton:
            # Fresh allocations are at least 64-byte aligned; the kernel relies on 16.
            assert dev_rows.data_ptr() % 16 == 0
            self._unsynced[req_index] = (dev_rows.data_ptr(), dev_rows.shape[0],
                                         0 if dev_mask is None else dev_mask.data_ptr())

    def remove_request(self, req_id: str) -> bool:
        """Release `req_id`'s slot. By id, so remove/reuse in either order is safe.

        Returns False (and does nothing) when `req_id` is not registered, for example because
        another request already took its slot.
        """
        slot = self._slot_of.get(req_id)
        if slot is None:
            return False
        self._release(slot)
        return True

    def reset(self) -> None:
        """Release every slot."""
        for slot in range(self.max_num_reqs):
            self._release(slot)

    def _release(self, slot: int) -> None:
        old_id = self._req_ids[slot]
        if old_id is not None:
            del self._slot_of[old_id]
            self._req_ids[slot] = None
        rows, mask = self._rows[slot], self._masks[slot]
        if rows is None:
            return
        if self.use_triton:  # a zero entry, written before the next launch (`sync_tables`)
            self._unsynced[slot] = (0, 0, 0)
        if self.device.type == "cuda":
            for stream in self._apply_streams:
                rows.record_stream(stream)
                if mask is not None:
                    mask.record_stream(stream)
        self._rows[slot] = None
        self._masks[slot] = None
        self._num_with_embeds -= 1

    def _validated(
        self, prompt_embeds: torch.Tensor | None, is_token_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if prompt_embeds is None:
            if is_token_ids is not None:
                raise ValueError("is_token_ids was given without prompt_embeds")
            return None, None
        if not isinstance(prompt_embeds, torch.Tensor):
            raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(prompt_embeds).__name__}")
        if prompt_embeds.dim() != 2:
            raise ValueError(f"prompt_embeds must be 2-D (n, hidden), got shape {tuple(prompt_embeds.shape)}")
        if not prompt_embeds.is_floating_point():
            raise ValueError(f"prompt_embeds must be floating point, got {prompt_embeds.dtype}")
        n, hidden = prompt_embeds.shape
        if hidden != self.hidden_size:
            raise ValueError(f"prompt_embeds has hidden size {hidden}, the model expects {self.hidden_size}")
        if n == 0:
            raise ValueError("prompt_embeds has no rows")
        if is_token_ids is None:
            return prompt_embeds, None
        if not isinstance(is_token_ids, torch.Tensor):
            raise ValueError(f"is_token_ids must be a torch.Tensor, got {type(is_token_ids).__name__}")
        if is_token_ids.dtype != torch.bool:
            raise ValueError(f"is_token_ids must be a bool tensor, got {is_token_ids.dtype}")
        if tuple(is_token_ids.shape) != (n,):
            raise ValueError(
                f"is_token_ids must have shape ({n},) to match prompt_embeds, got {tuple(is_token_ids.shape)}"
            )
        return prompt_embeds, is_token_ids

    # ------------------------------------------------------------------ the overlay

    def apply(
        self,
        inputs_embeds: torch.Tensor,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_computed_tokens: torch.Tensor,
    ) -> None:
        """Overlay the scheduled windows' prompt-embeddings rows onto `inputs_embeds`, in place.

        `inputs_embeds` is `(num_tokens, hidden)` in the state's dtype; `idx_mapping` `(num_reqs,)`
        holds each batch row's slot; `query_start_loc` `(num_reqs + 1,)` the row offsets (its last
        value at most `num_tokens`); `num_computed_tokens` is indexed by slot (at least
        `max_num_reqs` long). All three are int32 on the state's device. For batch row b in slot r
        with `nc` computed tokens and `n` rows: scheduled token t is overlaid when
        `t < min(q_len_b, n - nc)` and `is_token_ids[nc + t]` is not set.

        Triton path: host-side checks only, one launch, no sync (CUDA-graph capturable; while a
        capture is in progress the launch is never skipped, so replays serve later requests).
        """
        self._check_apply_args(inputs_embeds, idx_mapping, query_start_loc, num_computed_tokens)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self._num_with_embeds == 0 and not capturing:
            return
        if not self.use_triton:
            self._apply_torch(inputs_embeds, idx_mapping, query_start_loc, num_computed_tokens)
            return
        if self.device.type == "cuda":
            self._apply_streams.add(torch.cuda.current_stream(self.device))
        self.sync_tables()
        self._launch(
            inputs_embeds,
            idx_mapping,
            query_start_loc,
            num_computed_tokens,
            self._rows_addr,
            self._num_rows,
            self._mask_addr,
            self.kernel_config,
        )

    def sync_tables(self) -> None:
        """Write the table entries noted since the last call (added and released requests) to the
        device tables: one small upload and one scatter per table, stream-ordered on the current
        stream. `apply` calls it first; call it before replaying a graph that captured `apply`."""
        if not self._unsynced:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("sync_tables during a CUDA-graph capture: call it before the capture")
        entries = torch.tensor([(slot, *entry) for slot, entry in self._unsynced.items()], dtype=torch.int64)
        self._unsynced.clear()
        if self.device.type == "cuda":  # pinned, so the copy is asynchronous (the host never waits)
            entries = entries.pin_memory().to(self.device, non_blocking=True)
        slots = entries[:, 0]
        self._rows_addr.index_copy_(0, slots, entries[:, 1])
        self._num_rows.index_copy_(0, slots, entries[:, 2].to(torch.int32))
        self._mask_addr.index_copy_(0, slots, entries[:, 3])

    def build_kernel(self) -> None:
        """One overlay launch on scratch tensors with the dtypes, alignment and row stride of a step's, for
        start-up's build-ahead pass (`runner.worker.kernel_builds_ahead`), inside which it only builds.

        Why: `apply` launches nothing while no live request holds embeddings, so the pass never met the
        overlay, and its build (about a second, cold) fell to the warm-up's first embeds prompt. Outside
        a build-ahead block the launch runs: one request with no scheduled token, which writes nothing.
        """
        if not self.use_triton:
            return
        embeds = torch.empty((1, self.hidden_size), dtype=self.dtype, device=self.device)
        one_request = torch.zeros(1, dtype=torch.int32, device=self.device)
        no_tokens = torch.zeros(2, dtype=torch.int32, device=self.device)  # query_start_loc [0, 0]
        computed = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)
        self._launch(embeds, one_request, no_tokens, computed, self._rows_addr, self._num_rows,
                     self._mask_addr, self.kernel_config)

    def _apply_torch(
        self,
        inputs_embeds: torch.Tensor,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_computed_tokens: torch.Tensor,
    ) -> None:
        slots = idx_mapping.tolist()
        starts = query_start_loc.tolist()
        computed = num_computed_tokens.tolist()
        for b, slot in enumerate(slots):
            if not 0 <= slot < self.max_num_reqs:
                continue
            rows = self._rows[slot]
            if rows is None:
                continue
            nc = computed[slot]
            count = min(starts[b + 1] - starts[b], rows.shape[0] - nc)
            if count <= 0:
                continue
            dst = inputs_embeds[starts[b] : starts[b] + count]
            src = rows[nc : nc + count]
            mask = self._masks[slot]
            if mask is None:
                dst.copy_(src)
            else:
                keep = mask[nc : nc + count].bool().unsqueeze(1)
                dst.copy_(torch.where(keep, dst, src))

    def _check_apply_args(
        self,
        inputs_embeds: torch.Tensor,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_computed_tokens: torch.Tensor,
    ) -> None:
        if inputs_embeds.dim() != 2 or inputs_embeds.shape[1] != self.hidden_size:
            raise ValueError(
                f"inputs_embeds must be (num_tokens, {self.hidden_size}), got {tuple(inputs_embeds.shape)}"
            )
        if inputs_embeds.dtype != self.dtype:
            raise ValueError(f"inputs_embeds must be {self.dtype}, got {inputs_embeds.dtype}")
        if inputs_embeds.stride(1) != 1:
            raise ValueError("inputs_embeds must be contiguous along the hidden dimension")
        for name, t in (
            ("inputs_embeds", inputs_embeds),
            ("idx_mapping", idx_mapping),
            ("query_start_loc", query_start_loc),
            ("num_computed_tokens", num_computed_tokens),
        ):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the state is on {self.device}")
            if name != "inputs_embeds" and (t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous()):
                raise ValueError(
                    f"{name} must be a contiguous 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}"
                )
        if query_start_loc.shape[0] != idx_mapping.shape[0] + 1:
            raise ValueError(
                f"query_start_loc must have num_reqs + 1 = {idx_mapping.shape[0] + 1} entries, "
                f"got {query_start_loc.shape[0]}"
            )
        if num_computed_tokens.shape[0] < self.max_num_reqs:
            raise ValueError(
                f"num_computed_tokens is indexed by slot and needs {self.max_num_reqs} entries, "
                f"got {num_computed_tokens.shape[0]}"
            )
