"""The structural protocol through which the runner runs encoders it knows nothing about.

The runner never imports `encoders/` (docs/ARCHITECTURE.md, "Import rules"). Anything that has these five
members can be handed to the runner: a real vision/audio/graph encoder, a streaming encoder for
realtime models, or a tiny test double. `"prompt_embeds"` is the built-in passthrough modality:
its item is already an `(n, hidden)` tensor, so it needs no encoder and is never given one.

Also here: the content hash of a tensor, which is the identifier of a passthrough item in the
encoder cache (and a convenient `content_hash` for encoders whose items are tensors), one at a
time or a whole call's items at once (`tensor_content_hashes`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import torch

PROMPT_EMBEDS_MODALITY = "prompt_embeds"
"""The passthrough modality: the item is an `(n, hidden)` tensor that goes straight into the cache."""


@runtime_checkable
class EncoderProtocol(Protocol):
    """What the runner needs from an encoder.

    - `modality`: the name placeholders and `multi_modal_data` use ("image", "audio", "graph", ...).
    - `is_realtime`: the encoder feeds a live request while it decodes (streaming audio); the
      runner then gathers encoder rows for decode steps too.
    - `num_rows(item)`: rows `encode` will produce for the item. Asked before anything runs, so
      that placeholders expand to their final length when the prompt is processed.
    - `content_hash(item)`: a stable identifier of the item's content; equal content -> equal
      hash, so a repeated item is encoded once and served from the encoder cache.
    - `encode(items)`: one batched call; returns one `(num_rows(item), hidden)` tensor per item,
      on the model device (no serialization, no host round trip).
    """

    modality: str
    is_realtime: bool

    def num_rows(self, item: Any) -> int: ...

    def content_hash(self, item: Any) -> str: ...

    def encode(self, items: list[Any]) -> list[torch.Tensor]: ...


def _check_hashable(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor_content_hash expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor_content_hash expects a dense tensor, got layout {tensor.layout}")


def tensor_content_hash(tensor: torch.Tensor) -> str:
    """sha256 (hex) over a tensor's dtype, shape and raw bytes: the identity of a passthrough item.

    dtype and shape are part of the hash, so the same bytes reinterpreted (fp16 vs bf16, or
    (4, 8) vs (8, 4)) never collide. Cost: 0.3-2 GB/s of hashing on one CPU core (OpenSSL's
    sha256, fastest on CPUs with SHA extensions; a 512 x 4096 bf16 tensor is 4 MiB). A tensor on
    the host is hashed in place without a copy (a non-contiguous one is first made contiguous). A
    tensor on an accelerator is first copied to the host, which is a device synchronisation plus a
    device-to-host copy of its bytes: hash where the tensor is still on the host (e.g. right after
    the wire format decoded it) when you can; an in-process encoder should hash its raw input, not
    its output. Many tensors at once: `tensor_content_hashes` (same digests, costs paid once).
    """
    return tensor_content_hashes([tensor])[0]


#: below this many bytes in all, hashing on the calling thread beats handing work to the pool
_PARALLEL_MIN_BYTES = 2 << 20
#: pinned host memory that CUDA tensors are staged through for hashing, per group of tensors (the
#: caching host allocator keeps what it pinned, so a group is bounded, not a whole call)
_STAGING_BYTES = 64 << 20
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def _hash_workers() -> int:
    """Threads that hash at once (the caller's included): the CPUs this process may run on, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(8, cpus or 1)


def _hash_pool() -> ThreadPoolExecutor:
    """A process-wide pool for hashing beside the calling thread. hashlib releases the GIL while
    it digests a large buffer, so several tensors hash at once on several cores. Made again after
    a fork: a forked child (a DataLoader worker) inherits the pool object but not its threads."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=_hash_workers() - 1, thread_name_prefix="bridge-hash")
            _pool_pid = os.getpid()
        return _pool


def _digests(jobs: Sequence[tuple[bytes, Any]]) -> list[str]:
    out = []
    for header, data in jobs:
        digest = hashlib.sha256(header)
        if data is not None:
            digest.update(data)
        out.append(digest.hexdigest())
    return out


def tensor_content_hashes(tensors: Sequence[torch.Tensor]) -> list[str]:
    """`[tensor_content_hash(t) for t in tensors]` (the same digests), with the host costs of a
    batch paid once rather than per tensor.

    Why: a call of 64 requests with a 256-row passthrough item each hashed 32 MiB item by item,
    one device synchronisation per accelerator tensor, and the same tensor object once per request
    that reused it. Here a tensor object met twice is hashed once; CUDA tensors are copied into
    pinned host memory without blocking and waited for once per group (`_STAGING_BYTES`); and
    the digests are spread over the calling thread and a small pool (hashlib releases the GIL
    for large buffers) when the batch is big enough. A tensor must not be modified while this
    runs (as for any read of it).
    """
    for tensor in tensors:
        _check_hashable(tensor)
    slot_of: dict[int, int] = {}  # id(tensor) -> its job; `tensors` keeps every object alive
    headers: list[bytes] = []
    sources: list[torch.Tensor | None] = []
    for tensor in tensors:
        if id(tensor) in slot_of:
            continue
        slot_of[id(tensor)] = len(headers)
        flat = tensor.detach().contiguous().reshape(-1)
        headers.append(f"{flat.dtype}|{tuple(tensor.shape)}|".encode())
        # uint8 view: numpy has no bfloat16, and a byte view hashes every dtype the same way.
        sources.append(flat.view(torch.uint8) if flat.numel() else None)
    digests: list[str] = [""] * len(headers)
    for group in _staging_groups(sources):
        data = _host_bytes([sources[k] for k in group])
        for k, digest in zip(group, _hash_group([headers[k] for k in group], data)):
            digests[k] = digest
    return [digests[slot_of[id(tensor)]] for tensor in tensors]


def _staging_groups(sources: Sequence[torch.Tensor | None]) -> list[list[int]]:
    """Indices of `sources` in groups whose CUDA bytes fit the staging bound together (host
    tensors need no staging: they all go in the first group)."""
    groups: list[list[int]] = [[]]
    staged = 0
    for k, src in enumerate(sources):
        n = 0 if src is None or src.device.type != "cuda" else src.numel()
        if n and staged + n > _STAGING_BYTES and staged:
            groups.append([])
            staged = 0
        groups[-1].append(k)
        staged += n
    return groups


def _host_bytes(sources: Sequence[torch.Tensor | None]) -> list[Any]:
    """numpy views of flat uint8 tensors' bytes on the host. Host tensors are viewed in place;
    CUDA tensors are copied into one pinned buffer on their device's current stream (non-blocking)
    and waited for once per device; other accelerators, or a CUDA tensor larger than the staging
    bound, are copied one at a time."""
    staged = [k for k, src in enumerate(sources)
              if src is not None and src.device.type == "cuda" and src.numel() <= _STAGING_BYTES]
    buffer = None
    if staged:
        buffer = torch.empty(sum(sources[k].numel() for k in staged), dtype=torch.uint8, pin_memory=True)
    host: list[Any] = []
    waits: dict[torch.device, torch.cuda.Stream] = {}
    at = 0
    staged_set = set(staged)
    for k, src in enumerate(sources):
        if src is None:
            host.append(None)
        elif src.device.type == "cpu":
            host.append(src.numpy())
        elif k in staged_set:
            dst = buffer[at : at + src.numel()]
            at += src.numel()
            dst.copy_(src, non_blocking=True)
            waits.setdefault(src.device, torch.cuda.current_stream(src.device))
            host.append(dst)
        else:
            host.append(src.to("cpu").numpy())
    for stream in waits.values():
        stream.synchronize()
    return [h.numpy() if isinstance(h, torch.Tensor) else h for h in host]


def _hash_group(headers: Sequence[bytes], data: Sequence[Any]) -> list[str]:
    """Digests of (header, bytes) jobs: on the calling thread, or dealt round-robin over it and the
    pool when there is enough to hash."""
    jobs = list(zip(headers, data))
    total = sum(0 if d is None else d.nbytes for d in data)
    workers = min(_hash_workers(), len(jobs))
    if workers < 2 or total < _PARALLEL_MIN_BYTES:
        return _digests(jobs)
    shares = [jobs[w::workers] for w in range(workers)]
    pool = _hash_pool()
    futures = [pool.submit(_digests, share) for share in shares[1:]]
    results = [_digests(shares[0]), *(f.result() for f in futures)]
    out: list[str] = [""] * len(jobs)
    for w, digests in enumerate(results):
        out[w::workers] = digests
    return out


def check_encoders(encoders: Mapping[str, Any] | None) -> dict[str, EncoderProtocol]:
    """Validate an `encoders={modality: encoder}` mapping once, when the engine is built.

    Raises ValueError naming the offending entry: an object missing protocol members, a key
    that disagrees with the encoder's own `modality`, or an encoder registered for the
    passthrough modality (which never runs an encoder).
    """
    checked: dict[str, EncoderProtocol] = {}
    for modality, encoder in (encoders or {}).items():
        if modality == PROMPT_EMBEDS_MODALITY:
            raise ValueError(
                f"modality {PROMPT_EMBEDS_MODALITY!r} is the built-in passthrough and takes no encoder"
            )
        if not isinstance(encoder, EncoderProtocol):
            missing = [
                name
                for name in ("modality", "is_realtime", "num_rows", "content_hash", "encode")
                if not hasattr(encoder, name)
            ]
            raise ValueError(
                f"encoder for {modality!r} ({type(encoder).__name__}) does not meet the encoder "
                f"protocol; missing: {', '.join(missing)}"
            )
        if encoder.modality != modality:
            raise ValueError(f"encoder registered as {modality!r} declares modality {encoder.modality!r}")
        checked[modality] = encoder
    return checked
