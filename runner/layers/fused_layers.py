"""A decoder-layer forward for pre-norm llama-family layers (llama, mistral, qwen2, qwen3) on fused kernels.

Why: a Hugging Face decoder layer runs about fifteen kernels per decode step (input norm, q/k/v,
q_norm, k_norm, rotary, KV write, attention, o_proj, residual add, post norm, gate/up, SiLU*mul,
down_proj, residual add). At decode batch sizes on a small model most of them move a few hundred
kilobytes and cost their launch, not their bytes; on the eager prefill path every launch also costs
tens of microseconds of Python on the host. Here the layer is

    norm -> q/k/v GEMM -> [q_norm, k_norm, rotary, K/V cache write] -> paged attention
         -> o_proj GEMM with the residual add as its epilogue (addmm) -> norm -> gate/up GEMM
         -> SiLU*mul -> down_proj GEMM with the residual add as its epilogue

nine launches, one of them (`qkv_norm_rope_write`) new. The o_proj add goes in place into the hidden
states the previous fused layer returned (`_OWNED`), so it needs no copy of the residual first.
Decode-sized steps (bf16/fp16) fold each norm into the GEMM after it and that GEMM's epilogue kernel
into the GEMM (`runner.layers.norm_gemm`):
q/k/v up to `NORM_GEMM_MAX_ROWS` tokens, gate/up up to `NORM_GATE_UP_MAX_ROWS`:

    [norm -> q/k/v GEMM -> q_norm, k_norm, rotary, K/V cache write] -> paged attention
         -> o_proj addmm -> [norm -> gate/up GEMM -> SiLU*mul] -> [down_proj GEMM + residual]

five launches up to 32 tokens (the last one `runner.layers.down_gemm`'s split-K kernel, which replaces
cuBLAS's split-K GEMM, reduce and copy), six up to 64 (attention counted as one; o_proj, gate/up and
down stay cuBLAS, the post-attention norm folded into gate/up as below).

On CUDA both norms' weights are folded into the merged weights after them at fuse time (`_fold_norm`):
where no norm-GEMM kernel runs, gate/up and q/k/v run on the
unnormalised rows and the kernel after each applies the row's RMS scale, one launch fewer per norm.

How: the layer's modules and loading stay Hugging Face's (with the norms folded, two norm weights are
ones and the merged projection weights hold their products); only the bound `forward` of each fusable
layer instance is replaced, and the replacement takes the fused path only inside a Bridge forward pass
(a `ForwardContext` is set) and calls the original forward everywhere else. It needs
`runner.layers.fused_linear` to have merged q/k/v and gate/up first.

Numerics: the norms round like Hugging Face's (fp32 statistics, round to the input dtype, times
the weight); rotary runs in fp32 and rounds once (as `runner.layers.fused_ops`); the residual adds are
accumulated in the GEMM, so they round once instead of twice. In fp32 that is HF's arithmetic up
to summation order. The norm-GEMM kernels keep every rounding point of the sequences they replace
(the GEMM output rounded to the activation dtype before its epilogue); only summation orders differ.
The norm fold rounds each weight-times-norm-weight product to the weight's dtype once, at load time, and
scales the GEMM's output instead of its input: the logits move within that dtype's rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from runner.layers import pdl
from runner.layers.attention_metadata import current_forward_context
from runner.layers.down_gemm import down_residual_supported, new_counters, residual_gemm
from runner.layers.fused_linear import ROWNORM_MAX_HIDDEN, row_rms_scale, silu_mul, silu_mul_rownorm
from runner.layers.fused_ops import FUSABLE_RMSNORM_CLASSES, rms_norm
from runner.layers.hf_attention import get_attention_backend
from runner.layers.norm_gemm import (
    head_rmsnorm,
    norm_gate_up_silu,
    norm_gemm_supported,
    norm_qkv_rope_write,
    qkv_counters,
    qkv_splits_configured,
)
from runner.layers.paged_attention import paged_attention
from runner.layers.pdl import release_dependents
from runner.layers.triton_launch import launch

FUSABLE_LAYER_CLASSES = frozenset(
    {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
)

# The fused path runs on CUDA tensors only, unless a test turns this on (under TRITON_INTERPRET=1).
FUSED_LAYERS_ON_CPU = False


# Steps of at most this many tokens (decode batches) run each norm + projection + epilogue as one kernel
# (`runner.layers.norm_gemm`); larger ones keep rms_norm + cuBLAS + the epilogue kernel, since each
# program normalises its own rows and that re-read outgrows the saved launches. Gate/up stops earlier, at
# NORM_GATE_UP_MAX_ROWS, where its wider tile stops paying. 0 disables both (tests).
NORM_GEMM_MAX_ROWS = 64
NORM_GATE_UP_MAX_ROWS = 32
# Steps that take norm_gate_up_silu also run the down projection + residual as one split-K kernel
# (`runner.layers.down_gemm`), in place of cuBLAS's split-K GEMM, its reduce and the residual copy.
DOWN_GEMM = True
# Like FUSED_LAYERS_ON_CPU, for the norm-GEMM kernels (tests, under TRITON_INTERPRET=1).
NORM_GEMM_ON_CPU = False
# Programmatic dependent launch (`runner.layers.pdl`, Hopper and later): steps of up to this many tokens
# run o_proj and the down projection as weights-first split-K kernels launched with PDL after the kernels
# that release them early (decode attention, SiLU*mul), so each streams its weights while the kernel
# ahead of it ends. Past 32 rows the kernel only ties cuBLAS.
PDL_MAX_ROWS = 32
# Like NORM_GEMM_ON_CPU, for the PDL kernels (tests: ordinary launches under TRITON_INTERPRET=1).
PDL_ON_CPU = False
# A layer's two RMSNorm weights folded into the merged q/k/v and gate/up weights at fuse time (see
# `_fold_norm`): steps that do not take the norm-GEMM kernels then run those GEMMs on the unnormalised rows
# and the kernel after each applies the row's RMS scale, one launch fewer per norm. Tests turn it off.
FOLD_NORMS = True
# The fold is made for CUDA weights only, unless a test turns this on.
FOLD_ON_CPU = False


def _pdl_here(device: torch.device) -> bool:
    """Whether decode steps on `device` take the PDL kernels: the device launches with PDL (a GPU without
    it keeps cuBLAS; the CPU only for tests)."""
    return pdl.ENABLED and (pdl.pdl_supported(device) if device.type == "cuda" else PDL_ON_CPU)


# ------------------------------------------------------------------------------- q/k/v -> q and KV cache

@triton.jit
def _qkv_norm_rope_write_kernel(
    qkv_ptr, q_out_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_t, stride_qo, stride_c, stride_s, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
    stride_vh, n_q, n_kv, block_size, eps, x_ptr, stride_x, n_hidden, row_eps,
    HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, HAS_NORM: tl.constexpr,
    ROW_SCALE: tl.constexpr, BLOCK_H: tl.constexpr, RELEASE: tl.constexpr,
):
    release_dependents(RELEASE)  # a PDL decode attention after it may start (runner.layers.pdl)
    # One program per token: its q heads go to q_out, its k and v heads to their cache slot.
    t = tl.program_id(0).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    scale = 1.0
    if ROW_SCALE:
        # The projection ran on the unnormalised row, its RMSNorm's weight folded into the q/k/v weight
        # (`_fold_norm`): the row's RMS scale makes it the projection of the normalised row.
        scale = row_rms_scale(x_ptr + t * stride_x, n_hidden, row_eps, BLOCK_H)
    d = tl.arange(0, HALF)[None, :]
    c1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_s + d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_s + HALF + d).to(tl.float32)
    row = qkv_ptr + t * stride_t

    hq = tl.arange(0, BLOCK_Q)[:, None]
    mq = hq < n_q
    x1 = tl.load(row + hq * (2 * HALF) + d, mask=mq, other=0.0).to(tl.float32) * scale
    x2 = tl.load(row + hq * (2 * HALF) + HALF + d, mask=mq, other=0.0).to(tl.float32) * scale
    if HAS_NORM:
        x1, x2 = head_rmsnorm(x1, x2, q_norm_ptr, d, eps, HALF, dtype)
    q_row = q_out_ptr + t * stride_qo + hq * (2 * HALF)
    tl.store(q_row + d, (x1 * c1 - x2 * s1).to(q_out_ptr.dtype.element_ty), mask=mq)
    tl.store(q_row + HALF + d, (x2 * c2 + x1 * s2).to(q_out_ptr.dtype.element_ty), mask=mq)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    hk = tl.arange(0, BLOCK_KV)[:, None]
    in_k = hk < n_kv
    write = in_k & (slot >= 0)  # slot -1: a padding row, nothing is written
    blk = tl.maximum(slot, 0) // block_size
    off = tl.maximum(slot, 0) % block_size
    k_base = row + n_q * (2 * HALF) + hk * (2 * HALF)
    y1 = tl.load(k_base + d, mask=in_k, other=0.0).to(tl.float32) * scale
    y2 = tl.load(k_base + HALF + d, mask=in_k, other=0.0).to(tl.float32) * scale
    if HAS_NORM:
        y1, y2 = head_rmsnorm(y1, y2, k_norm_ptr, d, eps, HALF, dtype)
    k_dst = k_cache_ptr + blk * stride_kb + off * stride_ks + hk * stride_kh
    tl.store(k_dst + d, (y1 * c1 - y2 * s1).to(k_cache_ptr.dtype.element_ty), mask=write)
    tl.store(k_dst + HALF + d, (y2 * c2 + y1 * s2).to(k_cache_ptr.dtype.element_ty), mask=write)

    v_base = k_base + n_kv * (2 * HALF)
    v_dst = v_cache_ptr + blk * stride_vb + off * stride_vs + hk * stride_vh
    v1 = tl.load(v_base + d, mask=in_k, other=0.0)
    v2 = tl.load(v_base + HALF + d, mask=in_k, other=0.0)
    if ROW_SCALE:
        v1 = v1.to(tl.float32) * scale
        v2 = v2.to(tl.float32) * scale
    tl.store(v_dst + d, v1.to(v_cache_ptr.dtype.element_ty), mask=write)
    tl.store(v_dst + HALF + d, v2.to(v_cache_ptr.dtype.element_ty), mask=write)


def qkv_norm_rope_write(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    row_scale: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Split a fused projection `qkv` (T, (Hq + 2 Hkv) D) into heads; return rotated q (T, Hq, D).

    Optionally scales each row by the RMS scale `rsqrt(mean(x**2) + eps)` of the row of `x` that
    produced it first (`row_scale` = (x (T, H), eps): a projection of unnormalised rows with the
    RMSNorm's weight folded into its weight); optionally RMS-normalises every q and k head (`q_norm` =
    (q weight, k weight, eps), Qwen3); rotates q and k by `cos`/`sin` (T, D) as HF's
    `apply_rotary_pos_emb`; writes k and v into the paged caches (num_blocks, block_size, Hkv, D) at
    `slot_mapping` (-1: not written).
    """
    t = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    half = head_dim // 2
    if head_dim % 2 or half & (half - 1):
        raise ValueError(f"head_dim must be twice a power of two, got {head_dim}")
    if qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be (T, {(num_q_heads + 2 * num_kv_heads) * head_dim}) with unit "
                         f"last stride, got {tuple(qkv.shape)}")
    if cos.shape != (t, head_dim) or sin.shape != (t, head_dim) or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"cos/sin must be ({t}, {head_dim}) with unit last stride")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV caches must have unit stride along head_dim")
    q_out = torch.empty((t, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q_out
    qw, kw, eps = q_norm if q_norm is not None else (qkv, qkv, 0.0)  # unused pointers without a norm
    x, row_eps = row_scale if row_scale is not None else (qkv, 0.0)  # unused without a row scale
    if row_scale is not None and (x.dim() != 2 or x.shape[0] != t or x.stride(1) != 1
                                  or x.shape[1] > ROWNORM_MAX_HIDDEN):
        raise ValueError(f"row_scale's rows must be ({t}, H <= {ROWNORM_MAX_HIDDEN}) with unit last stride, "
                         f"got {tuple(x.shape)}")
    launch(_qkv_norm_rope_write_kernel, (t,))(
        qkv, q_out, cos, sin, qw, kw, slot_mapping, key_cache, value_cache,
        qkv.stride(0), q_out.stride(0), cos.stride(0), sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_q_heads, num_kv_heads, key_cache.shape[1], eps, x, x.stride(0), x.shape[1], row_eps,
        HALF=half, BLOCK_Q=triton.next_power_of_2(num_q_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        HAS_NORM=q_norm is not None, ROW_SCALE=row_scale is not None,
        BLOCK_H=triton.next_power_of_2(x.shape[1]) if row_scale is not None else 1,
        RELEASE=pdl.use_pdl(qkv.device), num_warps=4,
    )  # fmt: skip
    return q_out


# ------------------------------------------------------------------------------------------- layer

def layer_sliding_window(attn: torch.nn.Module) -> int | None:
    """The window HF's forward of this attention module passes to the attention function, or None.

    Qwen2/Qwen3 keep it per layer (`attn.sliding_window`, None on full-attention layers); Mistral passes
    `config.sliding_window` on every layer.
    """
    if type(attn).__name__ == "MistralAttention":
        return getattr(attn.config, "sliding_window", None)
    return getattr(attn, "sliding_window", None)


def _is_plain_norm(module) -> bool:
    return type(module).__name__ in FUSABLE_RMSNORM_CLASSES and hasattr(module, "variance_epsilon")


def _layer_fusable(layer: torch.nn.Module) -> bool:
    if type(layer).__name__ not in FUSABLE_LAYER_CLASSES or hasattr(layer, "bridge_original_forward"):
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    if not hasattr(attn, "bridge_qkv_weight") or not hasattr(mlp, "bridge_gate_up_weight"):
        return False  # runner.layers.fused_linear did not merge this layer's projections
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    qk_norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if not all(_is_plain_norm(n) for n in norms):
        return False
    if any(n is not None for n in qk_norms):
        if not all(_is_plain_norm(n) for n in qk_norms):
            return False
        if qk_norms[0].variance_epsilon != qk_norms[1].variance_epsilon:
            return False  # the kernel normalises q and k heads with one eps
    linears = (attn.o_proj, mlp.down_proj)
    head_dim = getattr(attn, "head_dim", None)
    return (all(type(m) is torch.nn.Linear for m in linears) and head_dim is not None
            and all(s % head_dim == 0 for s in attn.bridge_qkv_sizes)
            and attn.bridge_qkv_sizes[1] == attn.bridge_qkv_sizes[2])


def _linear_plus_residual(residual: torch.Tensor, x: torch.Tensor, linear: torch.nn.Linear,
                          inplace: bool = False) -> torch.Tensor:
    """residual + linear(x), the add folded into the GEMM (one launch, one rounding).

    `inplace` accumulates into `residual` itself (only for a tensor no one reads after this layer: its
    own, or its predecessor's output, see `_OWNED`): out of place, torch first copies the residual into
    the new output, one more launch (a copy kernel in every CUDA graph).
    """
    if linear.bias is None:
        if inplace:
            return residual.addmm_(x, linear.weight.t())
        return torch.addmm(residual, x, linear.weight.t())
    return residual + F.linear(x, linear.weight, linear.bias)


# The attribute a fused layer sets on the hidden states it returns. Such a tensor is the layer's own, and
# Hugging Face's decoder loop hands it to the next layer and drops it, so the next fused layer may add
# its o_proj into it in place instead of copying it first (one launch fewer a layer; the embeddings that
# enter layer 0 are never written). Anything else in between (a hook that replaces the output, a layer
# left unfused) hands over an untagged tensor, which is not written.
_OWNED = "_bridge_fused_layer_output"
# Tests: False copies every layer's input first.
RESIDUAL_IN_PLACE = True


def _owned_output(x: torch.Tensor) -> torch.Tensor:
    out = x.unsqueeze(0)
    setattr(out, _OWNED, True)
    return out


def _fused_layer_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    ctx = current_forward_context()
    pos = kwargs.get("position_embeddings")
    if (ctx is None or args or pos is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1
            or not (hidden_states.is_cuda or FUSED_LAYERS_ON_CPU)):
        return layer.bridge_original_forward(hidden_states, *args, **kwargs)
    cos, sin = pos
    t = hidden_states.shape[1]
    if cos.shape[0] != 1 or cos.dim() != 3 or cos.shape[1] != t or sin.shape != cos.shape:
        return layer.bridge_original_forward(hidden_states, *args, **kwargs)
    attn, mlp = layer.self_attn, layer.mlp
    owned = RESIDUAL_IN_PLACE and getattr(hidden_states, _OWNED, False)  # the previous fused layer's output
    meta = ctx.attn_metadata
    key_cache, value_cache = ctx.kv_caches[attn.layer_idx]
    head_dim = attn.head_dim
    x = hidden_states[0]

    norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
    qk_norm = None
    if getattr(attn, "q_norm", None) is not None:
        qk_norm = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon)
    n_q, n_kv = attn.bridge_qkv_sizes[0] // head_dim, attn.bridge_qkv_sizes[1] // head_dim
    # A decode-sized step: norm + GEMM + epilogue as one kernel each (runner.layers.norm_gemm).
    norm_gemm = (t <= NORM_GEMM_MAX_ROWS and (x.is_cuda or NORM_GEMM_ON_CPU) and norm_gemm_supported(
        x, norm.weight, post_norm.weight, attn.bridge_qkv_weight, attn.bridge_qkv_bias,
        mlp.bridge_gate_up_weight))
    if norm_gemm:
        q = norm_qkv_rope_write(
            x, norm.weight, norm.variance_epsilon, attn.bridge_qkv_weight, attn.bridge_qkv_bias, n_q, n_kv,
            cos[0], sin[0], key_cache, value_cache, meta.slot_mapping, qk_norm,
            counters=getattr(attn, "bridge_qkv_counters", None),
        )
    elif getattr(layer, "bridge_input_norm_folded", False):  # the norm's weight is in the q/k/v weight
        q = qkv_norm_rope_write(
            F.linear(x, attn.bridge_qkv_weight), n_q, n_kv, cos[0], sin[0], key_cache, value_cache,
            meta.slot_mapping, qk_norm, row_scale=(x, norm.variance_epsilon),
        )
    else:
        h = rms_norm(x, norm.weight, norm.variance_epsilon)
        qkv = F.linear(h, attn.bridge_qkv_weight, attn.bridge_qkv_bias)
        q = qkv_norm_rope_write(
            qkv, n_q, n_kv, cos[0], sin[0], key_cache, value_cache, meta.slot_mapping, qk_norm,
        )
    o = paged_attention(q, key_cache, value_cache, meta, attn.scaling, backend=get_attention_backend(),
                        sliding_window=layer_sliding_window(attn))
    o = o.view(t, -1)
    o_counters = getattr(attn, "bridge_o_counters", None)  # set at fuse time where PDL runs (_pdl_here)
    with_pdl = (o_counters is not None and t <= PDL_MAX_ROWS
                and down_residual_supported(x, o, attn.o_proj.weight, silu=False))
    if with_pdl:  # attention released it: the o_proj weights stream in as attention ends
        x = residual_gemm(x, o, attn.o_proj.weight, o_counters, pdl=True, out=x if owned else None)
    else:
        x = _linear_plus_residual(x, o, attn.o_proj, inplace=owned)

    if norm_gemm and t <= NORM_GATE_UP_MAX_ROWS:  # (a folded norm's weight is ones)
        act = norm_gate_up_silu(x, post_norm.weight, post_norm.variance_epsilon, mlp.bridge_gate_up_weight)
    elif getattr(layer, "bridge_post_norm_folded", False):
        act = silu_mul_rownorm(F.linear(x, mlp.bridge_gate_up_weight), x, post_norm.variance_epsilon)
    else:
        h = rms_norm(x, post_norm.weight, post_norm.variance_epsilon)
        act = silu_mul(F.linear(h, mlp.bridge_gate_up_weight))  # releases a PDL down projection early
    counters = getattr(mlp, "bridge_down_counters", None)
    if (counters is not None and (with_pdl or (DOWN_GEMM and norm_gemm and t <= NORM_GATE_UP_MAX_ROWS))
            and t <= mlp.bridge_down_max_rows and down_residual_supported(x, act, mlp.down_proj.weight,
                                                                          silu=False)):
        # x is this layer's own tensor (the o_proj sum): the kernel adds into it in place.
        return _owned_output(residual_gemm(x, act, mlp.down_proj.weight, counters, out=x, pdl=with_pdl))
    # x is this layer's own tensor now (the o_proj sum), so the second residual add can go in place.
    x = _linear_plus_residual(x, act, mlp.down_proj, inplace=True)
    return _owned_output(x)


@torch.no_grad()
def _fold_norm(norm: torch.nn.Module, w: torch.Tensor) -> bool:
    """Fold an RMSNorm's weight into the columns of the merged weight `w` it feeds; True when done.

    `RMSNorm(x) = weight * (x * r)` with `r = rsqrt(mean(x**2) + eps)` per row, so `W @ RMSNorm(x) =
    r * ((W * weight) @ x)`: with the weight in the GEMM's columns the norm's own launch goes, and the
    kernel after the GEMM applies `r` (`silu_mul_rownorm`, `qkv_norm_rope_write(row_scale=...)`). Every
    path stays the same model: the norm's weight becomes ones (HF's forward and the norm-GEMM kernels
    still normalise, by ones) and `w` is what the projections view. The products round to the weight's
    dtype once here, so logits move within that dtype's rounding: a choice (`FOLD_NORMS`), not an
    identity.
    """
    if (not FOLD_NORMS or not (w.is_cuda or FOLD_ON_CPU) or tuple(norm.weight.shape) != (w.shape[1],)
            or w.shape[1] > ROWNORM_MAX_HIDDEN):  # the kernels that apply the row scale hold a whole row
        return False
    w.copy_((w.float() * norm.weight.float()).to(w.dtype))
    norm.weight.fill_(1.0)
    return True


def _fold_layer_norms(layer: torch.nn.Module) -> None:
    """Both of a fused layer's RMSNorms into the merged weights after them (`_fold_norm`); the input norm
    only where q/k/v have no bias (`r * (W x) + b` is not what a GEMM with the bias computes)."""
    if _fold_norm(layer.post_attention_layernorm, layer.mlp.bridge_gate_up_weight):
        layer.bridge_post_norm_folded = True
    attn = layer.self_attn
    if attn.bridge_qkv_bias is None and _fold_norm(layer.input_layernorm, attn.bridge_qkv_weight):
        layer.bridge_input_norm_folded = True


def fuse_decoder_layers(model: torch.nn.Module) -> int:
    """Give every fusable decoder layer of `model` the fused forward; returns how many.

    Run after `runner.layers.fused_linear.fuse_linears` (the fused forward uses its merged weights); layers
    it could not merge, and layer classes not listed, keep Hugging Face's forward.
    """
    count = 0
    for layer in model.modules():
        if not _layer_fusable(layer):
            continue
        layer.bridge_original_forward = layer.forward
        layer.forward = functools.partial(_fused_layer_forward, layer)
        _fold_layer_norms(layer)
        down, o_proj = layer.mlp.down_proj, layer.self_attn.o_proj
        with_pdl = _pdl_here(o_proj.weight.device)
        max_rows = max(NORM_GATE_UP_MAX_ROWS, PDL_MAX_ROWS if with_pdl else 0)
        if (DOWN_GEMM or with_pdl) and down.bias is None:  # the kernels' arrival counters, before capture
            counters = new_counters(down.weight.shape[0], max_rows, down.weight.device)
            layer.mlp.register_buffer("bridge_down_counters", counters, persistent=False)
            layer.mlp.bridge_down_max_rows = max_rows  # what the counters are sized for
        if qkv_splits_configured():  # split-K q/k/v (norm_gemm.QKV_CONFIGS): its arrival counters
            attn = layer.self_attn
            heads = sum(attn.bridge_qkv_sizes) // attn.head_dim
            counters = qkv_counters(heads, NORM_GEMM_MAX_ROWS, attn.bridge_qkv_weight.device)
            attn.register_buffer("bridge_qkv_counters", counters, persistent=False)
        if with_pdl and o_proj.bias is None:
            counters = new_counters(o_proj.weight.shape[0], PDL_MAX_ROWS, o_proj.weight.device)
            layer.self_attn.register_buffer("bridge_o_counters", counters, persistent=False)
        count += 1
    return count
