"""L2 prefetch: the latency-bound kernels of a decode layer start the DRAM reads of the kernels after them.

Why: at W1's 64-row decode steps the GEMMs and norms between two attentions run at about a third of
the copy bandwidth (~35 us a layer for ~31 MB of weights, measured on an H200): each small kernel
waits out its launch, its ramp and a DRAM round trip, while the memory system idles. Decode attention
is the opposite: bandwidth-bound, about 151 MB of K/V a layer. Hopper's bulk prefetch
(`cp.async.bulk.prefetch.L2.global [addr], size`) asks the memory system to bring a whole range into
L2 without any thread waiting for it, so one instruction per chunk, issued from a kernel that is
there anyway, puts the idle bandwidth to work:

- the post-attention RMSNorm prefetches this layer's gate/up and down weights;
- SiLU*mul prefetches the next layer's q/k/v weight and the first K/V blocks of every request in the
  next layer's cache, up to a byte budget (`BRIDGE_L2_PREFETCH_KV_MB`), so next attention's first
  tiles hit L2.

A prefetch is a hint: it changes no value, so tokens are bitwise the same with it on or off; a range
that is evicted before its reader comes costs only the bandwidth. Addresses are computed on the host
for weights (a table of (address, bytes) chunks, rebuilt if a weight moves) and on the device for the
K/V blocks (from the step's block tables, so CUDA graphs replay it for any batch of their bucket).

The Triton interpreter has no inline assembly, so on the CPU the kernels are built without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.config import env_int

#: bytes of the next layer's K/V that SiLU*mul prefetches a step (0: none); read at import
KV_BUDGET_BYTES = env_int("BRIDGE_L2_PREFETCH_KV_MB", 0, 0) * 2**20
#: the norm and SiLU*mul prefetch the weights of the GEMMs after them (0: off); read at import
WEIGHTS = env_int("BRIDGE_L2_PREFETCH_WEIGHTS", 0, 0) > 0
#: steps of at most this many tokens prefetch (decode steps); read at import
MAX_ROWS = env_int("BRIDGE_L2_PREFETCH_MAX_ROWS", 64, 0)
#: one prefetch instruction covers at most this many bytes of a weight
CHUNK_BYTES = 32 * 1024
#: a kernel that prefetches runs at least this many programs, so the prefetches come from many SMs
MIN_PROGRAMS = 128
def enabled() -> bool:
    return KV_BUDGET_BYTES > 0 or WEIGHTS


def supported(device: torch.device) -> bool:
    """Bulk prefetch needs compute capability 9.0+ and compiled (not interpreted) kernels."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def _bulk_prefetch(addr, nbytes, mask):
    # One `cp.async.bulk.prefetch.L2` per element where mask is set; the int32 result is a dummy (an
    # inline asm must return something; is_pure=False keeps it).
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, nbytes, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_chunks(table_ptr, n_chunks, pid, nprog, VEC: tl.constexpr):
    """Program `pid` of `nprog` prefetches its share of a table of (address, bytes) int64 pairs."""
    per = tl.cdiv(n_chunks, nprog)
    lo = pid * per
    hi = tl.minimum(lo + per, n_chunks)
    for start in range(lo, hi, VEC):
        i = start + tl.arange(0, VEC)
        m = i < hi
        addr = tl.load(table_ptr + 2 * i, mask=m, other=0)
        size = tl.load(table_ptr + 2 * i + 1, mask=m, other=0).to(tl.int32)
        _bulk_prefetch(addr, size, m)


@triton.jit
def prefetch_kv_blocks(bt_ptr, seq_ptr, n_req, stride_bt, k_addr, v_addr, block_bytes, block_size, per_req,
                       pid, nprog, VEC: tl.constexpr):
    """Program `pid` of `nprog` prefetches its share of the first `per_req` K and V blocks of every
    request (only blocks holding some of its `seq_lens` tokens): block b's K sits at
    `k_addr + b * block_bytes`, its V at `v_addr + b * block_bytes`."""
    n_items = n_req * per_req
    per = tl.cdiv(n_items, nprog)
    lo = pid * per
    hi = tl.minimum(lo + per, n_items)
    for start in range(lo, hi, VEC):
        i = start + tl.arange(0, VEC)
        m = i < hi
        r = i // per_req
        j = i % per_req
        seq = tl.load(seq_ptr + r, mask=m, other=0)
        m = m & (j * block_size < seq)
        blk = tl.load(bt_ptr + r.to(tl.int64) * stride_bt + j, mask=m, other=0).to(tl.int64)
        size = tl.zeros_like(j) + block_bytes
        _bulk_prefetch(k_addr + blk * block_bytes, size, m)
        _bulk_prefetch(v_addr + blk * block_bytes, size, m)


