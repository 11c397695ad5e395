"""Per-step input staging: pinned host buffers mirrored on the device, one view per step tensor.

Host work per step is a few vectorised numpy writes into two pinned staging buffers (one int64,
one int32), moved to the device with two non-blocking copies. Every per-step device tensor is a
view at a fixed offset of the two device buffers, so a decode step can replay a CUDA graph that
was captured on the same addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ALIGN64 = 2  # int64 elements per 16 bytes
_ALIGN32 = 4  # int32 elements per 16 bytes


def _starts(lengths: list[int], align: int) -> list[int]:
    """Each view's start, rounded up to `align` elements, and then the end of the last view."""
    starts, at = [], 0
    for n in lengths:
        at = -(-at // align) * align
        starts.append(at)
        at += n
    return [*starts, at]


@dataclass
class StepViews:
    """Device (and host) views of one step's inputs inside the staging buffers."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    idx_mapping: torch.Tensor
    block_tables: torch.Tensor
    num_computed_by_slot: torch.Tensor


class StagingBuffers:
    """Pinned host buffers mirrored by device buffers; a step's tensors are views at fixed offsets.

    Layout for a step of `t` token rows, `r` request rows, `w` block-table columns and `l` logits rows:
      int64: [input_ids t][positions t][slot_mapping t][logits_indices l]
      int32: [num_computed_by_slot S][query_start_loc r+1][seq_lens r][idx_mapping r][block_tables r*w]
    Offsets depend only on (t, r, w), so the views a CUDA graph captured for a bucket are the views
    every replay of that bucket writes. Every view starts on a 16-byte boundary: Triton specialises a
    kernel on whether each pointer argument is 16-byte aligned, so views packed back to back gave the
    attention, KV-write and rotary kernels a new specialisation (a build of up to a second, mid-step)
    for each parity of `t` and residue of `r` mod 4 that the warm-up had not met; a server meets them all.

    On a GPU there are two pinned host pairs, used in turn (`next_host`): under async scheduling
    step n+1 is staged while step n's upload may still be queued behind step n-1 on the device,
    so it must not write the pinned memory that upload reads. Each pair's upload records an event
    and `next_host` waits for it before the pair is written again (already done in practice: the
    loop read step n-1's tokens, which come after step n-1's upload, before staging step n+1).
    """

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device) -> None:
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        self.device = device
        pin = device.type == "cuda"
        n64 = 4 * max_tokens + 4 * _ALIGN64  # room for the padding between views
        n32 = max_reqs + (max_reqs + 1) + 2 * max_reqs + max_reqs * max_blocks + 5 * _ALIGN32
        pairs = 2 if pin else 1
        self._hosts = [(torch.zeros(n64, dtype=torch.int64, pin_memory=pin),
                        torch.zeros(n32, dtype=torch.int32, pin_memory=pin)) for _ in range(pairs)]
        self._events: list = [None] * pairs
        self._turn = 0
        self.host64, self.host32 = self._hosts[0]
        self.np64 = self.host64.numpy()
        self.np32 = self.host32.numpy()
        if device.type == "cpu":
            self.dev64, self.dev32 = self.host64, self.host32
        else:
            self.dev64 = torch.zeros(n64, dtype=torch.int64, device=device)
            self.dev32 = torch.zeros(n32, dtype=torch.int32, device=device)

    @property
    def device_bytes(self) -> int:
        """Device memory of the two mirrored buffers (0 on the CPU, where host and device are one)."""
        if self.dev64 is self.host64:
            return 0
        return self.dev64.numel() * 8 + self.dev32.numel() * 4

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory of the staging pairs (0 on the CPU: nothing is pinned there)."""
        if self.device.type != "cuda":
            return 0
        return sum(h64.numel() * 8 + h32.numel() * 4 for h64, h32 in self._hosts)

    def next_host(self) -> None:
        """Switch to the other pinned host pair (GPU only), once its last upload has run."""
        if len(self._hosts) == 1:
            return
        self._turn = (self._turn + 1) % len(self._hosts)
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        self.host64, self.host32 = self._hosts[self._turn]
        self.np64 = self.host64.numpy()
        self.np32 = self.host32.numpy()

    def offsets(self, t: int, r: int, w: int, n_logits: int) -> tuple[list[int], list[int]]:
        """Start of each view (each on a 16-byte boundary), then the end of the last one."""
        o64 = _starts([t, t, t, n_logits], _ALIGN64)
        o32 = _starts([self.max_reqs, r + 1, r, r, r * w], _ALIGN32)
        return o64, o32

    def views(self, buf64: torch.Tensor, buf32: torch.Tensor, t: int, r: int, w: int,
              n_logits: int) -> StepViews:
        o64, o32 = self.offsets(t, r, w, n_logits)
        return StepViews(
            input_ids=buf64[o64[0] : o64[0] + t],
            positions=buf64[o64[1] : o64[1] + t],
            slot_mapping=buf64[o64[2] : o64[2] + t],
            logits_indices=buf64[o64[3] : o64[3] + n_logits],
            num_computed_by_slot=buf32[o32[0] : o32[0] + self.max_reqs],
            query_start_loc=buf32[o32[1] : o32[1] + r + 1],
            seq_lens=buf32[o32[2] : o32[2] + r],
            idx_mapping=buf32[o32[3] : o32[3] + r],
            block_tables=buf32[o32[4] : o32[4] + r * w].view(r, w),
        )

    def upload(self, t: int, r: int, w: int, n_logits: int) -> None:
        if self.dev64 is self.host64:
            return
        o64, o32 = self.offsets(t, r, w, n_logits)
        self.dev64[: o64[-1]].copy_(self.host64[: o64[-1]], non_blocking=True)
        self.dev32[: o32[-1]].copy_(self.host32[: o32[-1]], non_blocking=True)
        if self._events[self._turn] is None:
            self._events[self._turn] = torch.cuda.Event()
        self._events[self._turn].record()


@dataclass
class StagedStep:
    """One step's staged inputs: device views plus the host-side numbers the step needs later."""

    views: StepViews
    t: int
    r: int
    bucket: int | None
    nsched: np.ndarray
    cu: np.ndarray
    seq_lens: np.ndarray
    single_token: bool  # every request runs one token (decode kernels, graph buckets)
    decode_only: bool  # ... and every one of them is past its prompt (M-RoPE decode positions)
    sample_rows: list[int]
    plp_rows: list[int]
    plp_spans: list[tuple[int, int, int]]
    mixed: int | None = None  # token bucket of the mixed-step graph it replays, if any


__all__ = ["StagedStep", "StagingBuffers", "StepViews"]
