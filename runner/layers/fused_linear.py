"""One GEMM for q/k/v and one for gate/up, and a one-kernel SiLU(gate) * up, in Hugging Face decoders.

Why: a decode step at batch 64 is memory-bound; every projection GEMM mostly reads its weight. HF
runs seven small GEMMs per layer (q, k, v, o, gate, up, down), each picking a small cuBLAS tile that
does not reach full bandwidth on weights of 2-12 MB. Concatenating q/k/v and gate/up reads the same
bytes in two larger launches instead of five, and `SiLU(gate) * up` becomes one elementwise kernel
instead of two (SiLU, multiply).

How, without copying HF's attention code: the fused weight is built once after loading and the
original `nn.Linear` parameters become views into it (memory stays flat, `state_dict` keys and
values stay what they were). `q_proj` runs the fused GEMM, returns q and keeps k and v on a small
stash; `k_proj` / `v_proj` return the stashed parts when they are called on the very same input
tensor, and otherwise run their own (view) weight like a plain `nn.Linear`. The stash is produced
and consumed inside one attention forward, so CUDA-graph capture records it like any other
intermediate tensor and replays need no Python state. The MLP's bound `forward` is replaced by
gate/up GEMM -> SiLU*mul -> down_proj.

Only the module classes listed below are touched, and only in the plain layout: no bias on
gate/up (q/k/v either all with bias or all without), a SiLU activation.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from runner.layers.pdl import release_dependents, use_pdl
from runner.layers.triton_launch import launch

# MLPs whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)).
FUSABLE_MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})
# Attention modules whose forward calls q_proj, k_proj, v_proj on the same `hidden_states`.
FUSABLE_ATTENTION_CLASSES = frozenset(
    {"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention", "Qwen2VLAttention",
     "Qwen2_5_VLAttention"}
)

# SiLU*mul takes the Triton path for CUDA tensors only, unless a test turns this on (TRITON_INTERPRET=1).
SILU_MUL_ON_CPU = False


# ----------------------------------------------------------------------------------------- SiLU*mul

@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_inter, stride_x, stride_o, BLOCK: tl.constexpr, RELEASE: tl.constexpr):
    release_dependents(RELEASE)  # a PDL down projection after it may start loading its weights
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_inter + cols, mask=mask, other=0.0).to(tl.float32)
    # Same rounding as HF in low precision: SiLU rounded to the input dtype, then the product.
    s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """`SiLU(x[..., :I]) * x[..., I:]` in torch: HF's MLP arithmetic on a fused gate/up output."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """`SiLU(x[..., :I]) * x[..., I:]` in one Triton launch; returns a contiguous (..., I) tensor."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension holds gate and up halves, so it must be even: {tuple(x.shape)}")
    n_inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n_inter), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    if n_rows == 0 or n_inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_inter))
    launch(_silu_mul_kernel, (n_rows, triton.cdiv(n_inter, block)))(
        x2, out, n_inter, x2.stride(0), n_inter, BLOCK=block, RELEASE=use_pdl(x.device), num_warps=4
    )
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA (or on the CPU when `SILU_MUL_ON_CPU`), torch otherwise."""
    if x.is_cuda or SILU_MUL_ON_CPU:
        return silu_mul_triton(x)
    return silu_mul_reference(x)


# ------------------------------------------------------------------- SiLU*mul with the row's RMS scale

# A kernel that applies a folded norm's row scale holds its whole row of x (fp32) to take the RMS: rows
# wider than this are not folded (`fused_layers._fold_norm`) and take the torch path here.
ROWNORM_MAX_HIDDEN = 16384


@triton.jit
def row_rms_scale(row_ptr, n_hidden, eps, BLOCK_H: tl.constexpr):
    """`rsqrt(mean(x**2) + eps)` of one row of `n_hidden` elements (BLOCK_H >= n_hidden), fp32, as HF's
    RMSNorm computes it: the scale the GEMM after a folded norm's weight still owes its output."""
    h = tl.arange(0, BLOCK_H)
    xv = tl.load(row_ptr + h, mask=h < n_hidden, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(xv * xv, 0) / n_hidden + eps)


