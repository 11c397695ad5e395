"""Per-step attention metadata shared by the model runner and the paged-attention backends.

The model runner fills one `AttentionMetadata` per forward pass and publishes it through
`set_forward_context`; the attention function registered with transformers reads it from
there. A module-level context (rather than threading kwargs through Hugging Face modules)
keeps the model definitions untouched and lets CUDA graphs capture fixed tensor addresses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache and what each may attend to.

    The batch is packed as one sequence of `num_tokens` rows, request after request.
    All tensors are on the model device.

    - `slot_mapping` (num_tokens,) int64: flat KV slot (`block_id * block_size + offset`) to
      which each new token's key/value is written; -1 means "do not write" (padding rows).
    - `query_start_loc` (num_reqs + 1,) int32: row offsets of each request's queries.
    - `seq_lens` (num_reqs,) int32: context length of each request after this step
      (tokens already cached + tokens scheduled now). Query row i of request b sits at
      absolute position `seq_lens[b] - q_len_b + i` and attends causally to positions <= it.
    - `block_tables` (num_reqs, max_blocks_per_req) int32: physical KV block ids per request.
    - `max_query_len`, `max_seq_len`: host-side bounds used to size kernel grids.
    - `is_decode_only`: every request has exactly one query token (decode kernel path).
    - `fresh_prefill`: every request with more than one query row starts at position 0 (nothing cached
      before its rows: fresh prompts, or first chunks); set from host data by eager steps, False in
      graph bodies. The prefill kernel picks its launch by it (see `paged_attention_triton`).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_reqs: int
    is_decode_only: bool = False
    fresh_prefill: bool = False
    # Host copies for the CPU (torch) path, which loops over requests on the host.
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)


@dataclass
class ForwardContext:
    """What the attention function needs beyond its q/k/v: the metadata and the KV cache."""

    attn_metadata: AttentionMetadata
    # One (key_cache, value_cache) pair per decoder layer, each shaped
    # (num_blocks, block_size, num_kv_heads, head_dim).
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # `EngineConfig.batch_invariant`: attend with the launch whose rows never depend on the step.
    batch_invariant: bool = False


_CONTEXT: ForwardContext | None = None


def current_forward_context() -> ForwardContext | None:
    """The context of the Bridge forward pass running now, or None outside one (no exception)."""
    return _CONTEXT


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("paged attention called outside of a Bridge forward context")
    return _CONTEXT


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield
    finally:
        _CONTEXT = prev
