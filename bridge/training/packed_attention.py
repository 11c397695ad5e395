"""Attention that never crosses samples in a packed row, and the decoder arguments for a batch.

Three ways to keep packed samples apart, all behind the model's own Hugging Face attention layers
(the q/k/v projections, norms and rotary embedding stay theirs):

- "varlen" (CUDA, bf16/fp16): `torch.nn.attention.varlen.varlen_attn`, PyTorch's FlashAttention
  varlen kernel. The rows are flattened into one token stream cut at `cu_seqlens`; no mask is
  built and no masked-out block is computed. Registered with transformers' AttentionInterface as
  `bridge_varlen`, so the decoder calls it in place of SDPA.
- "sdpa": the model's SDPA with a block-diagonal causal mask (rows x 1 x L x L booleans), for the
  CPU and fp32, where the flash kernel does not run.
- "flex": `flex_attention` with a BlockMask over the segment ids (transformers' flex path), which
  skips whole blocks outside the diagonal; kept as a measured alternative.

Positions restart per sample through `position_ids` (rotary models, M-RoPE text positions too:
those models expand 2-D position ids over their sections).
"""

from __future__ import annotations

from typing import Any

import torch

from bridge.training.batching import TrainBatch

VARLEN_NAME = "bridge_varlen"
MODES = ("varlen", "sdpa", "flex")


def varlen_available(device: torch.device) -> bool:
    if torch.device(device).type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def choose_mode(device: torch.device, compute_dtype: torch.dtype) -> str:
    """varlen where the flash kernel runs (CUDA, half precision), else the masked SDPA."""
    if varlen_available(device) and compute_dtype in (torch.bfloat16, torch.float16):
        return "varlen"
    return "sdpa"


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (B, Hq, L, D), k/v (B, Hkv, L, D) in, the
    output (B, L, Hq, D) out. A call without `cu_seq_lens_q` (an unpacked batch) is plain causal
    SDPA, so the same model also runs padded batches."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    from torch.nn.attention.varlen import varlen_attn

    if dropout:
        raise ValueError("packed varlen attention has no dropout; set the model's attention_dropout to 0")
    if query.dtype not in (torch.bfloat16, torch.float16):
        # fp32 LLM weights under autocast (a trained LLM keeps fp32 master weights): the norms hand
        # fp32 q/k; autocast would run SDPA in its half dtype, and so does this kernel
        if not torch.is_autocast_enabled(query.device.type):
            raise ValueError("packed varlen attention needs bf16/fp16 q/k/v or bf16 autocast")
        half = torch.get_autocast_dtype(query.device.type)
        query, key, value = (x.to(half) for x in (query, key, value))
    b, heads, length, dim = query.shape
    q = query.transpose(1, 2).reshape(b * length, heads, dim)
    k = key.transpose(1, 2).reshape(b * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(b * length, value.shape[1], dim)
    window = (sliding_window - 1, 0) if sliding_window else (-1, 0)
    out = varlen_attn(
        q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, window_size=window
    )
    return out.view(b, length, heads, dim), None


def use_mode(llm: torch.nn.Module, mode: str) -> None:
    """Point the LLM's attention layers at the kernel `mode` needs (varlen registers its function
    once; sdpa keeps the model's own)."""
    if mode not in MODES:
        raise ValueError(f"packed attention mode {mode!r} is not one of {list(MODES)}")
    name = {"varlen": VARLEN_NAME, "sdpa": "sdpa", "flex": "flex_attention"}[mode]
    if mode == "varlen":
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN_NAME, varlen_attention_forward)
    for config in _configs(llm):
        config._attn_implementation = name


def _configs(llm: torch.nn.Module) -> list:
    """The configs whose `_attn_implementation` the decoder's layers read (the text sub-config of a
    multimodal checkpoint too)."""
    seen, out = set(), []
    for module in llm.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            out.append(config)
    return out


def block_diagonal_mask(segment_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """(R, 1, L, L) bool, True where query i may attend key j: same segment and j <= i."""
    length = segment_ids.shape[1]
    pos = torch.arange(length, device=segment_ids.device)
    causal = pos[None, :] <= pos[:, None]
    if sliding_window:
        causal = causal & (pos[:, None] - pos[None, :] < sliding_window)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal[None]).unsqueeze(1)


def flex_block_mask(segment_ids: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q_idx, kv_idx):
        return (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (kv_idx <= q_idx)

    rows, length = segment_ids.shape
    return create_block_mask(document_causal, rows, None, length, length, device=segment_ids.device)


def decoder_kwargs(batch: TrainBatch, mode: str, sliding_window: int | None = None) -> dict[str, Any]:
    """Keyword arguments for the decoder's forward: the padding mask of a padded batch, or the
    restarting positions and the sample boundaries of a packed one, in the form `mode` reads."""
    if not batch.packed:
        return {"attention_mask": batch.attention_mask}
    kwargs: dict[str, Any] = {"position_ids": batch.position_ids}
    if mode == "varlen":
        kwargs.update(
            cu_seq_lens_q=batch.cu_seqlens,
            cu_seq_lens_k=batch.cu_seqlens,
            max_length_q=batch.max_seqlen,
            max_length_k=batch.max_seqlen,
        )
    elif mode == "flex":
        kwargs["attention_mask"] = flex_block_mask(batch.segment_ids)
    else:
        kwargs["attention_mask"] = block_diagonal_mask(batch.segment_ids, sliding_window)
    return kwargs


def resolve_packing(train: Any, model: torch.nn.Module, llm: torch.nn.Module, device: torch.device) -> dict:
    """A recipe's `train.packing` / `train.pack_length` -> collate_examples' keyword arguments,
    with the model switched to the attention that keeps packed samples apart.

    packing null: on where the varlen kernel runs (CUDA and bf16/fp16 compute), where it removes
    the padding at no cost; elsewhere off (the masked fallback costs rows x L x L booleans).
    pack_length null: one row per micro-batch under varlen (the flat stream has no padding at
    all), rows of the longest sample under a mask."""
    from bridge.training.packing import LONGEST

    if train.precision == "bf16" or train.mixed_precision == "bf16":
        compute = torch.bfloat16
    else:
        compute = next((p.dtype for p in llm.parameters() if p.is_floating_point()), torch.float32)
    mode = choose_mode(device, compute)
    pack = train.packing if train.packing is not None else mode == "varlen"
    if not pack:
        return {}
    use_mode(llm, mode)
    model.attention_mode = mode
    length = train.pack_length if train.pack_length is not None else (None if mode == "varlen" else LONGEST)
    return {"pack": True, "pack_length": length}
