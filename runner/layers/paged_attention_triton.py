"""Triton kernels over Bridge's paged KV cache: the KV write, a prefill kernel and a split-KV decode kernel.

Cache layout per layer: `key_cache` / `value_cache` are (num_blocks, block_size, num_kv_heads, head_dim).
A token's position `p` in request `b` lives in block `block_tables[b, p // block_size]` at offset
`p % block_size`. Every kernel addresses the cache per token (block id looked up from the block table for
each key in a tile), so a tile of keys may span several pages and the tile size is independent of the
page size.

Why three attention kernels:

- Decode (`_decode_kernel`, one query row per request) is bound by reading the KV cache. One program
  handles one (request, KV head, split) and processes all query heads of its KV-head group together, so each
  K/V byte is read once per KV head (GQA). When there are few (request, KV head) pairs compared to the SMs,
  the key range is split (flash-decoding) and `_decode_reduce_kernel` merges the partial results through
  their log-sum-exp. The grid depends only on `num_reqs`, the head counts and the split count, never on
  sequence lengths, and the loop bounds come from `seq_lens` in the kernel, so the pair can be captured in a
  CUDA graph and replayed with other lengths.
- Prefill (`_prefill_kernel`, query rows > 1) covers prompts from scratch, chunks with a paged prefix and
  earlier chunks. One program handles BLOCK_Q query tokens x all query heads of one KV head, packed as the
  rows of one tile, so K/V tiles are shared across the group. Tiles entirely below the causal diagonal run
  without a mask. The grid is flat over query blocks (num_tokens // BLOCK_Q + num_reqs) and each program
  finds its request with one vectorised search of `query_start_loc`, so a mixed step with hundreds of
  decodes launches a few programs per decode that exit at once, not max_query_len / BLOCK_Q of them.
- A mixed step launches both: the decode kernel skips requests whose query length is not 1 and the prefill
  kernel skips those whose query length is <= 1, a choice made on the device from `query_start_loc`, so no
  host work or sync is needed to sort requests.

All softmax state is fp32 and in base 2 (`exp2` with the scale folded with log2(e)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.layers.attention_metadata import AttentionMetadata
from runner.layers.pdl import release_dependents, use_pdl, wait_for_predecessor
from runner.layers.triton_launch import launch

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------
# KV write
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask
    )
    kc = key_cache_ptr + blk * stride_kcb + off * stride_kcs
    vc = value_cache_ptr + blk * stride_vcb + off * stride_vcs
    tl.store(
        kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter (num_tokens, num_kv_heads, head_dim) key/value rows into their cache slots; slot -1 is skipped.

    One program per token, no host sync: capturable in a CUDA graph.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    launch(_write_kv_kernel, (num_tokens,))(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )


# ----------------------------------------------------------------------------------------------------------
# Shared tile step of the online softmax
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_blocks(bt_row_ptr, start, kv_limit, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                 MASK_KV: tl.constexpr):
    """The block ids of keys [start, start + TILE_N), one per key (0 past `kv_limit` when MASK_KV)."""
    offs_n = start + tl.arange(0, TILE_N)
    if MASK_KV:
        return tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=offs_n < kv_limit, other=0)
    return tl.load(bt_row_ptr + offs_n // BLOCK_SIZE)


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    blk,
    start,
    kv_limit,
    q_pos,
    kv_head,
    qk_scale,
    window,
    softcap_l2,
    head_dim,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    MASK_KV: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_FP32: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PAD_D: tl.constexpr,
):
    """One key tile [start, start + TILE_N) against the query rows `q` (BLOCK_M, HEAD_DIM).

    `blk` holds the tile's block ids, one per key (`_tile_blocks`); the decode loop loads them a tile
    ahead so a tile's K/V loads never wait on the block table.

    MASK_KV: keys at or past `kv_limit` are masked (the tail tile). CAUSAL: key j is visible to row r
    only when j <= q_pos[r]. WINDOW: key j is visible to row r only when j > q_pos[r] - window (the lower
    edge of a sliding window); a row may then see no key of the tile, so the running max is guarded.
    None of the three is needed for tiles wholly inside every row's visible range. SOFTCAP: logits
    (already in base 2) become `softcap_l2 * tanh(s / softcap_l2)`, i.e. `c * tanh(x / c)` in natural
    units with `softcap_l2 = c * log2(e)`. PAD_D: HEAD_DIM is `head_dim` rounded up to a power of two and
    the lanes past `head_dim` load as zeros (they add nothing to q.k and are never stored).
    """
    offs_n = start + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASK_KV:
        n_mask = offs_n < kv_limit
    blk = blk.to(tl.int64)
    in_blk = offs_n % BLOCK_SIZE
    k_ptrs = (
        k_cache_ptr
        + blk[None, :] * stride_kb
        + in_blk[None, :] * stride_ks
        + kv_head * stride_kh
        + offs_d[:, None] * stride_kd
    )
    v_ptrs = (
        v_cache_ptr
        + blk[:, None] * stride_vb
        + in_blk[:, None] * stride_vs
        + kv_head * stride_vh
        + offs_d[None, :] * stride_vd
    )
    if MASK_KV:
        if PAD_D:
            k = tl.load(k_ptrs, mask=n_mask[None, :] & (offs_d[:, None] < head_dim), other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_mask[None, :], other=0.0)
    elif PAD_D:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < head_dim, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if IS_FP32:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale
    if SOFTCAP:
        # tanh(t) = 1 - 2 / (exp(2t) + 1): exact at both ends in fp32 (exp overflows to inf -> 1).
        s = softcap_l2 * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap_l2)) + 1.0))
    if MASK_KV:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    if WINDOW:
        s = tl.where(offs_n[None, :] > q_pos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if WINDOW:
        # A row with no visible key so far keeps m = -inf; exp2(-inf - -inf) would be NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK_KV:
        if PAD_D:
            v = tl.load(v_ptrs, mask=n_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0)
        else:
            v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
    elif PAD_D:
        v = tl.load(v_ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None]
    if IS_FP32:
        acc += tl.dot(p, v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# ----------------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_splits"])  # one build for every split count (see choose_num_splits)
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    window,
    softcap_l2,
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    num_q_heads,
    num_q_per_kv,
    num_splits,
    SPLIT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_FP32: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PAD_D: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
    BT_AHEAD: tl.constexpr,
):
    release_dependents(RELEASE)  # a PDL o_proj after it may start loading its weights (runner.layers.pdl)
    wait_for_predecessor(WAIT)  # launched with PDL: q and the new token's KV come from the kernel ahead
    # KV heads fastest: the programs of one request run together and read whole (token, all heads) rows.
    kv_head = tl.program_id(0)
    req = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    if q_end - q_start != 1:
        # Not a single-row request: the prefill kernel handles it, or it is a padding request with no rows.
        return
    seq_len = tl.load(seq_lens_ptr + req)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < num_q_per_kv
    heads = kv_head * num_q_per_kv + offs_g
    row = q_start.to(tl.int64)
    d_mask = offs_d < head_dim  # all true unless HEAD_DIM pads head_dim to a power of two
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # The one query sits at seq_len - 1; a sliding window of W shows it keys [seq_len - W, seq_len),
    # so the key range itself starts there and no tile needs a window mask.
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    if not SPLIT:
        lo = first
        hi = seq_len
    else:
        # Whole tiles per split so every split but the last starts on a tile boundary (from `first`).
        chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), TILE_N) * TILE_N
        lo = first + split * chunk
        hi = tl.minimum(lo + chunk, seq_len)
    full_hi = lo + tl.maximum(hi - lo, 0) // TILE_N * TILE_N

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    bt_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32)  # unused: decode sees every cached key
    if BT_AHEAD:
        # Each tile's block ids are loaded one tile ahead, so its K/V loads issue without first waiting
        # on the block table (a load is only waited on where its value is used), and Triton's pipeliner
        # keeps num_stages - 1 tiles in flight instead of none.
        blk_next = _tile_blocks(bt_row_ptr, lo, hi, BLOCK_SIZE, TILE_N, True)
    for start in range(lo, full_hi, TILE_N):
        if BT_AHEAD:
            blk = blk_next
            blk_next = _tile_blocks(bt_row_ptr, start + TILE_N, hi, BLOCK_SIZE, TILE_N, True)
        else:
            blk = _tile_blocks(bt_row_ptr, start, hi, BLOCK_SIZE, TILE_N, False)
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, blk, start, hi, q_pos, kv_head, qk_scale,
            window, softcap_l2, head_dim,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE, HEAD_DIM, TILE_N, False, False, IS_FP32, False, SOFTCAP, PAD_D,
        )  # fmt: skip
    if full_hi < hi:
        if BT_AHEAD:
            blk = blk_next
        else:
            blk = _tile_blocks(bt_row_ptr, full_hi, hi, BLOCK_SIZE, TILE_N, True)
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, blk, full_hi, hi, q_pos, kv_head, qk_scale,
            window, softcap_l2, head_dim,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE, HEAD_DIM, TILE_N, True, False, IS_FP32, False, SOFTCAP, PAD_D,
        )  # fmt: skip

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if not SPLIT:
        tl.store(
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        part = (req.to(tl.int64) * num_q_heads + heads) * num_splits + split
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    num_q_heads,
    head_dim,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    RELEASE: tl.constexpr,
):
    release_dependents(RELEASE)
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    if q_end - q_start != 1:
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    base = (req.to(tl.int64) * num_q_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty (padding): weights 0
    w = tl.exp2(lse - lse_max)
    total = tl.sum(w, 0)
    o = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
        res.to(out_ptr.dtype.element_ty),
        mask=offs_d < head_dim,
    )


# ----------------------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def prefill_block_owner(query_start_loc_ptr, num_reqs, global_block, BLOCK_Q: tl.constexpr,
                        SEARCH_BLOCK: tl.constexpr):
    """The request that owns query block `global_block` of `_prefill_kernel`'s flat grid: the number of
    requests whose first block is at or before it, less one (a vectorised search, `SEARCH_BLOCK` requests
    at a time)."""
    count = 0
    for base in range(0, num_reqs, SEARCH_BLOCK):
        idx = base + tl.arange(0, SEARCH_BLOCK)
        in_range = idx < num_reqs
        first_block = tl.load(query_start_loc_ptr + idx, mask=in_range, other=0) // BLOCK_Q + idx
        count += tl.sum(((first_block <= global_block) & in_range).to(tl.int32), 0)
    return count - 1


@triton.jit(do_not_specialize=["num_reqs"])  # one build for every batch size (see PREFILL_SEARCH_BLOCK)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,
    window,
    softcap_l2,
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    num_q_per_kv,
    num_reqs,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * G_PAD
    BLOCK_Q: tl.constexpr,
    G_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    IS_FP32: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PAD_D: tl.constexpr,
    ALL_ROWS: tl.constexpr = False,
):
    # Flat grid over query blocks: request b owns programs [qsl[b]//BLOCK_Q + b, qsl[b+1]//BLOCK_Q + b + 1),
    # at least ceil(q_len / BLOCK_Q) of them, so the grid (num_tokens // BLOCK_Q + num_reqs) needs no
    # per-request host data. Reversed so the last (longest) query blocks start first.
    global_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    req = prefill_block_owner(query_start_loc_ptr, num_reqs, global_block, BLOCK_Q, SEARCH_BLOCK)
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    q_len = q_end - q_start
    q_block = global_block - (q_start // BLOCK_Q + req)
    min_len = 2  # 1: the decode kernel's; 0: a padding request
    if ALL_ROWS:
        min_len = 1  # batch-invariant steps attend every row here
    if q_len < min_len:
        return
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_block * BLOCK_Q + offs_m // G_PAD
    g = offs_m % G_PAD
    row_mask = (q_idx < q_len) & (g < num_q_per_kv)
    heads = kv_head * num_q_per_kv + g
    rows = (q_start + q_idx).to(tl.int64)
    io_mask = row_mask[:, None] & (offs_d[None, :] < head_dim)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=io_mask,
        other=0.0,
    )
    q_pos = context_len + q_idx

    first_pos = context_len + q_block * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    lo = 0
    if SLIDING:
        # Keys below `lo` are outside every row's window. Keys in [lo, win_full) are inside the window of
        # some rows only (the lower edge, masked per row); keys >= win_full = last row - W + 1 are inside
        # every row's window, so the tiles from there on are the full-attention tiles.
        lo = tl.maximum(first_pos - window + 1, 0)
        if ALL_ROWS:  # key tiles at multiples of TILE_N whatever the block's first row (batch invariance)
            lo = lo // TILE_N * TILE_N
        win_full = tl.maximum(kv_end - window, lo)
        edge_end = lo + tl.cdiv(win_full - lo, TILE_N) * TILE_N
        for start in range(lo, edge_end, TILE_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
                _tile_blocks(bt_row_ptr, start, kv_end, BLOCK_SIZE, TILE_N, True),
                start, kv_end, q_pos, kv_head,
                qk_scale, window, softcap_l2, head_dim,
                stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                BLOCK_SIZE, HEAD_DIM, TILE_N, True, True, IS_FP32, True, SOFTCAP, PAD_D,
            )  # fmt: skip
        lo = edge_end
    # Keys [lo, full_end) are visible to every row of this block: no mask there.
    full_end = lo + tl.maximum(first_pos + 1 - lo, 0) // TILE_N * TILE_N
    for start in range(lo, full_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
            _tile_blocks(bt_row_ptr, start, kv_end, BLOCK_SIZE, TILE_N, False),
            start, kv_end, q_pos, kv_head, qk_scale,
            window, softcap_l2, head_dim,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE, HEAD_DIM, TILE_N, False, False, IS_FP32, False, SOFTCAP, PAD_D,
        )  # fmt: skip
    for start in range(full_end, kv_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
            _tile_blocks(bt_row_ptr, start, kv_end, BLOCK_SIZE, TILE_N, True),
            start, kv_end, q_pos, kv_head, qk_scale,
            window, softcap_l2, head_dim,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE, HEAD_DIM, TILE_N, True, True, IS_FP32, False, SOFTCAP, PAD_D,
        )  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


# ----------------------------------------------------------------------------------------------------------
# Launch configuration and host wrappers
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel. `num_splits=None` picks from the grid size and SM count.

    Defaults from a sweep on a Qwen3-0.6B shape in bf16 (`benchmarks/attention.py --sweep`): tile 128 /
    4 warps / 2 stages without a split was best on short and long contexts alike, and splitting only lost
    time once (requests x KV heads) filled a wave. At tile 128 a program holds ~254 registers x 128
    threads, so two programs fit per SM.
    """

    tile_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None
    max_splits: int = 16
    # Programs resident per SM at these settings: splitting aims to fill one wave of them, no more.
    programs_per_sm: int = 2
    # Load each tile's block ids one tile ahead (see `_decode_kernel`).
    bt_ahead: bool = False


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel. block_m = query rows per program (tokens x padded group)."""

    block_m: int = 128
    tile_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


PREFILL_SEARCH_BLOCK = 64
"""Requests the prefill kernel's programs scan per iteration to find their own (a loop covers more).
A constant: it is a constexpr, and `next_pow2(num_reqs)`, as it was, built the kernel again for every
new power of two of the batch size, so a server's bursts of arrivals paid seconds of builds mid-step."""


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter runs: any small number exercises the split path


