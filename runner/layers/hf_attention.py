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

from runner.layers.attention_metadata import get_forward_context
from runner.layers.paged_attention import Backend, paged_attention, write_kv

ATTN_IMPLEMENTATION = "bridge_paged"

_backend: Backend = "auto"


def set_attention_backend(backend: Backend) -> Backend:
    """Pick the paged-attention backend ("auto": Triton on CUDA, torch on CPU); returns the previous one.

    Tests use "triton" on the CPU (under TRITON_INTERPRET=1) to run the GPU kernels inside the engine.
    """
    global _backend
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {backend!r}; use 'auto', 'torch' or 'triton'")
    previous, _backend = _backend, backend
    return previous


def get_attention_backend() -> Backend:
    """The backend `set_attention_backend` picked (the fused decoder layers attend through it too)."""
    return _backend


def bridge_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """q `(1, Hq, T, D)`, k/v `(1, Hkv, T, D)` -> attention output `(1, T, Hq, D)` as HF expects.

    Writes this step's K/V into the layer's cache at `slot_mapping`, then attends over the
    whole cached context of each request (earlier chunks, earlier steps and this step).
    `sliding_window` and `softcap` are the layer's own (HF passes None on full-attention layers): the
    window hides keys more than W-1 positions back, the cap bounds the logits; the cache keeps every key.
    Attention sinks (`s_aux`) have no equivalent here: `runner.worker.model_states` refuses such a model at
    `LLM(...)`, so reaching this with them is a bug, reported as such.
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("bridge_paged attention does not support attention sinks (s_aux)")
    ctx = get_forward_context()
    meta = ctx.attn_metadata
    key_cache, value_cache = ctx.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    write_kv(k, v, key_cache, value_cache, meta.slot_mapping, backend=_backend)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = paged_attention(q, key_cache, value_cache, meta, scaling, backend=_backend,
                          sliding_window=sliding_window, softcap=softcap,
                          batch_invariant=ctx.batch_invariant)
    return out.unsqueeze(0), None


def register_bridge_attention() -> str:
    """Make "bridge_paged" a valid `attn_implementation` (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, bridge_paged_attention)
    return ATTN_IMPLEMENTATION


register_bridge_attention()
