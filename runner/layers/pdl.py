"""Programmatic dependent launch (PDL): a decode GEMM streams its weights while the kernel before it ends.

Why: at decode batch sizes a layer spends several times longer outside attention than reading its
weights takes: each small GEMM pays its launch, its ramp and a full DRAM round trip before the first
multiply, one after another. Hopper can start a kernel before the one ahead of it on the stream
has finished (`cudaLaunchAttributeProgrammaticStreamSerialization`, Triton's `launch_pdl=True`): the
dependent's programs become resident as the primary's programs drain, and they may do anything that
does not read the primary's results before `griddepcontrol.wait` (Triton's `gdc_wait`), which returns
once the primary has completed and its writes are visible. A weight tile depends on nothing that runs
at inference, so a GEMM launched this way loads its weights first and waits only for its activations.
The primary decides how early that happens: `gdc_launch_dependents` in its programs (once every program
has issued it, or exited) lets the dependent launch.

Where it is used (decode steps of up to `fused_layers.PDL_MAX_ROWS` tokens): norm + q/k/v releases decode
attention, which is launched with PDL and waits at its start (its launch and first wave's ramp overlap the
q/k/v kernel's end); attention releases o_proj and SiLU*mul releases the down projection, both
weights-first split-K kernels (`runner.layers.down_gemm.residual_gemm(pdl=True)`).

The rules that keep it correct, for every kernel launched with `launch_pdl=True`:
- nothing a predecessor writes is read before `gdc_wait` (the weights, which nothing writes, may be);
- nothing is written before `gdc_wait` (a predecessor may still read it);
- it waits unconditionally, in every program, before its first such access.
By induction the stream's order holds: the kernel after a PDL kernel (launched normally, or itself with
PDL and waiting) starts its dependent work only after that kernel completed, which it could only do
after its own wait returned, i.e. after everything before it completed.

On by default where the device supports it (compute capability 9.0 or later, not the Triton interpreter,
which has no inline assembly); the gain is largest at batch 1, where launches dominate. `ENABLED` and
`LAUNCH_PDL` exist for tests: with `LAUNCH_PDL` False the same kernels
and tiles run with ordinary launches and without the waits, so their results must be bitwise equal.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

#: tests: False keeps every step off the PDL kernels
ENABLED = True
#: tests only: False keeps the PDL kernels' code path but launches them normally and skips the waits
LAUNCH_PDL = True


@functools.lru_cache(maxsize=8)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL: a CUDA device of compute capability 9.0 or
    later, outside the Triton interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def use_pdl(device: torch.device) -> bool:
    """Whether a launch on `device` goes with PDL: the switch is on and the device supports it."""
    return ENABLED and LAUNCH_PDL and pdl_supported(device)


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """`gdc_wait` in a kernel compiled for PDL launches; nothing otherwise."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """`gdc_launch_dependents` in a kernel compiled to let a PDL dependent start early; nothing otherwise.
    Harmless when no dependent was launched with PDL."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


__all__ = ["ENABLED", "LAUNCH_PDL", "pdl_supported", "release_dependents", "use_pdl", "wait_for_predecessor"]
