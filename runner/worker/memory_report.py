"""Where the engine's GPU memory goes: weights, KV cache, activations, graph pools, staging buffers.

Why a report: the KV cache takes what the rest leaves of `gpu_memory_utilization`, so every byte
held elsewhere is a byte (and a block of context) less for requests. The numbers come from the
tensors the runner holds and two measurements taken while it set itself up (the profiled
activation peak and the growth of reserved memory across graph capture).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # type hints only: the runner calls this module
    from runner.worker.model_runner import ModelRunner


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def memory_report(runner: ModelRunner) -> dict:
    """Bytes by owner (device memory unless the key says host), plus the KV pool in blocks."""
    model = runner.model
    # By storage: the fused q/k/v and gate/up weights are views of one merged tensor each.
    storages = {} if model is None else {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (*model.parameters(), *model.buffers())}
    weights = sum(storages.values())
    kv = sum(_nbytes(k) + _nbytes(v) for k, v in runner.kv_caches)
    staging = 0 if runner.staging is None else runner.staging.device_bytes
    if runner.embeds_builder is not None:
        staging += _nbytes(runner.embeds_builder.buffer)
    graphs = runner.decode_graphs
    graph_buffers = sum(_nbytes(t) for t in vars(graphs).values() if isinstance(t, torch.Tensor))
    pinned_host = ((0 if runner.staging is None else runner.staging.pinned_bytes)
                   + (0 if runner.uploader is None else runner.uploader.pinned_bytes))
    report = {
        "weights_bytes": weights,
        "kv_cache_bytes": kv,
        "num_kv_blocks": runner.num_kv_blocks,
        "block_size": runner.block_size,
        "kv_cache_tokens": runner.num_kv_blocks * runner.block_size,
        "activation_peak_bytes": runner.activation_peak_bytes,
        "cuda_graph_pool_bytes": runner.cuda_graph_pool_bytes,
        "cuda_graph_buffers_bytes": graph_buffers,
        "staging_bytes": staging,
        "pinned_host_bytes": pinned_host,
        "gpu_memory_utilization": runner.engine_config.gpu_memory_utilization,
    }
    if runner.device.type == "cuda":
        allocated = torch.cuda.memory_allocated(runner.device)
        reserved = torch.cuda.memory_reserved(runner.device)
        report.update(
            allocated_bytes=allocated, reserved_bytes=reserved,
            device_total_bytes=torch.cuda.get_device_properties(runner.device).total_memory,
        )
    return report


__all__ = ["memory_report"]
