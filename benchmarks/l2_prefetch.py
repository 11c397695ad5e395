"""L2 prefetch of a decode layer's next reads: lost in the engine, not kept; why, measured alone (GPU).

The idea (fifteenth session): at W1's 64-row decode steps the GEMMs and norms between two attentions are
latency-bound (~35 us a layer for ~31 MB of weights on an H200) while the memory system idles, and
decode attention after them is bandwidth-bound (~151 MB of K/V a layer). Hopper's bulk prefetch
(`cp.async.bulk.prefetch.L2.global [addr], size`) asks for a whole range to be brought into L2 with no
thread waiting for it, so the engine's post-attention RMSNorm issued one per 32 KB chunk of gate/up's and
down's weights, and SiLU*mul one per K/V block for the first blocks of every request in the next layer's
cache (up to a byte budget) and for the next layer's q/k/v weight. Tokens were bitwise equal (a prefetch
changes no value), and it was slower every way (`decode_batches.py --batches 64 --repeats 7`, commit
3f42688, logs `benchmarks/logs/s15a_*`): K/V 24 MB 0.987x, K/V 40 MB 0.966x, weights 0.980x.

This script asks why, each case a CUDA-graph replay over 28 layers (distinct weights and K/V, so nothing
is hot from the layer before), with a spin kernel between the prefetch and its reader so the prefetch
has time to land:

- attention over W1's batch (64 requests x 560-600 keys, the engine's cache layout): spin + attention,
  against prefetch of the first X MB of that layer's K/V + spin + attention;
- a 64-row gate/up GEMM (cuBLAS): spin + GEMM, against prefetch of its weight + spin + GEMM, and against
  the same GEMM run twice (the second from L2 if anything is);
- the prefetch launch alone.

    python benchmarks/l2_prefetch.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from decode_attention import BLOCK, HEAD_DIM, KV_HEADS, Q_HEADS, decode_metadata  # noqa: E402
from skinny_gemm import graph_time  # noqa: E402

import runner.layers.paged_attention_triton as pat  # noqa: E402
from runner.layers.triton_launch import launch  # noqa: E402

#: one prefetch instruction covers at most this many bytes of a weight
CHUNK_BYTES = 32 * 1024
LAYERS = 28


@triton.jit
def _bulk_prefetch(addr, nbytes, mask):
    # One `cp.async.bulk.prefetch.L2` per element where mask is set; the int32 result is a dummy (an
    # inline asm must return something; is_pure=False keeps it).
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, nbytes, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _share(n_items, pid, nprog):
    """Program `pid` of `nprog`'s contiguous share [lo, hi) of `n_items` items."""
    per = tl.cdiv(n_items, nprog)
    lo = pid * per
    return lo, tl.minimum(lo + per, n_items)


@triton.jit
def prefetch_chunks(table_ptr, n_chunks, pid, nprog, VEC: tl.constexpr):
    """Program `pid` of `nprog` prefetches its share of a table of (address, bytes) int64 pairs."""
    lo, hi = _share(n_chunks, pid, nprog)
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
    lo, hi = _share(n_req * per_req, pid, nprog)
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


def prefetch(table: torch.Tensor | None, kv: KVPrefetch | None, programs: int = 128) -> None:
    """One launch of `programs` one-warp programs that only prefetch."""
    device = (table if table is not None else kv.block_tables).device
    dummy = torch.zeros(1, dtype=torch.int32, device=device)
    t_args = (table, table.shape[0]) if table is not None else (dummy, 0)
    kv_args = kv.args() if kv is not None else (dummy, dummy, 0, 0, 0, 0, 0, 1, 1)
    launch(_prefetch_kernel, (programs,))(*t_args, *kv_args, HAS_TABLE=table is not None,
                                          HAS_KV=kv is not None, VEC=32, num_warps=1)


def spin(us: float) -> None:
    torch.cuda._sleep(int(us * 1e-6 * CLOCK_HZ))


CLOCK_HZ = 1.98e9


