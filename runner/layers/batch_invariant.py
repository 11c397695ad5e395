"""`EngineConfig.batch_invariant`: the forward's matrix products and row reductions, whatever the batch.

Why: with it off, the bits of a request's logits depend on what else runs in its step (the GEMM
algorithm cuBLAS picks for the step's row count, a reduction's launch, the attention kernel and its key
split), so greedy tokens of the same prompt differ between `LLM.generate` alone, a batch of 64 and a
served burst wherever two logits are close. With it on, each kernel on the path reduces in an order fixed
by the model alone:

- matrix products (`F.linear`, `mm`, `addmm`, `matmul`, `bmm`, and `grouped_mm` on the CPU):
  `runner.layers.invariant_matmul`;
- row means, softmax and log-softmax on CUDA (norms Bridge does not fuse, MoE routers, the sampler's and
  prompt logprobs): `runner.layers.invariant_rows`;
- attention: one kernel for every query row, decode or prefill, with key tiles at fixed positions
  (`runner.layers.paged_attention`, told by the forward context).

How: `batch_invariant_ops()` pushes a `TorchFunctionMode` around the runner's forward and sampling, so
Hugging Face's modeling code, Bridge's fused layers and the LM head are caught alike without patching
them; a call the replacements do not cover (a product over K = 1, which has nothing to reorder, an
unusual argument) runs torch's own. Captured CUDA graphs record the replacement kernels, so replays
pay nothing; an eager step pays one Python dispatch per torch call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from runner.layers.invariant_matmul import invariant_mm, uses_triton
from runner.layers.invariant_rows import row_mean, row_softmax

_STATE = threading.local()  # `on`: this thread is inside batch_invariant_ops()


def _float_pair(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.dtype.is_floating_point and a.device == b.device)


def _mm2(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> Any:
    """a (M, K) @ b (K, N) when it has something to reorder (K > 1), else NotImplemented."""
    if not _float_pair(a, b) or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.shape[1] <= 1:
        return NotImplemented
    if bias is not None and (bias.dtype != a.dtype or bias.shape != (b.shape[1],)):
        return NotImplemented
    if out is not None and (out.shape != (a.shape[0], b.shape[1]) or out.dtype != a.dtype):
        return NotImplemented
    return invariant_mm(a, b, bias, out=out)


def _batched(a: torch.Tensor, b: torch.Tensor) -> Any:
    """(..., M, K) @ (..., K, N) with broadcast batch dimensions: one invariant product per matrix."""
    if not _float_pair(a, b) or a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2] or a.shape[-1] <= 1:
        return NotImplemented
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.stack([invariant_mm(x, y) for x, y in zip(a3, b3)]) if a3.shape[0] else \
        a.new_empty((0, a.shape[-2], b.shape[-1]))
    return out.reshape(*batch, a.shape[-2], b.shape[-1])


def _linear(args: tuple, kwargs: dict) -> Any:
    x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not _float_pair(x, weight) or weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return NotImplemented
    y = _mm2(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    if y is NotImplemented:
        return y
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _mm(args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1] if len(args) > 1 else kwargs.get("mat2")
    return _mm2(a, b, out=kwargs.get("out"))


def _addmm(args: tuple, kwargs: dict) -> Any:
    bias, a, b = args[0], args[1], args[2]
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1 or kwargs.get("out") is not None:
        return NotImplemented
    if isinstance(bias, torch.Tensor) and bias.dim() == 1:
        return _mm2(a, b, bias)
    y = _mm2(a, b)
    return y if y is NotImplemented else y + bias


def _matmul(args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
    if kwargs.get("out") is not None or not _float_pair(a, b) or a.dim() < 1 or b.dim() < 2:
        return NotImplemented
    if b.dim() == 2:
        if a.shape[-1] != b.shape[0]:
            return NotImplemented
        y = _mm2(a.reshape(-1, a.shape[-1]), b)
        return y if y is NotImplemented else y.reshape(*a.shape[:-1], b.shape[1])
    return _batched(a, b) if a.dim() >= 2 else NotImplemented


def _bmm(args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1] if len(args) > 1 else kwargs.get("mat2")
    if kwargs.get("out") is not None or not _float_pair(a, b) or a.dim() != 3 or b.dim() != 3:
        return NotImplemented
    return _batched(a, b)


def _grouped_mm(args: tuple, kwargs: dict) -> Any:
    """Hugging Face's MoE experts on the CPU (`grouped_mm`: rows grouped by expert, `offs` the groups'
    ends): one invariant product per group. CUDA engines serve their experts with Bridge's grouped
    kernel in its invariant form (`runner.layers.moe_grouped`); reading `offs` there would sync."""
    a, b = args[0], args[1] if len(args) > 1 else kwargs.get("mat_b")
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if (not _float_pair(a, b) or a.device.type != "cpu" or a.dim() != 2 or b.dim() != 3 or offs is None
            or kwargs.get("bias") is not None or kwargs.get("out_dtype") not in (None, a.dtype)):
        return NotImplemented
    out = a.new_zeros((a.shape[0], b.shape[2]))
    start = 0
    for group, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = invariant_mm(a[start:end], b[group])
        start = end
    return out


def _last_dim(x: Any, dim: Any) -> bool:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return (isinstance(x, torch.Tensor) and x.dim() >= 1 and isinstance(dim, int)
            and dim in (-1, x.dim() - 1) and uses_triton(x))


def _mean(args: tuple, kwargs: dict) -> Any:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not _last_dim(x, dim) or kwargs.get("out") is not None or not x.dtype.is_floating_point:
        return NotImplemented
    return row_mean(x, keepdim=bool(keepdim), dtype=kwargs.get("dtype"))


def _softmax(log: bool, dtype_pos: int) -> Callable[[tuple, dict], Any]:
    """A handler for softmax or log_softmax whose dtype argument sits at `dtype_pos` when positional
    (F.softmax has `_stacklevel` before it)."""

    def handler(args: tuple, kwargs: dict) -> Any:
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dtype = args[dtype_pos] if len(args) > dtype_pos else kwargs.get("dtype")
        if not _last_dim(x, dim) or not x.dtype.is_floating_point or kwargs.get("out") is not None:
            return NotImplemented
        return row_softmax(x, log=log, dtype=dtype)

    return handler


_HANDLERS: dict[Callable, Callable[[tuple, dict], Any]] = {
    F.linear: _linear,
    torch.mm: _mm, torch.Tensor.mm: _mm,
    torch.addmm: _addmm, torch.Tensor.addmm: _addmm,
    torch.matmul: _matmul, torch.Tensor.matmul: _matmul, torch.Tensor.__matmul__: _matmul,
    torch.bmm: _bmm, torch.Tensor.bmm: _bmm,
    **{f: _grouped_mm for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f},
    torch.mean: _mean, torch.Tensor.mean: _mean,
    torch.softmax: _softmax(False, 2), torch.Tensor.softmax: _softmax(False, 2),
    F.softmax: _softmax(False, 3),
    torch.log_softmax: _softmax(True, 2), torch.Tensor.log_softmax: _softmax(True, 2),
    F.log_softmax: _softmax(True, 3),
}  # fmt: skip


class _InvariantOps(TorchFunctionMode):
    """Routes the calls in `_HANDLERS` to their batch-invariant forms (a mode is off inside its own
    handler, so the replacements' own torch calls run torch's kernels)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            result = handler(args, kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


def batch_invariant_active() -> bool:
    """Whether this thread is inside `batch_invariant_ops()`."""
    return getattr(_STATE, "on", False)


@contextlib.contextmanager
def batch_invariant_ops(enabled: bool = True) -> Iterator[None]:
    """Inside the block (when `enabled`), this thread's products and row reductions are batch-invariant
    (see the module docstring). Re-entering is a no-op."""
    if not enabled or batch_invariant_active():
        yield
        return
    _STATE.on = True
    try:
        with _InvariantOps():
            yield
    finally:
        _STATE.on = False


__all__ = ["batch_invariant_active", "batch_invariant_ops"]
