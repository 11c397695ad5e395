"""Host tensors to the device without making the host wait for the GPU's queue.

Prompt embeddings arrive as pageable CPU tensors (from `torch.load`, a data loader, an HTTP body).
`tensor.to("cuda")` from pageable memory is synchronous for the host in practice: the driver stages
the bytes itself and the call returns only once the copy has run, which on the engine's stream is
after every step already queued (a whole decode window). Once per request, that serialised the
host with the GPU; and checking the rows for NaN/Inf on the CPU cost more host time than the copy.

`HostUploader` instead:
- copies the source bytes into a ring of pinned host memory (one host pass, `memcpy` speed),
- starts the host-to-device copy from there on its own CUDA stream (the copy engine runs beside
  the compute queue, not behind it),
- checks finiteness on the device on that stream when asked (one small kernel per tensor),
- makes the caller's stream wait for the copy with an event (no host sync), and `record_stream`s
  the result so the caching allocator never reuses it under a pending read.

A ring region is written again only after the event of the copy that read it has fired; with the
copy stream free of compute, that wait is a PCIe transfer at most. Tensors larger than the ring go
through it in chunks, so the pinned memory stays bounded whatever the input.

On a CPU device the uploader makes a plain owned copy (the checks run on the CPU).
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from runner.multimodal.placeholders import fits_dtype, limit_for

#: pinned staging ring (allocated on first use)
DEFAULT_RING_BYTES = 64 << 20
#: device bytes of validated prompt embeddings that may wait on the device for their request's
#: admission (beyond it, a prompt's rows stay on the host and are uploaded when it is admitted)
DEFAULT_KEEP_BYTES = 256 << 20
_ALIGN = 256
#: host threads that fill a large ring chunk together, the size that makes a chunk large, and the
#: largest piece one thread copies at a time
COPY_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))
PARALLEL_COPY_BYTES = 4 << 20
PIECE_BYTES = 1 << 20
PIPELINED_FILL = True


class HostUploader:
    """Asynchronous, host-bounded uploads of host tensors to one device (see the module docstring)."""

    def __init__(self, device: torch.device, ring_bytes: int = DEFAULT_RING_BYTES,
                 keep_bytes: int = DEFAULT_KEEP_BYTES) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # so `t.device == uploader.device` holds
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cuda = self.device.type == "cuda"
        self.ring_bytes = max(_ALIGN * 16, int(ring_bytes))
        self.chunk_bytes = self.ring_bytes // 4  # bytes per device copy from the ring
        self._ring: torch.Tensor | None = None
        self._ring_np = None  # numpy view of the ring (host copies)
        self._head = 0
        self._pending: deque = deque()  # (start, end, event) of copies that may still read the ring
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pool: ThreadPoolExecutor | None = None  # memcpy threads of `upload_rows` (on first use)
        self.num_uploads = 0
        self.bytes_uploaded = 0
        self.keep_bytes = int(keep_bytes)
        self.kept_bytes = 0  # device bytes of kept uploads still alive (see `keep`)

    # ----------------------------------------------------------------------------- public
    def upload(self, src: torch.Tensor, dtype: torch.dtype, *,
               check_fits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A device copy of `src` cast to `dtype`, owned by the caller and usable on the current stream.

        Returns `(tensor, ok)`: `ok` is a device bool (`fits_dtype`) when `check_fits`, else None. The
        copy and the check run on the uploader's stream; read `ok` with `read_flags`, which waits for
        that stream only.
        """
        src = src.detach()
        if not self.cuda:
            out = src.to(dtype=dtype, copy=True)
            return out, (fits_dtype(src, dtype) if check_fits else None)
        consumer = torch.cuda.current_stream(self.device)
        self.num_uploads += 1
        if src.device.type == "cuda":  # already on a GPU: an ordinary stream-ordered copy
            out = src.to(device=self.device, dtype=dtype, copy=True)
            ok = None
            if check_fits:  # checked on the uploader's stream, after the caller's queued work
                self._stream.wait_stream(consumer)
                with torch.cuda.stream(self._stream):
                    ok = fits_dtype(src, dtype)
                src.record_stream(self._stream)
            return out, ok
        src = src.contiguous()
        with torch.cuda.stream(self._stream):
            staged = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            self._copy_many_in([src], staged)
            ok = fits_dtype(staged, dtype) if check_fits else None
            out = staged if src.dtype == dtype else staged.to(dtype)
            done = torch.cuda.Event()
            done.record(self._stream)
        consumer.wait_event(done)
        out.record_stream(consumer)
        return out, ok

    def upload_rows(self, srcs: list[torch.Tensor],
                    dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Tensors of one dtype and shape `(n_i, hidden)`, all on the host or all on this device, uploaded
        as one: the device tensor (cast to `dtype`), a view of it per source, and a device bool per source
        (`fits_dtype`'s verdict).

        Why: a call of 64 prompts paid, per prompt, an allocation, a copy launch, two events and four
        check kernels on the host's critical path before the first step. Here host rows stream through
        the ring into one device tensor (one copy per ring chunk; device rows: one concatenation), one
        row-wise min/max pass and a cumulative sum give every prompt's verdict, and one cast and one
        event cover the call. The views share the tensor's storage: it is freed when the last of them is.
        """
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            flat, ok, starts = self._rows_in(srcs, dtype, consumer)
            out = flat if flat.dtype == dtype else flat.to(dtype)
            done = torch.cuda.Event()
            done.record(self._stream)
        consumer.wait_event(done)
        out.record_stream(consumer)
        return out, [out[a:b] for a, b in zip(starts[:-1], starts[1:])], ok

    def check_rows(self, srcs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """`upload_rows`'s verdicts alone: the rows cross to the device and are checked there, and their
        device copy is dropped on the copy stream (the caller's stream never sees it, so its memory is
        free for the next upload at once). For prompts that will be uploaded again when admitted: a
        device check costs one pass of `memcpy`, a check on the CPU several passes over the rows."""
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            return self._rows_in(srcs, dtype, consumer)[1]

    def _rows_in(self, srcs: list[torch.Tensor], dtype: torch.dtype,
                 consumer: torch.cuda.Stream) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """On the copy stream (the caller's context): the sources' rows back to back on the device in
        their own dtype, a device bool per source (`fits_dtype` for `dtype`), and the row bounds.
        Sources already on the device are read after the work `consumer` has queued (which may be
        what wrote them), and kept alive for the copy stream."""
        srcs = [s.detach().contiguous() for s in srcs]
        hidden, src_dtype = srcs[0].shape[1], srcs[0].dtype
        starts = [0, *itertools.accumulate(s.shape[0] for s in srcs)]  # row bounds; the last is the total
        total = starts[-1]
        self.num_uploads += len(srcs)
        flat = torch.empty((total, hidden), dtype=src_dtype, device=self.device)
        if srcs[0].is_cuda:
            self._stream.wait_stream(consumer)
            torch.cat(srcs, dim=0, out=flat)
            for s in srcs:
                s.record_stream(self._stream)
        else:
            self._copy_many_in(srcs, flat)
        lo, hi = torch.aminmax(flat, dim=1) if total else (flat.new_zeros(0), flat.new_zeros(0))
        limit = limit_for(src_dtype, dtype)
        row_bad = ~((lo >= -limit) & (hi <= limit))  # NaN propagates to both ends and fails
        bad_before = torch.nn.functional.pad(row_bad.to(torch.int32).cumsum(0), (1, 0))
        bounds = torch.tensor(starts, dtype=torch.int64).to(self.device, non_blocking=True)
        ok = (bad_before[bounds[1:]] - bad_before[bounds[:-1]]) == 0  # no bad row in the span
        return flat, ok, starts

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory of the ring (0 until the first upload from the host)."""
        return 0 if self._ring is None else self._ring.numel()

    def keep(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (an upload) may stay on the device until its request runs: True while the
        kept uploads alive total at most `keep_bytes`. The bytes come back when `tensor` is freed."""
        n = tensor.numel() * tensor.element_size()
        if not self.cuda or self.kept_bytes + n > self.keep_bytes:
            return False
        self.kept_bytes += n
        weakref.finalize(tensor, self._give_back, n)
        return True

    def _give_back(self, n: int) -> None:
        self.kept_bytes -= n

    def read_flags(self, flags: list[torch.Tensor]) -> list[bool]:
        """The values of device bools from `upload(..., check_fits=True)`, waiting for the copy
        stream only (not for the steps queued on the compute stream)."""
        if not flags:
            return []
        if not self.cuda or flags[0].device.type != "cuda":
            return [bool(f) for f in flags]
        # Stacked on the copy stream, behind the checks that wrote the flags: stacked on the caller's
        # stream it raced them, and an idle compute stream read flags not yet written (a valid
        # prompt refused as NaN, seen once prefill steps ran from CUDA graphs and left it idle).
        with torch.cuda.stream(self._stream):
            return torch.stack(flags).cpu().tolist()

    def read_flag_tensor(self, flags: torch.Tensor | list[torch.Tensor]) -> list[bool]:
        """Device bools made on the copy stream (`upload_rows`' or `check_rows`' verdicts; several are
        read as one) as bools, waiting for that stream only."""
        with torch.cuda.stream(self._stream):  # the concatenation too: behind the checks
            return (torch.cat(flags) if isinstance(flags, list) else flags).cpu().tolist()

    # ----------------------------------------------------------------------------- the ring
    def _copy_many_in(self, srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
        """Copy the host tensors `srcs`, back to back, into `dst` (device, contiguous) through the ring,
        on the current (the uploader's) stream: each ring chunk gathers the pieces of every source it
        covers, then one device copy moves the chunk.

        The pieces are plain numpy memcpys (numpy releases the GIL while it copies), not torch's
        OpenMP-parallel copy, whose barrier waits for every thread and cost milliseconds when other
        processes kept the cores busy. An upload of `PARALLEL_COPY_BYTES` or more is filled by
        `COPY_THREADS` threads: one thread's memcpy is a fraction of the host's memory bandwidth.
        The threads get the pieces of half a ring's worth of chunks at once and this thread starts
        each chunk's device copy as soon as its pieces are in, so the threads never wait at a chunk
        boundary for the copy to be queued (with `PIPELINED_FILL` off: one chunk at a time)."""
        dst_bytes = dst.reshape(-1).view(torch.uint8)
        pieces = [s.reshape(-1).view(torch.uint8).numpy() for s in srcs]
        total = dst_bytes.numel()
        chunk = self.chunk_bytes
        threaded = total >= PARALLEL_COPY_BYTES and COPY_THREADS > 1
        # Half the ring per group: the next group fills the other half while this one's copies run.
        per_group = max(1, self.ring_bytes // chunk // 2) if threaded and PIPELINED_FILL else 1

        def fill(job: tuple[int, int, int, int]) -> None:
            start, src, first, length = job
            self._ring_np[start : start + length] = pieces[src][first : first + length]

        cursor = [0, 0]  # source index, offset inside it

        def jobs_for(lo: int, n: int) -> list[tuple[int, int, int, int]]:
            """The pieces of the next `n` source bytes, to ring offset `lo` on: at most PIECE_BYTES each."""
            jobs, filled = [], 0
            while filled < n:
                while cursor[1] == pieces[cursor[0]].size:  # empty sources, or the end of one
                    cursor[0], cursor[1] = cursor[0] + 1, 0
                take = min(n - filled, pieces[cursor[0]].size - cursor[1], PIECE_BYTES)
                jobs.append((lo + filled, cursor[0], cursor[1], take))
                filled, cursor[1] = filled + take, cursor[1] + take
            return jobs

        at = 0  # bytes of dst queued
        while at < total:
            sizes = []
            while len(sizes) < per_group and at + sum(sizes) < total:
                sizes.append(min(chunk, total - at - sum(sizes)))
            base = self._reserve(sum(sizes))  # one region for the group: its chunks never overlap
            chunks, lo = [], base  # (ring offset, bytes, the fills still running) of the group's chunks
            for n in sizes:
                jobs = jobs_for(lo, n)
                if threaded:
                    chunks.append((lo, n, [self._copy_pool().submit(fill, job) for job in jobs]))
                else:
                    for job in jobs:
                        fill(job)
                    chunks.append((lo, n, []))
                lo += n
            for lo, n, futures in chunks:
                for f in futures:
                    f.result()
                dst_bytes[at : at + n].copy_(self._ring[lo : lo + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
                self._pending.append((lo, lo + n, event))
                self.bytes_uploaded += n
                at += n

    def _copy_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="bridge-upload")
        return self._pool

    def _reserve(self, n: int) -> int:
        """The start of a free ring region of `n` bytes, waiting for the copies still reading it."""
        if self._ring is None:
            self._ring = torch.empty(self.ring_bytes, dtype=torch.uint8, pin_memory=True)
            self._ring_np = self._ring.numpy()
        lo = -(-self._head // _ALIGN) * _ALIGN
        if lo + n > self.ring_bytes:
            lo = 0
        hi = lo + n
        while self._pending and any(s < hi and lo < e for s, e, _ in self._pending):
            self._pending.popleft()[2].synchronize()
        self._head = hi
        return lo


__all__ = ["DEFAULT_KEEP_BYTES", "DEFAULT_RING_BYTES", "HostUploader"]