def attention_rows(budgets_mb: list[int], spin_us: float) -> list[dict]:
    specs = [random.Random(1).randint(560, 600) for _ in range(64)]
    need = sum(-(-s // BLOCK) for s in specs)
    kv_bytes = sum(specs) * 2 * KV_HEADS * HEAD_DIM * 2
    store = torch.randn((LAYERS, 2, need + 64, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16,
                        device="cuda")
    caches = [(store[i, 0], store[i, 1]) for i in range(LAYERS)]
    meta = decode_metadata(specs, first_block=1)
    q = torch.randn(len(specs), Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    rows = []

    def body(budget: int, with_spin: bool = True):
        def run():
            for kc, vc in caches:
                if budget:
                    prefetch(None, KVPrefetch.for_budget(meta.block_tables, meta.seq_lens, kc, vc, budget))
                if with_spin:
                    spin(spin_us)
                pat.paged_attention_triton(q, kc, vc, meta, scale, out)
        return run

    base = graph_time(body(0), replays=20) / LAYERS * 1e6
    alone = graph_time(body(0, with_spin=False), replays=20) / LAYERS * 1e6
    spin_only = graph_time(lambda: [spin(spin_us) for _ in range(LAYERS)], replays=20) / LAYERS * 1e6
    rows.append({"case": "attention", "variant": "alone", "us": round(alone, 2),
                 "kv_mb": round(kv_bytes / 2**20, 1)})
    rows.append({"case": "attention", "variant": f"spin {spin_us:g} us + attention", "us": round(base, 2),
                 "spin_us": round(spin_only, 2)})
    print(f"  attention alone {alone:.2f} us/layer ({kv_bytes / 2**20:.0f} MB of K/V); spin {spin_only:.2f}; "
          f"spin + attention {base:.2f}", flush=True)
    for mb in budgets_mb:
        us = graph_time(body(mb << 20), replays=20) / LAYERS * 1e6
        rows.append({"case": "attention", "variant": f"prefetch {mb} MB + spin + attention",
                     "us": round(us, 2), "saved_us": round(base - us, 2)})
        print(f"  prefetch {mb:3d} MB + spin + attention {us:7.2f} us/layer: saves {base - us:+.2f} us "
              f"(the bytes' share at the same rate: {alone * (mb << 20) / kv_bytes:.2f})", flush=True)
    return rows


def gemm_rows(spin_us: float) -> list[dict]:
    weights = [torch.randn(6144, 1024, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(LAYERS)]
    tables = [chunk_table([w]) for w in weights]
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    rows = []

    def run(pre: bool, twice: bool):
        def body():
            for w, t in zip(weights, tables):
                if pre:
                    prefetch(t, None)
                spin(spin_us)
                torch.mm(x, w.t())
                if twice:
                    torch.mm(x, w.t())
        return body

    base = graph_time(run(False, False), replays=20) / LAYERS * 1e6
    pre = graph_time(run(True, False), replays=20) / LAYERS * 1e6
    twice = graph_time(run(False, True), replays=20) / LAYERS * 1e6
    only = graph_time(lambda: [prefetch(t, None) for t in tables], replays=20) / LAYERS * 1e6
    rows += [{"case": "gate/up 64x6144x1024", "variant": "spin + mm", "us": round(base, 2)},
             {"case": "gate/up 64x6144x1024", "variant": "prefetch + spin + mm", "us": round(pre, 2),
              "saved_us": round(base - pre, 2)},
             {"case": "gate/up 64x6144x1024", "variant": "spin + mm + mm (second mm)",
              "us": round(twice - base, 2)},
             {"case": "prefetch 12 MB of weight", "variant": "launch alone", "us": round(only, 2)}]
    print(f"  gate/up: spin + mm {base:.2f} us; prefetch + spin + mm {pre:.2f} (saves {base - pre:+.2f}); "
          f"a second mm right after {twice - base:.2f} us; the prefetch launch alone {only:.2f} us",
          flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--spin-us", type=float, default=20.0)
    ap.add_argument("--budgets", default="8,16,32")
    args = ap.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    rows = attention_rows([int(b) for b in args.budgets.split(",")], args.spin_us) + gemm_rows(args.spin_us)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
