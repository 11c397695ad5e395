"""Prefill attention on fresh prompts: keys read from the paged cache against keys read from the step's own
contiguous k/v rows (GPU; an experiment, kept as its record).

Why: W1's prefill steps (32 prompts of 512 rows each) spend ~240 us a layer in `_prefill_kernel` (about 143
TFLOP/s), where dense SDPA on the same shapes runs at ~360. The paged kernel finds every key's block in the
block table and gathers rows one by one; a prompt's own keys are also in the step's q/k/v output, at rows
`q_start + j`, where a tile is one affine 2-D slab (or one TMA box). This times, on W1's shape:

- the engine's kernel (`paged_attention_triton`) at its default launch and at the s15c sweep's best;
- the same algorithm with K/V from contiguous rows (views into a (T, (Hq + 2 Hkv) D) q/k/v buffer, as the
  engine's fused projection produces them), loading K as (D, tile) pointers, as (tile, D) pointers then
  transposed, or through host-made TMA descriptors; several launch configs each;
- torch SDPA on the dense padded batch (flash, cuDNN and efficient backends) as the reference rate.

    python3 benchmarks/prefill_sources.py [--prompts 32] [--len 512] [--quick]
    python3 benchmarks/prefill_sources.py --smoke   # CPU, TRITON_INTERPRET=1, tiny shapes
    python3 benchmarks/prefill_sources.py --paged-configs '128,64,8,3;64,32,4,2'
                                                    # the engine's kernel only, by launch config, on fresh
                                                    # prompts and chunks over cached prefixes
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from runner.layers.attention_metadata import AttentionMetadata  # noqa: E402
from runner.layers.paged_attention_triton import (  # noqa: E402
    PrefillConfig,
    paged_attention_triton,
    prefill_block_owner,
)

HQ, HKV, D, BLOCK_SIZE = 16, 8, 128, 16
LOG2E = 1.4426950408889634


@triton.jit
def _contig_tile(q, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, row0, start, kv_end, q_pos, kv_head,
                 qk_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                 HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr, MASK: tl.constexpr, MODE: tl.constexpr):
    offs_n = start + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (row0 + offs_n).to(tl.int64)
    n_ok = offs_n < kv_end
    if MODE == 0:  # K as (D, tile) pointers, as the paged kernel loads it
        k_ptrs = k_ptr + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]
        if MASK:
            k = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
    elif MODE == 1:  # K as (tile, D) pointers, transposed for the dot
        k_ptrs = k_ptr + rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        if MASK:
            k = tl.trans(tl.load(k_ptrs, mask=n_ok[:, None], other=0.0))
        else:
            k = tl.trans(tl.load(k_ptrs))
    else:  # TMA box of (tile, D)
        k = tl.trans(k_desc.load([(row0 + start).to(tl.int32), kv_head * HEAD_DIM]))
    s = tl.dot(q, k) * qk_scale
    if MASK:
        s = tl.where(n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MODE == 2 and not MASK:
        v = v_desc.load([(row0 + start).to(tl.int32), kv_head * HEAD_DIM])
    else:
        v_ptrs = v_ptr + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        if MASK:
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_reqs"])
def _contig_prefill_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, qsl_ptr, out_ptr, qk_scale,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                           stride_oh, num_q_per_kv, num_reqs,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                           G_PAD: tl.constexpr, TILE_N: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                           MODE: tl.constexpr):
    """`_prefill_kernel`'s grid and request search, fresh prompts only (no cached context), keys and values
    at rows `q_start + j` of contiguous (T, Hkv, D) views."""
    global_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    req = prefill_block_owner(qsl_ptr, num_reqs, global_block, BLOCK_Q, SEARCH_BLOCK)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    q_block = global_block - (q_start // BLOCK_Q + req)
    if q_len <= 1:
        return
    if q_block * BLOCK_Q >= q_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_block * BLOCK_Q + offs_m // G_PAD
    g = offs_m % G_PAD
    row_mask = (q_idx < q_len) & (g < num_q_per_kv)
    heads = kv_head * num_q_per_kv + g
    rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None], other=0.0)
    first_pos = q_block * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = (first_pos + 1) // TILE_N * TILE_N
    for start in range(0, full_end, TILE_N):
        m_i, l_i, acc = _contig_tile(q, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, q_start, start, kv_end,
                                     q_idx, kv_head, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                                     HEAD_DIM, TILE_N, False, MODE)
    for start in range(full_end, kv_end, TILE_N):
        m_i, l_i, acc = _contig_tile(q, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, q_start, start, kv_end,
                                     q_idx, kv_head, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                                     HEAD_DIM, TILE_N, True, MODE)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def contig_prefill(q, k, v, qsl, out, scale, num_reqs, cfg: PrefillConfig, mode: int):
    group = q.shape[1] // k.shape[1]
    g_pad = triton.next_power_of_2(group)
    block_q = cfg.block_m // g_pad
    k_desc = v_desc = k  # unused unless mode 2
    if mode == 2:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_desc = TensorDescriptor.from_tensor(k.flatten(1), [cfg.tile_n, D])
        v_desc = TensorDescriptor.from_tensor(v.flatten(1), [cfg.tile_n, D])
    grid = (q.shape[0] // block_q + num_reqs, k.shape[1])
    _contig_prefill_kernel[grid](
        q, k, v, k_desc, v_desc, qsl, out, scale * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), group, num_reqs,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, G_PAD=g_pad, TILE_N=cfg.tile_n, SEARCH_BLOCK=64,
        MODE=mode, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def build(n: int, length: int, device: str, seed: int = 0):
    """q (T, Hq, D); a q/k/v buffer whose k and v column ranges are the step's keys; the same keys written
    into a shuffled paged cache; the attention metadata of a prefill step over fresh prompts."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t = n * length
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen, device=device, dtype=dtype)
    q = qkv[:, : HQ * D].reshape(t, HQ, D).contiguous()  # the engine's q_out is its own tensor
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(t, HKV, D)
    per_req = -(-length // BLOCK_SIZE)
    num_blocks = n * per_req + 8
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    tables = perm[: n * per_req].view(n, per_req).to(torch.int32)
    kc = torch.zeros(num_blocks, BLOCK_SIZE, HKV, D, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    pos = torch.arange(length, device=device)
    slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    kc.view(-1, HKV, D)[slots] = k
    vc.view(-1, HKV, D)[slots] = v
    qsl_list = [i * length for i in range(n + 1)]
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor(qsl_list, dtype=torch.int32, device=device),
        seq_lens=torch.full((n,), length, dtype=torch.int32, device=device), block_tables=tables,
        max_query_len=length, max_seq_len=length, num_reqs=n, is_decode_only=False,
        query_start_loc_cpu=qsl_list, seq_lens_cpu=[length] * n,
    )
    return q, k, v, kc, vc, meta


def sdpa(q, k, v, n, length, scale, backend=None):
    qb = q.view(n, length, HQ, D).transpose(1, 2)
    kb = k.reshape(n, length, HKV, D).transpose(1, 2)
    vb = v.reshape(n, length, HKV, D).transpose(1, 2)
    if backend is None:
        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        if backend == torch.nn.attention.SDPBackend.FLASH_ATTENTION:
            kb, vb = kb.repeat_interleave(HQ // HKV, 1), vb.repeat_interleave(HQ // HKV, 1)
            return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)


#: (cached context, new rows) per request: W1's prefill steps, shorter and longer fresh prompts, and W2-like
#: chunks over a cached prefix
PAGED_SHAPES = {
    "W1 step: 32 x (0, 512)": [(0, 512)] * 32,
    "64 x (0, 128)": [(0, 128)] * 64,
    "8 x (0, 2048)": [(0, 2048)] * 8,
    "4 x (1024, 512)": [(1024, 512)] * 4,
    "16 x (1536, 512)": [(1536, 512)] * 16,
    "2 x (3072, 1024)": [(3072, 1024)] * 2,
}


def paged_shapes(configs: list[PrefillConfig]) -> None:
    """The engine's kernel at each launch config on `PAGED_SHAPES` (us, and the ratio to the first config)."""
    import attention as A  # benchmarks/attention.py: its workload builder (shuffled block tables)
    from triton.testing import do_bench

    print("\n# the engine's prefill kernel by launch config (us; ratio to the first config)")
    names = [f"{c.block_m},{c.tile_n},{c.num_warps},{c.num_stages}" for c in configs]
    print(f"{'shape':<22}" + "".join(f"{n:>16}" for n in names))
    for name, specs in PAGED_SHAPES.items():
        w = A.build_workload(name, specs, seed=5)
        out = torch.empty_like(w.query)
        times = []
        for cfg in configs:
            def fn(cfg=cfg, w=w, out=out):
                paged_attention_triton(w.query, w.key_cache, w.value_cache, w.meta, D**-0.5, out,
                                       prefill_config=cfg)
            times.append(do_bench(fn, warmup=25, rep=200))
        print(f"{name:<22}" + "".join(f"{1e3 * t:9.1f} ({times[0] / t:4.2f})" for t in times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--len", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="the default launch of each mode only")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--paged-configs", default=None,
                        help="only time the engine's kernel on PAGED_SHAPES at these launch configs, e.g. "
                             "'128,64,8,3;64,32,4,2' (block_m,tile_n,warps,stages; the first is the base)")
    args = parser.parse_args()
    if args.paged_configs:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        paged_shapes([PrefillConfig(*map(int, c.split(","))) for c in args.paged_configs.split(";")])
        return
    device = "cpu" if args.smoke else "cuda"
    n, length = (2, 40) if args.smoke else (args.prompts, args.len)
    scale = D**-0.5
    q, k, v, kc, vc, meta = build(n, length, device)
    ref = sdpa(q.float(), k.float(), v.float(), n, length, scale).transpose(1, 2).reshape(q.shape)
    flops = 4 * HQ * D * n * length * (length + 1) / 2

    def bench(fn) -> float:
        if device != "cuda":
            fn()
            return float("nan")
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200)

    rows = []

    def report(name: str, fn, out=None) -> None:
        try:
            got = fn()
            if out is None:
                out = got
            err = (out.float().reshape(q.shape) - ref).abs().max().item()
            ms = bench(fn)
        except Exception as exc:  # a config the compiler refuses is a row, not the end of the sweep
            print(f"{name:<52} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        rows.append((name, ms))
        print(f"{name:<52} {1e3 * ms:9.1f} us  {flops / (ms * 1e-3) / 1e12:7.1f} TFLOP/s  max err {err:.3g}",
              flush=True)

    print(f"# {n} fresh prompts x {length} rows, Hq {HQ}, Hkv {HKV}, D {D}, {q.dtype}; "
          f"{flops / 1e9:.1f} GFLOP causal", flush=True)
    out = torch.empty_like(q)
    paged = [PrefillConfig(), PrefillConfig(64, 32, 4, 2)]
    if args.smoke:
        paged = [PrefillConfig(32, 16, 4, 1)]
    for cfg in paged:
        report(f"paged (engine) {cfg.block_m},{cfg.tile_n},{cfg.num_warps},{cfg.num_stages}",
               lambda cfg=cfg: paged_attention_triton(q, kc, vc, meta, scale, out, prefill_config=cfg))
    if args.smoke:
        configs = [PrefillConfig(32, 16, 4, 1)]
    elif args.quick:
        configs = [PrefillConfig()]
    else:
        configs = [PrefillConfig(*c) for c in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3),
                                               (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2),
                                               (256, 64, 8, 3), (128, 32, 4, 3))]
    qsl = meta.query_start_loc
    for mode, label in ((0, "contig K(D,tile)"), (1, "contig K(tile,D).T"), (2, "contig TMA")):
        if mode == 2 and device != "cuda":
            continue
        for cfg in configs:
            o2 = torch.empty_like(q)
            report(f"{label} {cfg.block_m},{cfg.tile_n},{cfg.num_warps},{cfg.num_stages}",
                   lambda cfg=cfg, mode=mode, o2=o2: contig_prefill(q, k, v, qsl, o2, scale, n, cfg, mode))
    if device == "cuda":
        from torch.nn.attention import SDPBackend

        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            report(f"SDPA dense {backend.name}",
                   lambda backend=backend: sdpa(q, k, v, n, length, scale, backend).transpose(1, 2))
    if rows and device == "cuda":
        base = rows[0][1]
        best = min(rows[2:] or rows, key=lambda r: r[1])
        print(f"\nbest contiguous-or-SDPA row: {best[0]} at {base / best[1]:.2f}x the engine's default "
              "kernel")


if __name__ == "__main__":
    main()
