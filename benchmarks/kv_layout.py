"""A/B of the paged KV cache's memory layout for the Triton attention kernels (GPU; a decision record).

Token-major storage (num_blocks, block_size, kv_heads, head_dim), Bridge's layout, against head-major
storage (num_blocks, kv_heads, block_size, head_dim) presented through a transposed view, so that one
(block, head) is 4 KB contiguous. The kernels address the cache through strides, so both run the same
code. Block tables either as the engine fills them (a request's blocks in allocation order from a fresh
pool of 66,940 blocks, the W1 engine's pool) or shuffled over the whole pool; several decode tile
configurations. Times are CUDA-graph `do_bench` medians (prefill: plain `do_bench`).

    python benchmarks/kv_layout.py

Result on the H200 (benchmarks/logs/kv_layout_ab_2026-11-29.log): the layouts are within 1% of each
other everywhere, so the cache stays token-major.
"""

from __future__ import annotations

import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from runner.layers.attention_metadata import AttentionMetadata  # noqa: E402
from runner.layers.paged_attention import paged_attention_torch  # noqa: E402
from runner.layers.paged_attention_triton import DecodeConfig, paged_attention_triton  # noqa: E402

DEVICE = "cuda"
KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 8, 16, 128, 16
NUM_BLOCKS = 66940


def caches(head_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if head_major:
        shape = (NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM)
        return tuple(torch.randn(shape, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)
                     for _ in range(2))
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    return tuple(torch.randn(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))


def metadata(specs: list[tuple[int, int]], mode: str, seed: int = 0) -> AttentionMetadata:
    """specs: (cached context, query rows) per request; mode "engine" (allocation order) or "shuffled"."""
    rng = random.Random(seed)
    seq = [c + q for c, q in specs]
    nblocks = [-(-s // BLOCK) for s in seq]
    pool = rng.sample(range(NUM_BLOCKS), sum(nblocks)) if mode == "shuffled" else list(range(sum(nblocks)))
    table = torch.zeros(len(specs), max(nblocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(nblocks):
        table[i, :n] = torch.tensor(pool[used : used + n])
        used += n
    qsl = [0]
    for _, q in specs:
        qsl.append(qsl[-1] + q)
    positions = [torch.arange(c, c + q) for c, q in specs]
    slots = torch.cat([table[i, p // BLOCK].long() * BLOCK + p % BLOCK for i, p in enumerate(positions)])
    return AttentionMetadata(
        slots.to(DEVICE), torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq, dtype=torch.int32, device=DEVICE), table.to(DEVICE),
        max_query_len=max(q for _, q in specs), max_seq_len=max(seq), num_reqs=len(specs),
        is_decode_only=all(q == 1 for _, q in specs), query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    from triton.testing import do_bench, do_bench_cudagraph

    r = random.Random(1)
    work = {"decode 64x576": [(r.randint(560, 600), 1) for _ in range(64)],
            "decode 256xU[100,2048]": [(r.randint(100, 2048), 1) for _ in range(256)],
            "prefill 64x512": [(0, 512) for _ in range(64)]}
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / (do_bench(lambda: dst.copy_(src)) * 1e-3)
    print(f"copy bw {bandwidth / 1e12:.2f} TB/s")
    decode_configs = [None, DecodeConfig(tile_n=64, num_warps=4, num_stages=3),
                      DecodeConfig(tile_n=64, num_warps=4, num_stages=4),
                      DecodeConfig(tile_n=128, num_warps=4, num_stages=3),
                      DecodeConfig(tile_n=32, num_warps=4, num_stages=4)]
    for head_major in (False, True):
        kc, vc = caches(head_major)
        for mode in ("engine", "shuffled"):
            for name, specs in work.items():
                meta = metadata(specs, mode)
                rows = sum(q for _, q in specs)
                q = torch.randn(rows, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
                out = torch.empty_like(q)
                kv_bytes = sum(c + qq for c, qq in specs) * 2 * KV_HEADS * HEAD_DIM * 2
                prefill = name.startswith("prefill")
                for cfg in [None] if prefill else decode_configs:
                    def fn(q=q, kc=kc, vc=vc, meta=meta, out=out, cfg=cfg):
                        paged_attention_triton(q, kc, vc, meta, HEAD_DIM**-0.5, out, decode_config=cfg)

                    fn()
                    torch.cuda.synchronize()
                    ms = do_bench(fn) if prefill else do_bench_cudagraph(fn)
                    label = ("default" if cfg is None
                             else f"tile{cfg.tile_n}/w{cfg.num_warps}/s{cfg.num_stages}")
                    pct = kv_bytes / (ms * 1e-3) / bandwidth
                    print(f"{'head' if head_major else 'token'}-major {mode:8s} {name:24s} {label:14s} "
                          f"{ms * 1e3:8.1f} us {pct:6.1%} of copy BW", flush=True)
                if mode == "engine" and name.startswith("decode 64"):
                    ref = paged_attention_torch(q, kc, vc, meta, HEAD_DIM**-0.5, torch.empty_like(q))
                    paged_attention_triton(q, kc, vc, meta, HEAD_DIM**-0.5, out)
                    print("   max err vs torch", (out.float() - ref.float()).abs().max().item())
        del kc, vc
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
