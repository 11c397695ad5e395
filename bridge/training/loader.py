"""Micro-batches built ahead of the step, so the GPU does not wait on the host.

Two overlaps:

- Host: `torch.utils.data.DataLoader` worker processes (`train.num_workers`) draw the examples,
  preprocess the media, tokenize and collate (`collate_examples`) micro-batches ahead of the
  step, `train.prefetch_factor` each; on CUDA the loader pins them (`pin_memory`).
- Device: while step k runs, micro-batch k + 1 is copied to the GPU on a side CUDA stream
  (`non_blocking` from pinned memory). The step's stream waits on that copy's event only when it
  reaches the batch (`wait_event`), and every tensor of the batch is marked as used by the step's
  stream (`record_stream`), so the caching allocator never hands its memory to another tensor
  while the step may still read it.

Exact determinism, whatever the worker count: micro-batch m is a pure function of m. The sampler
gives its dataset indices (sampler.py: seeded, rank-sliced, so DDP / FSDP sharding is unchanged),
the synthetic sets make item i from its own seeded stream, preprocessing and tokenizing are
deterministic, and the loader never draws from the global torch RNG (it gets its own generator).
Micro-batches arrive in order (the DataLoader keeps its sampler's order), so num_workers=0 and
num_workers=N give the same batches and the same losses.

The frozen-tower cache (`train.cache_tower_outputs`) lives in the training process, which a
worker cannot see. A worker knows it anyway: the cache holds exactly the items of every
micro-batch this stream has handed out (plus what it held when the stream started), so
`MicroBatchBuilder` replays the sampler's indices up to m (index lists only, cheap) and skips the
preprocessing of those items, as the in-process collate would. Each batch is checked against the
real cache before it is used; a batch that asks for a missing entry is rebuilt in the process.

Workers are forked (Linux): the datasets, tokenizer and encoders are inherited, never pickled,
and the workers touch no CUDA (preprocessing is CPU work). Where fork is unavailable the builder
must pickle, and weights on a GPU cannot go to spawned workers; then, or when a batch cannot be
sent back from a worker (unpicklable collated inputs) or preprocessing makes device tensors, the
batches are built in the training process and one line says why.

Timing (`StepTiming`): the trainer records each step's wall time and the time it waited for data:
host time blocked on the loader (fetching the next micro-batch and queuing its copy, or building
it in-process with 0 workers; an upper bound of what the GPU waits, since the step's kernels are
already queued while the host fetches) plus the device time the step's stream waited for a copy
(CUDA events). `data_wait_fraction` is their ratio.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from bridge.training.batching import TrainBatch, collate_examples
from bridge.training.sampler import ResumableSampler

__all__ = [
    "BatchStream",
    "MicroBatchBuilder",
    "StepTiming",
    "default_num_workers",
    "resolve_num_workers",
]

#: the auto worker count's ceiling: decoding and preprocessing a micro-batch of images on one core
#: takes several short steps' time, and four workers keep ahead of the steps the trainer runs
MAX_AUTO_WORKERS = 4


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_num_workers(device: torch.device) -> int:
    """`train.num_workers: null`: 0 on the CPU (the step itself needs the cores, and tests stay
    deterministic and cheap), else min(4, CPUs per rank on this host - 1)."""
    if torch.device(device).type != "cuda":
        return 0
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(0, min(MAX_AUTO_WORKERS, _cpus() // local_ranks - 1))


def resolve_num_workers(requested: int | None, device: torch.device) -> int:
    return default_num_workers(device) if requested is None else int(requested)


@dataclass
class StepTiming:
    """Totals over the steps since the last `reset`: optimizer steps, their wall time and the part
    of it spent waiting for data (host blocked on the loader + device waiting for copies)."""

    steps: int = 0
    step_s: float = 0.0
    data_wait_s: float = 0.0

    @property
    def data_wait_fraction(self) -> float:
        return self.data_wait_s / self.step_s if self.step_s > 0 else 0.0

    def reset(self) -> None:
        self.steps, self.step_s, self.data_wait_s = 0, 0.0, 0.0


class _CachedBefore(Container):
    """The tower cache as it will be when micro-batch m is used: what it held when the stream
    started, plus every item of the micro-batches handed out before m."""

    def __init__(self, initial: frozenset, seen: set[int]):
        self.initial, self.seen = initial, seen

    def __contains__(self, key: object) -> bool:
        return key in self.initial or (isinstance(key, tuple) and key[1] in self.seen)


class MicroBatchBuilder:
    """micro_step -> (micro_step, TrainBatch on the CPU): the same function in the training process
    and in a loader worker. `cache_keys` is the tower cache's key set when the stream starts at
    micro-step `start` (None: no tower cache)."""

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        encoders: Mapping[str, Any],
        sampler: ResumableSampler,
        *,
        start: int,
        cache_keys: frozenset | None = None,
        collate_options: Mapping[str, Any] | None = None,
    ):
        self.dataset = dataset
        #: keyword arguments of collate_examples (the run's packing)
        self.collate_options = dict(collate_options or {})
        self.tokenizer = tokenizer
        self.encoders = encoders
        self.sampler = sampler
        self.start = start
        self.cache_keys = cache_keys
        self._seen: set[int] = set()
        self._seen_upto = start  # _seen holds the indices of micro-batches [start, _seen_upto)

    def cached_before(self, micro_step: int) -> Container | None:
        if self.cache_keys is None:
            return None
        if micro_step < self._seen_upto:  # asked out of order: replay from the start
            self._seen, self._seen_upto = set(), self.start
        for m in range(self._seen_upto, micro_step):
            self._seen.update(self.sampler.micro_batch(m))
        self._seen_upto = max(self._seen_upto, micro_step)
        return _CachedBefore(self.cache_keys, self._seen)

    def build(self, micro_step: int, cached: Container | None) -> TrainBatch:
        indices = self.sampler.micro_batch(micro_step)
        examples = [self.dataset[i] for i in indices]
        return collate_examples(
            examples, self.tokenizer, self.encoders, keys=indices, cached=cached, **self.collate_options
        )

    def __call__(self, micro_step: int) -> tuple[int, TrainBatch]:
        return micro_step, self.build(micro_step, self.cached_before(micro_step))


class _MicroBatches(torch.utils.data.Dataset):
    """Map-style view for the DataLoader: item m is micro-batch m (no auto-batching)."""

    def __init__(self, builder: MicroBatchBuilder):
        self.builder = builder

    def __getitem__(self, micro_step: int) -> tuple[int, TrainBatch]:
        return self.builder(micro_step)


def _as_is(item: Any) -> Any:
    return item


def _cache_miss(batch: TrainBatch, cache: Container | None) -> bool:
    """True when the batch skipped preprocessing an item the real tower cache does not hold."""
    if cache is None or batch.item_keys is None:
        return False
    for modality, keys in batch.item_keys.items():
        fresh = set(batch.new_keys[modality])
        if any(k not in fresh and k not in cache for k in keys):
            return True
    return False


def _worker_problem(
    builder: MicroBatchBuilder, first: tuple[int, TrainBatch]
) -> tuple[str | None, str | None]:
    """(why workers cannot be used or None, the multiprocessing start method)."""
    if any(t.device.type != "cpu" for t in first[1].tensors()):
        return "preprocessing made device tensors, which a forked worker cannot", None
    try:
        pickle.dumps(first)  # what a worker sends back
    except Exception as exc:  # noqa: BLE001 (any pickling failure means: no workers)
        return f"a collated batch cannot be sent from a worker process ({type(exc).__name__}: {exc})", None
    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        return None, "fork"
    on_device = [
        name
        for name, enc in builder.encoders.items()
        if isinstance(enc, torch.nn.Module) and any(p.device.type != "cpu" for p in enc.parameters())
    ]
    if on_device:
        return (
            f"this platform has no fork, and the {', '.join(on_device)} encoder weights are on the "
            "device, so spawned workers cannot receive them",
            None,
        )
    try:
        pickle.dumps(builder)
    except Exception as exc:  # noqa: BLE001
        return f"the dataset / tokenizer / encoders cannot be pickled for spawned workers ({exc})", None
    return None, None  # the platform's default start method (spawn)


class BatchStream:
    """Device-ready micro-batches for micro-steps start, start + 1, ..., end - 1, in order.

    `next()` hands out the next micro-batch (on the device); `prefetch()` fetches the one after it
    from the loader and queues its copy to the device on the side stream; the trainer calls it
    once the current micro-step's kernels are queued. `settle()` (after the step's host sync)
    turns finished copy events into device wait time."""

    def __init__(
        self,
        builder: MicroBatchBuilder,
        start: int,
        end: int,
        device: torch.device,
        *,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        seed: int = 0,
        cache: Container | None = None,
        say: Callable[[str], None] | None = None,
    ):
        if end <= start:
            raise ValueError(f"BatchStream needs end > start, got [{start}, {end})")
        self.builder = builder
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.end = end
        self.cache = cache
        self.next_micro = start  # what next() returns
        self._fetch_micro = start  # what the next fetch brings
        self.host_wait_s = 0.0
        self.device_wait_s = 0.0
        self.rebuilt = 0  # batches rebuilt in-process after a tower-cache mismatch (expected: 0)
        self.num_workers = 0
        self._say = say
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._ready: tuple[int, TrainBatch, Any] | None = None
        self._first: tuple[int, TrainBatch] | None = None
        self._loader = None
        self._iter = None
        if num_workers > 0 and end - start > 1:
            t0 = time.perf_counter()
            # the first micro-batch is built here: it starts the step at once and shows whether
            # batches can come back from a worker
            self._first = builder(start)
            self.host_wait_s += time.perf_counter() - t0
            problem, context = _worker_problem(builder, self._first)
            if problem is None:
                try:
                    self._loader = torch.utils.data.DataLoader(
                        _MicroBatches(builder),
                        batch_size=None,
                        sampler=range(start + 1, end),
                        num_workers=num_workers,
                        collate_fn=_as_is,
                        pin_memory=self.cuda,
                        persistent_workers=True,
                        prefetch_factor=prefetch_factor,
                        multiprocessing_context=context,
                        generator=torch.Generator().manual_seed(seed),  # never the global RNG
                    )
                    self._iter = iter(self._loader)
                    self.num_workers = num_workers
                except Exception as exc:  # noqa: BLE001 (workers failed to start: build in-process)
                    problem = f"loader workers failed to start ({type(exc).__name__}: {exc})"
                    self._loader = self._iter = None
            if problem is not None and say is not None:
                say(f"data: {problem}; building batches in the training process (train.num_workers=0)")

    # ---------------------------------------------------------------- host side
    def _fetch_host(self) -> tuple[int, TrainBatch]:
        if self._first is not None:
            item, self._first = self._first, None
        elif self._iter is not None:
            try:
                item = next(self._iter)
            except Exception as exc:  # noqa: BLE001
                # a worker failed (a bad item, a killed process): stop the workers and build this
                # micro-batch here, so a data error is raised as the in-process path raises it
                # (its own type and message, not wrapped in the worker's traceback)
                self._stop_workers()
                if self._say is not None:
                    self._say(
                        f"data: a loader worker failed on micro-batch {self._fetch_micro} "
                        f"({type(exc).__name__}); building batches in the training process from here"
                    )
                item = self.builder(self._fetch_micro)
        else:
            item = self.builder(self._fetch_micro)
        micro = item[0]
        if micro != self._fetch_micro:
            raise RuntimeError(
                f"data loader out of order: got micro-batch {micro}, expected {self._fetch_micro}"
            )
        self._fetch_micro += 1
        return item

    def prefetch(self) -> None:
        """Fetch the next micro-batch and queue its copy to the device (no-op if one is ready or
        the stream is at its end)."""
        if self._ready is not None or self._fetch_micro >= self.end:
            return
        t0 = time.perf_counter()
        micro, batch = self._fetch_host()
        copied = None
        if self.cuda:
            with torch.cuda.stream(self._side):
                batch.to(self.device)
                copied = torch.cuda.Event(enable_timing=True)
                copied.record(self._side)
        else:
            batch.to(self.device)
        self._ready = (micro, batch, copied)
        self.host_wait_s += time.perf_counter() - t0

    def next(self) -> TrainBatch:
        if self._ready is None:
            if self._fetch_micro >= self.end:
                raise RuntimeError(f"the batch stream ends at micro-step {self.end}")
            self.prefetch()
        micro, batch, copied = self._ready
        self._ready = None
        if _cache_miss(batch, self.cache):  # checked at the point of use, against the real cache
            t0 = time.perf_counter()
            self.rebuilt += 1
            if self.rebuilt == 1 and self._say is not None:
                self._say(
                    f"data: micro-batch {micro} skipped items the tower cache does not hold; rebuilt "
                    "in the training process"
                )
            batch = self.builder.build(micro, self.cache).to(self.device)  # on the step's stream
            copied = None
            self.host_wait_s += time.perf_counter() - t0
        if copied is not None:
            main = torch.cuda.current_stream(self.device)
            reached = torch.cuda.Event(enable_timing=True)
            reached.record(main)
            main.wait_event(copied)
            for t in batch.tensors():
                if t.device.type == "cuda":
                    t.record_stream(main)
            self._pending.append((reached, copied))
        self.next_micro = micro + 1
        return batch

    # ---------------------------------------------------------------- device side
    def settle(self) -> None:
        """Add the device wait of every finished copy: how long the step's stream, having reached
        the batch, still waited for its copy (copy done - reached, when positive)."""
        still = []
        for reached, copied in self._pending:
            if reached.query() and copied.query():
                self.device_wait_s += max(0.0, reached.elapsed_time(copied)) / 1e3
            else:
                still.append((reached, copied))
        self._pending = still

    def take_wait(self) -> float:
        """Seconds waited for data since the last call (host + settled device wait)."""
        waited = self.host_wait_s + self.device_wait_s
        self.host_wait_s = self.device_wait_s = 0.0
        return waited

    def _stop_workers(self) -> None:
        it, self._iter, self._loader = self._iter, None, None
        self.num_workers = 0
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def close(self) -> None:
        """Stop the loader workers now (they would stop with the process anyway)."""
        self._stop_workers()
        self._ready = self._first = None
