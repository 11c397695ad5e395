"""Hugging Face attention that reads and writes Bridge's paged KV cache.

Registered with transformers' `AttentionInterface` as "bridge_paged", so an unmodified Hugging
Face decoder (llama, qwen2, qwen3, ...) loaded with `attn_implementation="bridge_paged"` runs
its own projections, norms and rotary embeddings and hands q/k/v to us. The batch is packed as
one sequence `(1, T)`; which rows belong to which request, and where their KV lives, comes from
the `ForwardContext` the model runner sets around the forward pass. Because the name is not a
known mask implementation, transformers builds no `(T, T)` mask at all.
"""

from __future__ import annotations

import torch

from runner.attention_metadata import AttentionMetadata, get_forward_context

ATTN_IMPLEMENTATION = "bridge_paged"

try:  # the Triton/torch backends of the paged-attention module
    from runner.paged_attention import paged_attention, write_kv
except ImportError:  # pragma: no cover - only until runner/paged_attention.py lands

    def write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        bs = key_cache.shape[1]
        key_cache[slots // bs, slots % bs] = key[valid].to(key_cache.dtype)
        value_cache[slots // bs, slots % bs] = value[valid].to(value_cache.dtype)

    def paged_attention(query, key_cache, value_cache, meta: AttentionMetadata, scale, out=None):
        num_heads, bs = query.shape[1], key_cache.shape[1]
        out = torch.empty_like(query) if out is None else out
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for b in range(meta.num_reqs):
            q = query[qsl[b] : qsl[b + 1]]
            q_len, seq_len = q.shape[0], seq_lens[b]
            blocks = meta.block_tables[b, : -(-seq_len // bs)].long()
            k = key_cache[blocks].flatten(0, 1)[:seq_len]
            v = value_cache[blocks].flatten(0, 1)[:seq_len]
            rep = num_heads // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
                attn_mask=mask, scale=scale,
            )
            out[qsl[b] : qsl[b + 1]] = o.transpose(0, 1)
        return out


def bridge_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """q `(1, Hq, T, D)`, k/v `(1, Hkv, T, D)` -> attention output `(1, T, Hq, D)` as HF expects.

    Writes this step's K/V into the layer's cache at `slot_mapping`, then attends over the
    whole cached context of each request (earlier chunks, earlier steps and this step).
    """
    if sliding_window is not None:
        raise NotImplementedError("bridge_paged attention does not support sliding-window layers")
    ctx = get_forward_context()
    meta = ctx.attn_metadata
    key_cache, value_cache = ctx.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = paged_attention(q, key_cache, value_cache, meta, scaling)
    return out.unsqueeze(0), None


def register_bridge_attention() -> str:
    """Make "bridge_paged" a valid `attn_implementation` (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, bridge_paged_attention)
    return ATTN_IMPLEMENTATION


register_bridge_attention()