def chunk_table(tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """(address, bytes) int64 pairs covering each contiguous tensor's storage in chunks of at most
    `chunk_bytes` (16-byte multiples, as the instruction requires), on the tensors' device."""
    rows: list[tuple[int, int]] = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("prefetch ranges must be contiguous tensors")
        start, nbytes = t.data_ptr(), t.numel() * t.element_size()
        end = start + nbytes
        start -= start % 16
        for a in range(start, end, chunk_bytes):
            size = min(chunk_bytes, end - a)
            rows.append((a, -(-size // 16) * 16))
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)


class WeightPrefetch:
    """A chunk table for the weights `tensors()` returns, rebuilt when any of them moves (a `.to()`, a
    reload)."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]]) -> None:
        self.tensors = tensors
        self._key: tuple[int, ...] = ()
        self._table: torch.Tensor | None = None

    def table(self) -> torch.Tensor:
        tensors = self.tensors()
        key = tuple(t.data_ptr() for t in tensors)
        if key != self._key or self._table is None:
            self._table = chunk_table(tensors)
            self._key = key
        return self._table


@dataclass
class KVPrefetch:
    """The first blocks of each request in one layer's K/V cache, as `prefetch_kv_blocks` reads them."""

    block_tables: torch.Tensor  # (num_reqs, max_blocks) int32
    seq_lens: torch.Tensor  # (num_reqs,) int32
    key_cache: torch.Tensor  # (num_blocks, block_size, kv_heads, head_dim)
    value_cache: torch.Tensor
    per_req: int  # blocks a request

    @classmethod
    def for_budget(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, budget_bytes: int) -> KVPrefetch | None:
        """Up to `budget_bytes` of K and V in all, the same number of blocks for every request row."""
        n_req = block_tables.shape[0]
        block_bytes = key_cache.stride(0) * key_cache.element_size()
        if n_req == 0 or budget_bytes <= 0 or key_cache.stride(0) != value_cache.stride(0):
            return None
        per_req = min(block_tables.shape[1], budget_bytes // (2 * block_bytes * n_req))
        if per_req <= 0:
            return None
        return cls(block_tables, seq_lens, key_cache, value_cache, per_req)

    def args(self) -> tuple:
        kc = self.key_cache
        return (self.block_tables, self.seq_lens, self.block_tables.shape[0], self.block_tables.stride(0),
                kc.data_ptr(), self.value_cache.data_ptr(), kc.stride(0) * kc.element_size(), kc.shape[1],
                self.per_req)


@triton.jit
def _prefetch_kernel(table_ptr, n_chunks, bt_ptr, seq_ptr, n_req, stride_bt, k_addr, v_addr, block_bytes,
                     block_size, per_req, HAS_TABLE: tl.constexpr, HAS_KV: tl.constexpr, VEC: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if HAS_TABLE:
        prefetch_chunks(table_ptr, n_chunks, pid, nprog, VEC)
    if HAS_KV:
        prefetch_kv_blocks(bt_ptr, seq_ptr, n_req, stride_bt, k_addr, v_addr, block_bytes, block_size,
                           per_req, pid, nprog, VEC)


def prefetch_args(table: torch.Tensor | None, kv: KVPrefetch | None,
                  device: torch.device) -> tuple[tuple, dict]:
    """The eleven prefetch arguments and the HAS_TABLE / HAS_KV constexprs of a kernel that calls
    `prefetch_chunks` / `prefetch_kv_blocks` (dummies for the parts that are None)."""
    dummy = _dummy(device)
    t_args = (table, table.shape[0]) if table is not None else (dummy, 0)
    kv_args = kv.args() if kv is not None else (dummy, dummy, 0, 0, 0, 0, 0, 1, 1)
    return (*t_args, *kv_args), {"HAS_TABLE": table is not None, "HAS_KV": kv is not None}


_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    # One allocation per device, so a kernel without prefetches allocates nothing per call.
    if device not in _DUMMIES:
        _DUMMIES[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _DUMMIES[device]


def prefetch(table: torch.Tensor | None, kv: KVPrefetch | None, programs: int = MIN_PROGRAMS) -> None:
    """A launch that only prefetches (benchmarks and tests; the engine folds the same code into its
    norm and SiLU*mul kernels)."""
    from runner.layers.triton_launch import launch

    if table is None and kv is None:
        return
    device = (table if table is not None else kv.block_tables).device
    args, consts = prefetch_args(table, kv, device)
    launch(_prefetch_kernel, (programs,))(*args, **consts, VEC=32, num_warps=1)
