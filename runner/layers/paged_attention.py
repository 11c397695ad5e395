"""Paged attention for the runner: the KV write, a torch reference path and the backend dispatcher.

KV cache layout, per decoder layer: `key_cache` and `value_cache` are each
(num_blocks, block_size, num_kv_heads, head_dim). A flat slot `s` is block `s // block_size`, offset
`s % block_size`; `AttentionMetadata.block_tables[b]` lists request b's blocks in position order.

Two backends compute the same thing:

- "triton" (default for CUDA tensors): the kernels of `runner.layers.paged_attention_triton`. The decode
  path is CUDA-graph capturable. It also runs on CPU tensors under `TRITON_INTERPRET=1`, which is how
  the tests check it against the torch path.
- "torch" (default for CPU tensors): per request, gather the K/V of its blocks, then a plain fp32
  matmul-softmax-matmul with a causal offset mask. Simple enough to trust, and the reference the kernels
  are tested against. It loops over requests on the host (it reads `query_start_loc_cpu` /
  `seq_lens_cpu` when the runner filled them, else copies the device tensors once per call).

Per-layer variants, both backends (passed by the layer, as Hugging Face passes them to its attention
functions): `sliding_window=W` lets the query at position p see keys p-W+1..p, W keys counting its
own, as transformers' masks (`kv_idx > q_idx - W`) and flash-attention (`window_size=(W-1, .)`) do;
the cache keeps every key, only the visible range changes. `softcap=c` caps every logit as
`c * tanh(logit / c)` after the scale and before the mask (Gemma 2's attention soft-capping).

The KV write (`write_kv`) on CUDA is a one-program-per-token Triton kernel that returns early for slot -1:
no host sync, no dummy slot reserved in the cache, capturable. On CPU it is an `index_put_` of the rows
whose slot is >= 0 (a boolean selection, which syncs; harmless on the CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from runner.layers.attention_metadata import AttentionMetadata
from runner.layers.paged_attention_invariant import paged_attention_invariant_torch

if TYPE_CHECKING:
    from runner.layers.paged_attention_triton import DecodeConfig, PrefillConfig

Backend = Literal["auto", "torch", "triton"]


def _resolve_backend(backend: Backend, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown paged-attention backend {backend!r}; use 'auto', 'torch' or 'triton'")
    return backend


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be (num_blocks, block_size, num_kv_heads, head_dim), got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache is {key_cache.dtype} but value_cache is {value_cache.dtype}")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """Write this step's key/value rows (num_tokens, num_kv_heads, head_dim) into their cache slots.

    `slot_mapping` (num_tokens,) holds flat slots; -1 rows (padding) are skipped and leave the cache as it
    was. Inputs may be strided views (e.g. transposed projections); values are cast to the cache dtype.
    """
    _check_cache(key_cache, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if key.dim() != 3 or key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key/value must be (num_tokens, {num_kv_heads}, {head_dim}), got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be ({key.shape[0]},), got {tuple(slot_mapping.shape)}")
    if _resolve_backend(backend, key.device) == "triton":
        from runner.layers.paged_attention_triton import write_kv_triton

        write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
        return
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    index = (slots // block_size, slots % block_size)
    key_cache.index_put_(index, key[keep].to(key_cache.dtype))
    value_cache.index_put_(index, value[keep].to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Causal attention of this step's queries over the paged KV cache -> (num_tokens, num_q_heads, head_dim).

    `query` is (num_tokens, num_q_heads, head_dim), packed request after request as `meta.query_start_loc`
    says; num_q_heads must be a multiple of num_kv_heads (GQA). Query row i of request b sits at position
    `seq_lens[b] - q_len_b + i` and sees keys 0..that position, whose K/V `write_kv` has already stored.
    Rows outside every request (trailing padding) are left as they were in `out` (unspecified when `out`
    is None); a request with seq_len 0 and one row (padded decode batch) gets zeros.
    `decode_config` / `prefill_config` override the Triton launch parameters (ignored by the torch path).
    `sliding_window` / `softcap`: see the module docstring (None: full causal attention, no cap).
    `batch_invariant`: every row's bits independent of the step it runs in (decode, chunk, whole prompt,
    batch): the Triton kernels' invariant launch, or `runner.layers.paged_attention_invariant` on the
    torch path; `EngineConfig.batch_invariant` sets it through the forward context.
    """
    _check_cache(key_cache, value_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be (num_tokens, num_q_heads, head_dim), got {tuple(query.shape)}")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {key_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != key_cache.dtype:
        raise ValueError(f"query is {query.dtype} but the KV cache is {key_cache.dtype}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape:
        raise ValueError(f"out must be {tuple(query.shape)}, got {tuple(out.shape)}")
    if _resolve_backend(backend, query.device) == "triton":
        from runner.layers.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, meta, scale, out,
            decode_config=decode_config, prefill_config=prefill_config,
            sliding_window=sliding_window, softcap=softcap, batch_invariant=batch_invariant,
        )  # fmt: skip
    if batch_invariant:
        return paged_attention_invariant_torch(query, key_cache, value_cache, meta, scale, out,
                                               sliding_window=sliding_window, softcap=softcap)
    return paged_attention_torch(query, key_cache, value_cache, meta, scale, out,
                                 sliding_window=sliding_window, softcap=softcap)


def paged_attention_torch(
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
    """Reference path: per request, gather K/V from the block table and attend in fp32. Writes `out`."""
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
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[b, :num_blocks].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].float()  # (seq_len, kv_heads, head_dim)
        v = value_cache[blocks].flatten(0, 1)[:seq_len].float()
        q = query[q_start:q_end].float().reshape(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if sliding_window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(q_len, num_kv_heads * group, head_dim)
        out[q_start:q_end] = o.to(out.dtype)
    return out
