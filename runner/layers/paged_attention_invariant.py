"""The CPU's batch-invariant paged attention: a query row's bits never depend on its step.

Why: the torch reference path (`paged_attention_torch`) computes one request's rows as one einsum over
the step's query rows and the request's keys so far, so a row is reduced by a matrix product whose shape
is set by its chunk (and MKL picks kernels by shape) and a softmax over a key range that grows with the
chunk: the same row computed in a decode step, a chunk or a whole prompt differs in the last bits. With
`EngineConfig.batch_invariant` the CPU takes this path instead; CUDA (and the interpreter) take the
Triton kernel's invariant launch (`paged_attention_triton(batch_invariant=True)`).

How: every product has one shape. A request's rows (token x query head of a KV-head group) go in tiles of
`ROW_TILE`, its keys in tiles of `KEY_TILE` at multiples of `KEY_TILE` (zero padded past the context), and
each (row tile, key tile) pair is one `(ROW_TILE, D) @ (D, KEY_TILE)` and one `(ROW_TILE, KEY_TILE) @
(KEY_TILE, D)` in a batched matmul of fixed matrix shape. The softmax takes each row's exact maximum over
what it sees, each tile's sum of `exp(s - max)` over `KEY_TILE` lanes, and adds the tiles' sums and
products in tile order from zero. Keys a row cannot see have weight exactly 0, so the tiles a longer
chunk adds after the row's position, and those before a sliding window, add exact zeros.
"""

from __future__ import annotations

import torch

from runner.layers.attention_metadata import AttentionMetadata

ROW_TILE = 16
KEY_TILE = 32


def paged_attention_invariant_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`paged_attention_torch`'s contract (fp32 arithmetic, writes `out`), computed as above."""
    num_reqs = meta.num_reqs
    qsl = meta.query_start_loc_cpu or meta.query_start_loc[: num_reqs + 1].tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens[:num_reqs].tolist()
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    for b in range(num_reqs):
        q_start, q_end = qsl[b], qsl[b + 1]
        q_len, seq_len = q_end - q_start, seq_lens[b]
        if q_len == 0:
            continue
        if seq_len == 0:
            out[q_start:q_end].zero_()  # padding request
            continue
        if q_len > seq_len:
            raise ValueError(f"request {b}: {q_len} query rows but seq_len {seq_len}")
        out[q_start:q_end] = _request_attention(
            query[q_start:q_end], key_cache, value_cache, meta.block_tables[b], seq_len, scale,
            block_size, num_kv_heads, group, head_dim, sliding_window, softcap,
        ).to(out.dtype)  # fmt: skip
    return out


def _request_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_row: torch.Tensor, seq_len: int, scale: float, block_size: int,
                       num_kv_heads: int, group: int, head_dim: int, window: int | None,
                       softcap: float | None) -> torch.Tensor:
    """One request's (q_len, num_q_heads, head_dim) output."""
    q_len, device = q.shape[0], q.device
    key_tiles = -(-seq_len // KEY_TILE)
    blocks = block_row[: -(-seq_len // block_size)].long()
    k = key_cache[blocks].flatten(0, 1)[:seq_len].float()  # (seq_len, kv_heads, D)
    v = value_cache[blocks].flatten(0, 1)[:seq_len].float()
    padded = key_tiles * KEY_TILE
    k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, padded - seq_len))
    v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, padded - seq_len))
    k_tiles = k.permute(1, 0, 2).reshape(num_kv_heads, key_tiles, KEY_TILE, head_dim)
    v_tiles = v.permute(1, 0, 2).reshape(num_kv_heads, key_tiles, KEY_TILE, head_dim)

    # Rows per KV head: token-major, the group's query heads side by side; positions of each row.
    rows = q.float().reshape(q_len, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    rows = rows.reshape(num_kv_heads, q_len * group, head_dim)
    positions = torch.arange(seq_len - q_len, seq_len, device=device).repeat_interleave(group)
    n_rows = q_len * group
    row_tiles = -(-n_rows // ROW_TILE)
    rows = torch.nn.functional.pad(rows, (0, 0, 0, row_tiles * ROW_TILE - n_rows))
    positions = torch.nn.functional.pad(positions, (0, row_tiles * ROW_TILE - n_rows), value=-1)
    key_pos = torch.arange(padded, device=device).reshape(key_tiles, KEY_TILE)

    result = torch.empty((num_kv_heads, row_tiles * ROW_TILE, head_dim), device=device)
    for t in range(row_tiles):
        pos = positions[t * ROW_TILE : (t + 1) * ROW_TILE]  # (R,)
        last = int(pos.max()) // KEY_TILE + 1 if int(pos.max()) >= 0 else 1
        q_tile = rows[:, t * ROW_TILE : (t + 1) * ROW_TILE]  # (H, R, D)
        kt, vt = k_tiles[:, :last], v_tiles[:, :last]  # (H, J, KT, D)
        qb = q_tile.unsqueeze(1).expand(num_kv_heads, last, ROW_TILE, head_dim)
        qb = qb.reshape(-1, ROW_TILE, head_dim)
        s = torch.bmm(qb, kt.reshape(-1, KEY_TILE, head_dim).transpose(1, 2))
        s = s.reshape(num_kv_heads, last, ROW_TILE, KEY_TILE) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        kp = key_pos[:last].unsqueeze(1)  # (J, 1, KT)
        hidden = (kp > pos[None, :, None]) | (kp >= seq_len)
        if window is not None:
            hidden |= kp <= pos[None, :, None] - window
        s = s.masked_fill(hidden, float("-inf"))
        m = s.amax(dim=(1, 3), keepdim=True)  # exact: the order of a max does not matter
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        p = torch.exp(s - m)  # (H, J, R, KT)
        tile_sums = p.sum(-1)  # (H, J, R): KEY_TILE lanes each
        pv = torch.bmm(p.reshape(-1, ROW_TILE, KEY_TILE), vt.reshape(-1, KEY_TILE, head_dim))
        pv = pv.reshape(num_kv_heads, last, ROW_TILE, head_dim)
        total = torch.zeros((num_kv_heads, ROW_TILE), device=device)
        acc = torch.zeros((num_kv_heads, ROW_TILE, head_dim), device=device)
        for j in range(last):  # tile order, from zero
            total = total + tile_sums[:, j]
            acc = acc + pv[:, j]
        result[:, t * ROW_TILE : (t + 1) * ROW_TILE] = acc / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    out = result[:, :n_rows].reshape(num_kv_heads, q_len, group, head_dim).permute(1, 0, 2, 3)
    return out.reshape(q_len, num_kv_heads * group, head_dim)


__all__ = ["KEY_TILE", "ROW_TILE", "paged_attention_invariant_torch"]
