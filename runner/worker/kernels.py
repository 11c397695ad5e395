"""Which of Bridge's fused kernels go into a loaded model, decided by the engine config.

Each switch is a field of `EngineConfig` (`fused_ops`, `fused_linear`, `fused_layers`; defaults: on
on the GPU, off on the CPU). They nest: merged projections need the fused ops, fused decoder layers need
the merged projections. With `batch_invariant` the grouped MoE GEMM takes one block size for every step,
and `EngineConfig.resolve` keeps the fused decoder layers off; the fused norms, rotary and merged
projections stay (per-row, elementwise, and the merged GEMMs run through the invariant matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.config import EngineConfig
from runner.layers.fused_layers import fuse_decoder_layers
from runner.layers.fused_linear import fuse_linears
from runner.layers.fused_ops import fuse_rmsnorms, fuse_rotary
from runner.layers.moe_grouped import install_grouped_moe


@dataclass
class InstalledKernels:
    """What was installed (tests and benchmarks read these)."""

    num_fused_norms: int = 0
    fused_rotary: bool = False
    num_fused_linears: tuple[int, int] = (0, 0)
    num_fused_layers: int = 0
    num_grouped_moe: int = 0


def install_kernels(model: torch.nn.Module, config: EngineConfig) -> InstalledKernels:
    """Patch `model` in place: one-kernel RMSNorm and rotary (`runner.layers.fused_ops`), one q/k/v
    GEMM and one gate/up GEMM + SiLU*mul (`runner.layers.fused_linear`), whole decoder layers on
    fused kernels (`runner.layers.fused_layers`), and mixture-of-experts blocks on one grouped GEMM
    pair (`runner.layers.moe_grouped`), as the resolved `config`'s switches say."""
    installed = InstalledKernels()
    if not config.fused_ops:
        return installed
    installed.num_grouped_moe = install_grouped_moe(model, batch_invariant=config.batch_invariant)
    installed.num_fused_norms = fuse_rmsnorms(model)
    installed.fused_rotary = fuse_rotary(model)
    if config.fused_linear:
        installed.num_fused_linears = fuse_linears(model)
        if config.fused_layers:
            installed.num_fused_layers = fuse_decoder_layers(model)
    return installed


__all__ = ["InstalledKernels", "install_kernels"]
