"""The LM head and the cross-entropy fused, over target positions only, chunk by chunk.

Why: with a vocabulary of a hundred thousand words or more the logits dominate the step's memory.
The model already applies the LM head only at positions that predict a target (model.py); this
computes those targets' losses a chunk of rows at a time and, in the same pass, the gradients with
respect to the hidden states (and the head's weight when it trains), so at most one chunk's logits
exist at any moment and no logits are kept for the backward. The backward only scales the saved
gradients.

Each target token carries a weight (1 / (its sample's targets * samples) for the per-sample mean
loss); the result is the weighted sum, in fp32. Matmuls run in the hidden states' dtype (bf16
under autocast), the softmax in fp32, as the plain path computes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: rows of logits computed at once: chunk x vocabulary fp32 values live at a time
DEFAULT_CHUNK_ROWS = 2048


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_weight, chunk_rows, grads):
        need_h = grads and ctx.needs_input_grad[0]
        need_w = grads and ctx.needs_input_grad[1]
        need_b = grads and bias is not None and ctx.needs_input_grad[2]
        compute = hidden.dtype
        w = weight.to(compute)
        b = bias.to(compute) if bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows]
            t = targets[start : start + chunk_rows]
            tw = token_weight[start : start + chunk_rows].float()
            logits = F.linear(h, w, b).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t[:, None]).squeeze(1)
            total = total + ((lse - picked) * tw).sum()
            if not (need_h or need_w or need_b):
                continue
            # d(loss)/d(logits) = weight * (softmax - one_hot), computed in place over the logits
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, t[:, None], torch.full_like(picked[:, None], -1.0))
            grad.mul_(tw[:, None])
            g = grad.to(compute)
            if need_h:
                grad_h[start : start + chunk_rows] = g @ w
            if need_w:
                grad_w.add_((g.t() @ h).float())
            if need_b:
                grad_b.add_(grad.sum(0))
        ctx.save_for_backward(
            *(x if x is not None else torch.empty(0) for x in (grad_h, grad_w, grad_b))
        )
        ctx.has = (need_h, need_w, need_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        need_h, need_w, need_b = ctx.has
        return (
            grad_h * grad_out.to(grad_h.dtype) if need_h else None,
            (grad_w * grad_out).to(ctx.dtypes[0]) if need_w else None,
            (grad_b * grad_out).to(ctx.dtypes[1]) if need_b else None,
            None,
            None,
            None,
            None,
        )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    token_weight: torch.Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """sum_i token_weight[i] * CE(hidden[i] @ weight.T + bias, targets[i]), as an fp32 scalar.

    `hidden` (N, H) holds the target positions' hidden states only; under autocast it is cast to
    the autocast dtype first (the matmul dtype the plain head would use)."""
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0
    if torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    with torch.autocast(hidden.device.type, enabled=False):
        grads = torch.is_grad_enabled()  # no gradients computed for an evaluation loss
        return _FusedLinearCrossEntropy.apply(
            hidden, weight, bias, targets, token_weight, int(chunk_rows), grads
        )


def plain_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    token_weight: torch.Tensor,
) -> torch.Tensor:
    """The unfused reference: all the targets' logits at once, then the weighted cross-entropy."""
    logits = F.linear(hidden, weight, bias).float()
    return (F.cross_entropy(logits, targets, reduction="none") * token_weight).sum()