def choose_num_splits(num_reqs: int, num_kv_heads: int, device: torch.device, config: DecodeConfig) -> int:
    """Split the key range only while (requests x KV heads) leaves resident-program slots idle.

    The split count is the most that still fits one wave (a second, partly filled wave costs more than the
    idle slots it fills), and 1 once the unsplit grid fills a wave: every split of a full wave lost time to
    the partial writes and the reduce. Depends on the (padded) batch size and head count alone, never on
    sequence lengths, so a captured CUDA graph stays valid for every replay. The count is a runtime argument
    of the kernels (only split-or-not is compiled in): eager steps that mix prefills and decodes have any
    batch size, and a constexpr count built the kernel again, for seconds, mid-traffic, whenever a server's
    batch met a new value.
    """
    if config.num_splits is not None:
        return max(1, config.num_splits)
    slots = _num_sms(device) * config.programs_per_sm
    base = max(1, num_reqs * num_kv_heads)
    return int(min(config.max_splits, max(1, slots // base)))


#: 16-bit head_dim-128 launches for steps whose query blocks fill 128 rows: 32-key tiles on 4 warps beat
#: 64-key tiles on 8 warps on fresh prompts and on chunks over cached prefixes alike; with nothing cached
#: before any query (`fresh`) and a group of at most 2, 64-row programs on 2 stages do better still, but
#: they lose over long prefixes, where each program re-reads the whole prefix (benchmarks/attention.py).
PREFILL_TILES_128 = PrefillConfig(block_m=128, tile_n=32, num_warps=4, num_stages=3)
PREFILL_FRESH_64 = PrefillConfig(block_m=64, tile_n=32, num_warps=4, num_stages=2)


def _default_prefill_config(
    head_dim: int, dtype: torch.dtype, max_query_len: int, group_pad: int, fresh: bool = False
) -> PrefillConfig:
    # Short queries (a mixed batch of small chunks) waste less work with fewer rows per program.
    rows_needed = triton.next_power_of_2(max(1, max_query_len)) * group_pad
    block_m = max(16, min(128, rows_needed))
    if dtype == torch.float32:
        return PrefillConfig(block_m=min(block_m, 64), tile_n=32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return PrefillConfig(block_m=block_m, tile_n=64, num_warps=4, num_stages=3)
    if head_dim == 128 and block_m == 128:
        return PREFILL_FRESH_64 if fresh and group_pad <= 2 else PREFILL_TILES_128
    return PrefillConfig(block_m=block_m, tile_n=64, num_warps=8 if block_m >= 128 else 4, num_stages=3)


def invariant_prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The one launch of a batch-invariant engine's attention (`paged_attention_triton(batch_invariant=
    True)`), for every step: decode rows, prefill chunks and whole prompts.

    Why it is invariant: a query row's output is its online softmax over key tiles [j * TILE_N, (j + 1) *
    TILE_N) from the first tile it can see to the last its program reads, each tile's logits a `tl.dot` of
    the same tile shape. Tiles past the row's position (a program reads to its last row's) contribute
    exactly nothing (weight 0, rescale 1), tiles wholly before a sliding window likewise, and masked and
    unmasked forms of a tile give the same values where the row sees the key. So the row's bits depend on
    its own keys and this configuration, never on its block's other rows, its chunk or its batch. What
    varies in the default launches, and is fixed here: the decode kernel's split count (by the grid size)
    and tiles, and the prefill tile class (by the step's longest query).
    """
    if dtype == torch.float32:
        return PrefillConfig(block_m=64, tile_n=32, num_warps=4, num_stages=2)
    if head_dim <= 128:
        return PrefillConfig(block_m=64, tile_n=64, num_warps=4, num_stages=3)
    return PrefillConfig(block_m=64, tile_n=32, num_warps=4, num_stages=2)


#: 32-key tiles, 4 programs per SM, block ids a tile ahead for grids that fill one wave of those; see
#: `_default_decode_config`
SMALL_TILE_CONFIG = DecodeConfig(tile_n=32, num_warps=4, num_stages=4, programs_per_sm=4, bt_ahead=True)


def _default_decode_config(
    dtype: torch.dtype, pairs: int, head_dim: int, device: torch.device
) -> DecodeConfig:
    """The decode launch for a grid of `pairs` (request, KV head) pairs on `device`.

    128-key tiles (2 programs per SM) by default. For grids that fill more than 3/4 of one wave of 4
    programs per SM (3 x SMs < pairs <= 4 x SMs) at head_dim 128, 32-key tiles with 4 programs per SM and
    the block ids loaded a tile ahead (so Triton keeps 3 tiles in flight): there the small tiles keep
    more keys in flight per SM. Outside that band they lose (a partial wave, or a second wave of long
    contexts), so they stay out (benchmarks/attention.py). A graph bucket's config can depend on its
    batch size only, never on lengths.
    """
    if dtype == torch.float32:
        return DecodeConfig(tile_n=32, num_warps=4, num_stages=2)
    sms = _num_sms(device)
    if head_dim == 128 and 3 * sms < pairs <= 4 * sms:
        return SMALL_TILE_CONFIG
    return DecodeConfig()


def padded_head_dim(head_dim: int) -> int:
    """The kernels' HEAD_DIM: head_dim rounded up to a power of two (>= 16, `tl.dot`'s smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))


def validate_triton_shapes(head_dim: int, block_size: int) -> None:
    if head_dim < 1 or head_dim > 256:
        raise ValueError(f"Triton paged attention needs head_dim in [1, 256], got {head_dim}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"Triton paged attention needs block_size a power of two, got {block_size}")


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    *,
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Run the decode and/or prefill kernels into `out` (num_tokens, num_q_heads, head_dim); returns `out`.

    Which kernels launch: `meta.is_decode_only` or `max_query_len <= 1` -> decode only (the CUDA-graph
    path: no host data read beyond `meta.num_reqs`). Otherwise the prefill kernel, plus the decode kernel
    unless the host copy `meta.query_start_loc_cpu` shows no single-row request.
    `batch_invariant`: the prefill kernel alone attends every row, decode rows included, at one launch
    configuration (`invariant_prefill_config`, `prefill_config` overrides it), with key tiles at multiples
    of its tile size (see `invariant_prefill_config`).
    `sliding_window` (keys p-W+1..p visible) and `softcap` (`c * tanh(logit / c)`) as in
    `runner.layers.paged_attention.paged_attention`; each is a compile-time switch, so layers without them run
    the kernels unchanged.
    """
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = key_cache.shape
    validate_triton_shapes(head_dim, block_size)
    if meta.block_tables.dim() != 2 or meta.block_tables.stride(1) != 1:
        raise ValueError("block_tables must be 2-D with contiguous rows (stride 1 along the block axis)")
    num_reqs = meta.num_reqs
    if num_reqs == 0 or query.shape[0] == 0:
        return out
    group = num_q_heads // num_kv_heads
    qk_scale = float(scale) * LOG2E
    sliding = sliding_window is not None
    window = int(sliding_window) if sliding else 0
    has_softcap = softcap is not None
    softcap_l2 = float(softcap) * LOG2E if has_softcap else 1.0
    is_fp32 = query.dtype == torch.float32
    d_pad = padded_head_dim(head_dim)  # e.g. Phi-3-mini's 96 runs as 128 with masked lanes
    pad_d = d_pad != head_dim
    common_strides = (
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        meta.block_tables.stride(0),
        *out.stride(),
    )

    launch_prefill = batch_invariant or (not meta.is_decode_only and meta.max_query_len > 1)
    launch_decode = not batch_invariant
    if launch_decode and launch_prefill and meta.query_start_loc_cpu:
        qsl = meta.query_start_loc_cpu
        launch_decode = any(qsl[i + 1] - qsl[i] == 1 for i in range(num_reqs))

    if launch_decode:
        # With PDL (runner.layers.pdl) the decode kernel starts as the q/k/v kernel ahead ends, waits for it,
        # and lets a PDL o_proj after it start early in turn.
        release = use_pdl(query.device)
        pdl_launch = {"launch_pdl": True} if release else {}
        pairs = num_reqs * num_kv_heads
        cfg = decode_config or _default_decode_config(query.dtype, pairs, head_dim, query.device)
        splits = choose_num_splits(num_reqs, num_kv_heads, query.device, cfg)
        block_g = max(16, triton.next_power_of_2(group))
        if splits > 1:
            part_out = torch.empty(
                (num_reqs, num_q_heads, splits, d_pad), dtype=torch.float32, device=query.device
            )
            part_lse = torch.empty((num_reqs, num_q_heads, splits), dtype=torch.float32, device=query.device)
        else:
            part_out = part_lse = out  # unused
        launch(_decode_kernel, (num_kv_heads, num_reqs, splits))(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            out, part_out, part_lse, qk_scale, window, softcap_l2, head_dim, *common_strides, num_q_heads,
            group, splits, SPLIT=splits > 1, BLOCK_SIZE=block_size, HEAD_DIM=d_pad, BLOCK_G=block_g,
            TILE_N=cfg.tile_n, IS_FP32=is_fp32, SLIDING=sliding, SOFTCAP=has_softcap, PAD_D=pad_d,
            RELEASE=release, WAIT=release, BT_AHEAD=cfg.bt_ahead, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **pdl_launch,
        )  # fmt: skip
        if splits > 1:
            launch(_decode_reduce_kernel, (num_reqs, num_q_heads))(
                part_out, part_lse, meta.query_start_loc, out, *out.stride(), num_q_heads, head_dim,
                splits, SPLITS_PAD=triton.next_power_of_2(max(splits, cfg.max_splits)), HEAD_DIM=d_pad,
                RELEASE=release, num_warps=1 if head_dim <= 64 else 2,
            )  # fmt: skip

    if launch_prefill:
        group_pad = triton.next_power_of_2(group)
        if batch_invariant:
            cfg = prefill_config or invariant_prefill_config(head_dim, query.dtype)
        else:
            cfg = prefill_config or _default_prefill_config(head_dim, query.dtype, meta.max_query_len,
                                                            group_pad, meta.fresh_prefill)
        block_m = triton.next_power_of_2(max(cfg.block_m, 16, group_pad))
        block_q = block_m // group_pad
        num_q_blocks = query.shape[0] // block_q + num_reqs
        launch(_prefill_kernel, (num_q_blocks, num_kv_heads))(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
            qk_scale, window, softcap_l2, head_dim, *common_strides, group, num_reqs,
            BLOCK_SIZE=block_size, HEAD_DIM=d_pad, BLOCK_M=block_m, BLOCK_Q=block_q, G_PAD=group_pad,
            TILE_N=cfg.tile_n, SEARCH_BLOCK=PREFILL_SEARCH_BLOCK, IS_FP32=is_fp32,
            SLIDING=sliding, SOFTCAP=has_softcap, PAD_D=pad_d, ALL_ROWS=batch_invariant,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out
