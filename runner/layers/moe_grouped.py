"""A grouped expert GEMM for mixture-of-experts layers (Qwen3-MoE, Mixtral, OLMoE) on the GPU.

Why: Hugging Face's eager experts loop over the experts on the host (`nonzero`, one gather and three small
GEMMs per expert hit), which syncs every layer and cannot be captured in a CUDA graph; its "grouped_mm"
path sorts the (token, expert) pairs and calls `torch._grouped_mm` twice, with the gathers, the SiLU*mul
and the weighting as separate kernels. Here, as in vLLM's fused_moe, the pairs are sorted by expert once
per layer (a few device ops, no host sync, fixed shapes so CUDA graphs capture it) and two Triton launches
do the rest:

    gate/up: for each block of BLOCK_M pairs of one expert, gather the token rows, multiply by the expert's
             gate and up weights in one pass over the hidden dimension, write SiLU(gate) * up (rounded to
             the model dtype, as HF's module rounds its intermediate);
    down:    multiply by the expert's down weights, scale by the routing weight, write each pair's row;

then the pairs of each token are summed. The router (softmax, top-k, renormalisation) stays Hugging Face's:
only the experts module's `forward(hidden, top_k_index, top_k_weights)` is replaced, per instance, and only
for CUDA tensors (tests turn `GROUPED_MOE_ON_CPU` on under TRITON_INTERPRET=1).

Batch invariance (`EngineConfig.batch_invariant`): a pair's row is its own dot products over fixed K
blocks whatever shares its block, so the kernels only need one block size for every step
(`INVARIANT_BLOCK_M`, not the expert load's), and each token's top-k rows are added in slot order.

Layout served: `gate_up_proj` (E, 2I, H) with gate rows first, `down_proj` (E, H, I), no biases, SiLU
(transformers 5's concatenated, untransposed expert layout); any other experts module is left alone.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# (Importing the launch path applies the interpreter's fix for runtime loop bounds, which these kernels need.)
from runner.layers.triton_launch import launch

GROUPED_MOE_CLASSES = frozenset({"Qwen3MoeExperts", "MixtralExperts", "OlmoeExperts"})
# The grouped path runs on CUDA tensors only, unless a test turns this on (under TRITON_INTERPRET=1).
GROUPED_MOE_ON_CPU = False
# Pairs per block of a batch-invariant engine, at every step (the decode-sized class).
INVARIANT_BLOCK_M = 16


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, sorted_ptr, block_expert_ptr, inter_ptr,
    num_pairs, hidden, inter_dim, stride_xt, stride_we, stride_wn, stride_it,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IS_FP32: tl.constexpr,
):
    blk = tl.program_id(0)
    expert = tl.load(block_expert_ptr + blk).to(tl.int64)
    if expert < 0:
        return  # a block past the last expert's padded rows
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)
    valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_dim
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + inter_dim * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = (k0 + offs_k) < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        wg = tl.load(w_gate + (k0 + offs_k)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        wu = tl.load(w_up + (k0 + offs_k)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IS_FP32:
            acc_g += tl.dot(x, wg, input_precision="ieee")
            acc_u += tl.dot(x, wu, input_precision="ieee")
        else:
            acc_g += tl.dot(x, wg)
            acc_u += tl.dot(x, wu)
    # HF rounds each projection to the model dtype, then computes act(gate) * up in that dtype.
    dtype = inter_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out = (act * u).to(dtype)
    tl.store(inter_ptr + offs_m[:, None].to(tl.int64) * stride_it + offs_n[None, :], out,
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w_ptr, sorted_ptr, block_expert_ptr, weights_ptr, out_ptr,
    num_pairs, hidden, inter_dim, stride_it, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_FP32: tl.constexpr,
):
    blk = tl.program_id(0)
    expert = tl.load(block_expert_ptr + blk).to(tl.int64)
    if expert < 0:
        return
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)
    valid = pairs < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    a_rows = inter_ptr + offs_m[:, None].to(tl.int64) * stride_it
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_dim, BLOCK_K):
        k_mask = (k0 + offs_k) < inter_dim
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + offs_k)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IS_FP32:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    dtype = out_ptr.dtype.element_ty
    route = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) * route[:, None]).to(dtype)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_ot + offs_n[None, :], out,
             mask=valid[:, None] & n_mask[None, :])


def _block_m(num_pairs: int, num_experts: int) -> int:
    # Few pairs per expert (decode): small blocks waste less of each expert's padded tail.
    per_expert = num_pairs / max(1, num_experts)
    return 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)


def sort_pairs_by_expert(top_k_index: torch.Tensor, num_experts: int, block_m: int):
    """Pair indices (token * top_k + slot) grouped by expert, each expert's run padded to `block_m` rows.

    Returns (sorted_pairs, block_expert): `sorted_pairs` (max_padded,) int32 holds the pair index of each
    padded row, `num_pairs` for padding; `block_expert` (max_padded // block_m,) int32 is each block's expert,
    -1 past the last. Sizes depend only on (num_pairs, num_experts, block_m) and nothing reads back to the
    host, so a CUDA graph can capture it.
    """
    flat = top_k_index.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - starts[experts_sorted]
    dest = padded_starts[experts_sorted] + rank
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def grouped_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *,
                invariant: bool = False) -> torch.Tensor:
    """sum_k w[t, k] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)), e = top_k_index[t, k]; (T, H) like `hidden`.
    `invariant`: one block size for every step and the top-k rows added in slot order (see above)."""
    num_tokens, hidden_dim = hidden.shape
    top_k = top_k_index.shape[1]
    num_experts, two_inter, _ = gate_up_proj.shape
    inter_dim = two_inter // 2
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w1 = gate_up_proj if gate_up_proj.stride(2) == 1 else gate_up_proj.contiguous()
    w2 = down_proj if down_proj.stride(2) == 1 else down_proj.contiguous()
    block_m = INVARIANT_BLOCK_M if invariant else _block_m(num_pairs, num_experts)
    sorted_pairs, block_expert = sort_pairs_by_expert(top_k_index, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    inter = torch.empty((sorted_pairs.shape[0], inter_dim), dtype=hidden.dtype, device=hidden.device)
    pair_out = torch.empty((num_pairs, hidden_dim), dtype=hidden.dtype, device=hidden.device)
    weights = top_k_weights.reshape(-1).to(hidden.dtype).contiguous()
    is_fp32 = hidden.dtype == torch.float32
    block_n, block_k = (64, 64) if hidden.is_cuda else (16, 16)
    launch(_gate_up_kernel, (num_blocks, triton.cdiv(inter_dim, block_n)))(
        x, w1, sorted_pairs, block_expert, inter, num_pairs, hidden_dim, inter_dim,
        x.stride(0), w1.stride(0), w1.stride(1), inter.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IS_FP32=is_fp32,
        num_warps=4, num_stages=3 if hidden.is_cuda else 1,
    )  # fmt: skip
    launch(_down_kernel, (num_blocks, triton.cdiv(hidden_dim, block_n)))(
        inter, w2, sorted_pairs, block_expert, weights, pair_out, num_pairs, hidden_dim, inter_dim,
        inter.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IS_FP32=is_fp32,
        num_warps=4, num_stages=3 if hidden.is_cuda else 1,
    )  # fmt: skip
    # Sum each token's top-k rows in fp32 (HF adds them one by one in the model dtype).
    rows = pair_out.view(num_tokens, top_k, hidden_dim)
    if not invariant:
        return rows.float().sum(1).to(hidden.dtype)
    total = rows[:, 0].float()
    for k in range(1, top_k):
        total = total + rows[:, k].float()
    return total.to(hidden.dtype)


def _experts_servable(module: torch.nn.Module) -> bool:
    if type(module).__name__ not in GROUPED_MOE_CLASSES or hasattr(module, "bridge_original_forward"):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return False
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        return False
    if getattr(module, "has_bias", False) or getattr(module, "is_transposed", False):
        return False
    if not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True):
        return False
    act = getattr(module, "act_fn", None)
    return type(act).__name__ in ("SiLU", "SiLUActivation") or act is torch.nn.functional.silu


def _grouped_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, *, invariant: bool = False) -> torch.Tensor:
    if not (hidden_states.is_cuda or GROUPED_MOE_ON_CPU) or hidden_states.dim() != 2:
        return module.bridge_original_forward(hidden_states, top_k_index, top_k_weights)
    return grouped_moe(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
                       invariant=invariant)


def install_grouped_moe(model: torch.nn.Module, *, batch_invariant: bool = False) -> int:
    """Give every servable experts module of `model` the grouped forward (its batch-invariant form with
    `batch_invariant`); returns how many (idempotent)."""
    count = 0
    for module in model.modules():
        if not _experts_servable(module):
            continue
        module.bridge_original_forward = module.forward
        module.forward = functools.partial(_grouped_forward, module, invariant=batch_invariant)
        count += 1
    return count
