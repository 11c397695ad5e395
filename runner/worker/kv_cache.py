"""Sizing and allocating the paged KV cache.

All layers share one block numbering, so one block id means the same slot range in every
layer's cache; a request's block table therefore serves every layer. Each layer's K and V are
`(num_blocks, block_size, num_kv_heads, head_dim)` views of one allocation, the layout the
paged-attention kernels read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from runner.hf_config import text_config

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
        text = text_config(config)
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_kv = getattr(text, "num_key_value_heads", None) or num_heads
        return cls(text.num_hidden_layers, num_kv, head_dim, dtype, block_size)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def determine_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    *,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    peak_activation_bytes: int = 0,
) -> int:
    """How many blocks to allocate: an explicit count, an explicit byte budget, or a share of the GPU.

    With `gpu_memory_utilization` the budget is `total * utilization` minus what is already in
    use on the device (weights, other processes; not memory this process's allocator merely keeps
    cached) minus the measured activation peak of a profiling forward pass, so the cache takes
    what is left and no more.
    """
    if num_kv_blocks is not None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        return int(num_kv_blocks)
    if kv_cache_memory is None:
        if device.type == "cuda":
            if not 0 < gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
            free, total = torch.cuda.mem_get_info(device)
            # Memory this process's caching allocator holds but no tensor uses (an engine dropped
            # earlier in the same process, a finished profiling run) is available to the cache.
            idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            used = total - free - idle
            kv_cache_memory = int(total * gpu_memory_utilization) - used - peak_activation_bytes
        else:
            kv_cache_memory = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = int(kv_cache_memory) // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {kv_cache_memory} bytes is smaller than one block "
            f"({spec.bytes_per_block} bytes); raise kv_cache_memory / gpu_memory_utilization"
        )
    return num_blocks


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed allocation, viewed as a (key_cache, value_cache) pair per layer."""
    storage = torch.zeros(
        (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
        dtype=spec.dtype, device=device,
    )
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, spec.block_size,
                storage.numel() * storage.element_size() / 2**20)
    return [(storage[i, 0], storage[i, 1]) for i in range(spec.num_layers)]