@triton.jit
def _silu_mul_rownorm_kernel(gu_ptr, x_ptr, out_ptr, n_inter, n_hidden, stride_gu, stride_x, stride_o, eps,
                             BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, RELEASE: tl.constexpr):
    release_dependents(RELEASE)  # a PDL down projection after it may start loading its weights
    row = tl.program_id(0).to(tl.int64)
    r = row_rms_scale(x_ptr + row * stride_x, n_hidden, eps, BLOCK_H)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32) * r
    u = tl.load(gu_ptr + row * stride_gu + n_inter + cols, mask=mask, other=0.0).to(tl.float32) * r
    s = (g / (1.0 + tl.exp(-g))).to(gu_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_rownorm_reference(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """`SiLU(r * gate) * (r * up)` with `r = rsqrt(mean(x**2) + eps)` per row of `x`, in torch.

    With an RMSNorm's weight folded into the gate/up weight, `gate_up = x @ (W * weight).T` is the MLP's
    projection of the unnormalised row, and scaling it by the row's `r` is the projection of the
    normalised one: `RMSNorm -> gate/up -> SiLU*mul` without the norm's own launch.
    """
    r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    gate, up = (gate_up.float() * r).chunk(2, dim=-1)
    return (F.silu(gate).to(gate_up.dtype).float() * up).to(gate_up.dtype)


def silu_mul_rownorm(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """`silu_mul_rownorm_reference` in one Triton launch on CUDA (or on the CPU when `SILU_MUL_ON_CPU`);
    `gate_up` (rows, 2I) and `x` (rows, H) with unit last stride; returns a contiguous (rows, I) tensor."""
    if gate_up.dim() != 2 or x.dim() != 2 or gate_up.shape[0] != x.shape[0] or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be (rows, 2I) and x (rows, H), got {tuple(gate_up.shape)} and "
                         f"{tuple(x.shape)}")
    if (not (gate_up.is_cuda or SILU_MUL_ON_CPU) or gate_up.stride(1) != 1 or x.stride(1) != 1
            or x.shape[1] > ROWNORM_MAX_HIDDEN):
        return silu_mul_rownorm_reference(gate_up, x, eps)
    n_rows, n_inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n_rows, n_inter), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows == 0 or n_inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_inter))
    launch(_silu_mul_rownorm_kernel, (n_rows, triton.cdiv(n_inter, block)))(
        gate_up, x, out, n_inter, x.shape[1], gate_up.stride(0), x.stride(0), n_inter, eps, BLOCK=block,
        BLOCK_H=triton.next_power_of_2(x.shape[1]), RELEASE=use_pdl(gate_up.device), num_warps=4,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- MLP

def _is_plain_linear(m) -> bool:
    return type(m) is torch.nn.Linear


def _uses_silu(mlp: torch.nn.Module) -> bool:
    config = getattr(mlp, "config", None)
    if config is not None and getattr(config, "hidden_act", None) != "silu":
        return False
    return type(getattr(mlp, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")


def _mlp_fusable(mlp: torch.nn.Module) -> bool:
    if type(mlp).__name__ not in FUSABLE_MLP_CLASSES or hasattr(mlp, "bridge_gate_up_weight"):
        return False
    projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(_is_plain_linear(p) for p in projs):
        return False
    gate, up, _ = projs
    return (gate.bias is None and up.bias is None and gate.weight.shape == up.weight.shape
            and gate.weight.dtype == up.weight.dtype and gate.weight.device == up.weight.device
            and _uses_silu(mlp))


def _as_views(fused: torch.Tensor, linears: list[torch.nn.Linear], attr: str) -> None:
    """Point each linear's `attr` parameter at its rows of `fused` (the old storage is released)."""
    start = 0
    for lin in linears:
        n = getattr(lin, attr).shape[0]
        setattr(lin, attr, torch.nn.Parameter(fused[start : start + n], requires_grad=False))
        start += n


def _fused_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(silu_mul(F.linear(x, mlp.bridge_gate_up_weight)))


@torch.no_grad()
def fuse_mlps(model: torch.nn.Module) -> int:
    """Give every fusable MLP in `model` one gate/up GEMM and the one-kernel SiLU*mul; returns how many."""
    count = 0
    for mlp in model.modules():
        if not _mlp_fusable(mlp):
            continue
        fused = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
        _as_views(fused, [mlp.gate_proj, mlp.up_proj], "weight")
        # Non-persistent: not in state_dict; a later `.to()` moves it (then no longer shared, still right).
        mlp.register_buffer("bridge_gate_up_weight", fused, persistent=False)
        mlp.forward = functools.partial(_fused_mlp_forward, mlp)
        count += 1
    return count


# ---------------------------------------------------------------------------------------------- QKV

class _QKVStash:
    """k and v of the last fused projection, with the input they belong to; emptied as they are taken."""

    __slots__ = ("x", "k", "v")

    def __init__(self) -> None:
        self.x = self.k = self.v = None

    def take(self, part: str, x: torch.Tensor) -> torch.Tensor | None:
        if self.x is not x:
            return None
        out = getattr(self, part)
        setattr(self, part, None)
        if self.k is None and self.v is None:
            self.x = None  # hold no reference past the attention forward
        return out


def _fused_q_forward(attn: torch.nn.Module, stash: _QKVStash, x: torch.Tensor) -> torch.Tensor:
    y = F.linear(x, attn.bridge_qkv_weight, attn.bridge_qkv_bias)
    q, k, v = y.split(attn.bridge_qkv_sizes, dim=-1)
    stash.x, stash.k, stash.v = x, k, v
    return q


def _stashed_forward(lin: torch.nn.Linear, stash: _QKVStash, part: str, x: torch.Tensor) -> torch.Tensor:
    out = stash.take(part, x)
    if out is None:  # called on another input or out of order: the plain projection
        return F.linear(x, lin.weight, lin.bias)
    return out


def _attention_fusable(attn: torch.nn.Module) -> bool:
    if type(attn).__name__ not in FUSABLE_ATTENTION_CLASSES or hasattr(attn, "bridge_qkv_weight"):
        return False
    projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not all(_is_plain_linear(p) for p in projs):
        return False
    w = [p.weight for p in projs]
    with_bias = [p.bias is not None for p in projs]
    return (len({t.shape[1] for t in w}) == 1 and len({t.dtype for t in w}) == 1
            and len({t.device for t in w}) == 1 and len(set(with_bias)) == 1)


@torch.no_grad()
def fuse_qkv(model: torch.nn.Module) -> int:
    """Give every fusable attention module in `model` one q/k/v GEMM; returns how many."""
    count = 0
    for attn in model.modules():
        if not _attention_fusable(attn):
            continue
        projs = [attn.q_proj, attn.k_proj, attn.v_proj]
        fused_w = torch.cat([p.weight for p in projs], dim=0)
        _as_views(fused_w, projs, "weight")
        fused_b = None
        if projs[0].bias is not None:
            fused_b = torch.cat([p.bias for p in projs], dim=0)
            _as_views(fused_b, projs, "bias")
        attn.register_buffer("bridge_qkv_weight", fused_w, persistent=False)
        attn.register_buffer("bridge_qkv_bias", fused_b, persistent=False)
        attn.bridge_qkv_sizes = [p.weight.shape[0] for p in projs]
        stash = _QKVStash()
        attn.q_proj.forward = functools.partial(_fused_q_forward, attn, stash)
        attn.k_proj.forward = functools.partial(_stashed_forward, attn.k_proj, stash, "k")
        attn.v_proj.forward = functools.partial(_stashed_forward, attn.v_proj, stash, "v")
        count += 1
    return count


def fuse_linears(model: torch.nn.Module) -> tuple[int, int]:
    """Fuse gate/up (with SiLU*mul) and q/k/v wherever the layout allows; returns (MLPs, attentions)."""
    return fuse_mlps(model), fuse_qkv(model)
