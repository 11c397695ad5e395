"""One-kernel RMSNorm and rotary embedding for Hugging Face decoder modules (llama, qwen2, qwen3, mistral).

Why (RMSNorm): Hugging Face's RMSNorm is seven or eight elementwise kernels (cast, pow, mean, add, rsqrt,
mul, cast, mul). A decode step of a 28-layer Qwen3 runs four norms per layer (input, post-attention,
q_norm, k_norm), so about 800 tiny launches per step, each a few microseconds of GPU time even
inside a CUDA graph: at small batch that is comparable to reading the weights. One Triton kernel
per norm does the same arithmetic in the same order (fp32 statistics, round to the input dtype,
then multiply by the weight) and keeps the modules, their weights and their loading untouched:
only the bound `forward` of the norm instances is replaced.

Why (rotary): `apply_rotary_pos_emb` is about ten elementwise kernels per layer (two products, a
slice-negate-concatenate and a sum, for q and for k). One Triton launch per layer rotates both.
It replaces the modeling module's function with a wrapper that takes the fused path only inside
a Bridge forward pass (a `ForwardContext` is set) and calls the original everywhere else, so other
users of the same transformers classes in the process are unaffected.
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl

from runner.layers.attention_metadata import current_forward_context
from runner.layers.triton_launch import launch

# Norm classes whose forward is exactly: x32 = x.float(); x32 * rsqrt(mean(x32^2) + eps);
# cast back to x.dtype; multiply by `weight`. (Gemma-style `1 + weight` norms are not listed.)
FUSABLE_RMSNORM_CLASSES = frozenset(
    {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen2VLRMSNorm"}
)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, n_rows, n_cols, n_inner, stride_a, stride_b, eps,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # Input row r sits at (r // n_inner) * stride_a + (r % n_inner) * stride_b: a strided view such as
    # the q part of a fused q/k/v projection is read in place; the output is contiguous.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    x_off = (rows // n_inner) * stride_a + (rows % n_inner) * stride_b
    x = tl.load(x_ptr + x_off + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=1) / n_cols
    rstd = tl.rsqrt(var + eps)
    y = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * n_cols + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, Hugging Face semantics; returns a new (contiguous) tensor.

    `x` may be a strided view whose last dimension has unit stride (no copy when its leading
    dimensions merge into one stride).
    """
    n_cols = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3 = x.reshape(-1, x.shape[-2] if x.dim() >= 2 else 1, n_cols)  # a view whenever dims merge
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    n_inner = x3.shape[1]
    n_rows = x3.shape[0] * n_inner
    block_n = triton.next_power_of_2(n_cols)
    block_r = max(1, min(64, 4096 // block_n))
    launch(_rmsnorm_kernel, (triton.cdiv(n_rows, block_r),))(
        x3, weight, out, n_rows, n_cols, n_inner, x3.stride(0), x3.stride(1), eps,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )
    return out


def _fused_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def fuse_rmsnorms(model: torch.nn.Module) -> int:
    """Swap the forward of every known RMSNorm instance in `model` for the one-kernel version.

    Returns how many norms were swapped (0 leaves the model as it was).
    """
    count = 0
    for module in model.modules():
        if type(module).__name__ in FUSABLE_RMSNORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = functools.partial(_fused_forward, module)
            count += 1
    return count


# ------------------------------------------------------------------------------------------- rotary

@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, n_q, n_k,
                 sq_h, sq_t, sk_h, sk_t, sqo_h, sqo_t, sko_h, sko_t, sc_t, ss_t,
                 HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, HALF)[None, :]
    c1 = tl.load(cos_ptr + t * sc_t + d).to(tl.float32)
    c2 = tl.load(cos_ptr + t * sc_t + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * ss_t + d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * ss_t + HALF + d).to(tl.float32)

    hq = tl.arange(0, BLOCK_Q)[:, None]
    mq = hq < n_q
    x1 = tl.load(q_ptr + hq * sq_h + t * sq_t + d, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(q_ptr + hq * sq_h + t * sq_t + HALF + d, mask=mq, other=0.0).to(tl.float32)
    tl.store(qo_ptr + hq * sqo_h + t * sqo_t + d, (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty), mask=mq)
    tl.store(qo_ptr + hq * sqo_h + t * sqo_t + HALF + d, (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty),
             mask=mq)

    hk = tl.arange(0, BLOCK_K)[:, None]
    mk = hk < n_k
    y1 = tl.load(k_ptr + hk * sk_h + t * sk_t + d, mask=mk, other=0.0).to(tl.float32)
    y2 = tl.load(k_ptr + hk * sk_h + t * sk_t + HALF + d, mask=mk, other=0.0).to(tl.float32)
    tl.store(ko_ptr + hk * sko_h + t * sko_t + d, (y1 * c1 - y2 * s1).to(ko_ptr.dtype.element_ty), mask=mk)
    tl.store(ko_ptr + hk * sko_h + t * sko_t + HALF + d, (y2 * c2 + y1 * s2).to(ko_ptr.dtype.element_ty),
             mask=mk)


# The wrapped rotary takes the Triton path for CUDA tensors only, unless a test turns this on
# (under TRITON_INTERPRET=1) to run the kernel on the CPU.
ROTARY_ON_CPU = False


def rope_fusable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Shapes the kernel serves: q/k (1, H, T, D) with unit last stride, cos/sin (1, T, D), one dtype."""
    if not (q.is_cuda or ROTARY_ON_CPU):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3 or q.shape[0] != 1:
        return False
    d = q.shape[-1]
    if d % 2 or (d // 2) & (d // 2 - 1) or k.shape[-1] != d or k.shape[2] != q.shape[2]:
        return False
    if cos.shape != (1, q.shape[2], d) or sin.shape != cos.shape:
        return False
    if any(x.stride(-1) != 1 for x in (q, k, cos, sin)):
        return False
    return q.dtype == k.dtype == cos.dtype == sin.dtype


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF `apply_rotary_pos_emb(q, k, cos, sin)` (unsqueeze_dim=1) in one launch; fp32 arithmetic."""
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    n_q, n_k, t, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    if t == 0:
        return qo, ko
    launch(_rope_kernel, (t,))(
        q, k, qo, ko, cos, sin, n_q, n_k,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), qo.stride(1), qo.stride(2),
        ko.stride(1), ko.stride(2), cos.stride(1), sin.stride(1),
        HALF=d // 2, BLOCK_Q=triton.next_power_of_2(n_q), BLOCK_K=triton.next_power_of_2(n_k), num_warps=4,
    )  # fmt: skip
    return qo, ko


def _wrap_rope(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (not args and kwargs.get("unsqueeze_dim", 1) == 1 and set(kwargs) <= {"unsqueeze_dim"}
                and rope_fusable(q, k, cos, sin) and current_forward_context() is not None):
            return apply_rope(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.bridge_original = original
    return apply_rotary_pos_emb


def fuse_rotary(model: torch.nn.Module) -> bool:
    """Wrap the `apply_rotary_pos_emb` of `model`'s modeling module (idempotent); False if it has none."""
    module = sys.modules.get(type(model).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None or not callable(original):
        return False
    if not hasattr(original, "bridge_original"):
        module.apply_rotary_pos_emb = _wrap_rope(original)
    return True
