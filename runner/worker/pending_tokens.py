"""Async scheduling's token feed: input ids the host does not know yet, copied on the device.

Under async scheduling step n+1 is launched while step n runs, so a request's newest token (the one step
n samples) is not on the host when step n+1 is staged. The staged input id at its position is a stale
value; this feed overwrites it on the device from step n's sampled ids (`LaunchedStep.token_ids`), with
one small index upload and one `index_copy_`, and never waits for step n.
"""

from __future__ import annotations

import torch

from runner.step_io import SchedulerOutput
from runner.worker.staging import StagedStep
from runner.worker.step_sampling import LaunchedStep


class PendingTokenFeed:
    """The feed of one runner: pinned index buffers used in turn on a GPU, like the staging buffers."""

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        self.device = device
        self.num_fed_tokens = 0
        self._turn = 0
        if device.type == "cuda":
            self._host = [torch.zeros(2 * max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._dev = torch.zeros(2 * max_num_seqs, dtype=torch.int64, device=device)
            self._events = [torch.cuda.Event(), torch.cuda.Event()]

    def feed(self, so: SchedulerOutput, sd: StagedStep, prev: LaunchedStep | None) -> None:
        """Copy into `sd`'s input ids, on the device, every pending token of `so`'s requests from `prev`."""
        if prev is not None and prev.awaits_sampling:
            raise RuntimeError("the step in flight has not sampled yet (deferred sampling): sample it first")
        dst: list[int] = []
        src: list[int] = []
        for i, req in enumerate(so.requests):
            if not req.num_pending_outputs:
                continue
            if req.num_pending_outputs > 1 or prev is None or req.request_id not in prev.sample_index:
                raise RuntimeError(f"request {req.request_id}: its pending token is not from the step in "
                                   "flight (async scheduling must finish older steps first)")
            pos = req.num_tokens - 1  # the pending token is the request's last one
            start = int(sd.cu[i] - sd.nsched[i])
            nc = req.num_computed_tokens
            if nc <= pos < nc + int(sd.nsched[i]):
                dst.append(start + pos - nc)
                src.append(prev.sample_index[req.request_id])
        if not dst:
            return
        n = len(dst)
        if self.device.type == "cuda":  # pinned, used in turn like the staging buffers
            self._turn ^= 1
            host, event = self._host[self._turn], self._events[self._turn]
            event.synchronize()  # its previous upload has run (in practice long ago)
            host[:n] = torch.tensor(dst)
            host[n : 2 * n] = torch.tensor(src)
            idx = self._dev[: 2 * n]
            idx.copy_(host[: 2 * n], non_blocking=True)
            event.record()
        else:
            idx = torch.tensor(dst + src, dtype=torch.int64)
        sd.views.input_ids.index_copy_(0, idx[:n], prev.token_ids.index_select(0, idx[n:]))
        self.num_fed_tokens += n

    def release(self) -> None:
        self._host = self._dev = None


__all__ = ["PendingTokenFeed"]
