"""`EngineConfig`: every engine setting in one validated object, device defaults resolved once.

`LLM(...)` keeps vLLM's keyword arguments and builds one of these; the engine core, the model
runner and the scheduler read their settings from it instead of passing a dozen keywords along.
Anything that depends on the device or the model (batch limits, the context, the dtype, CUDA
graphs, the decode window, which fused kernels are installed) is decided in `resolve`, so that
the rest of the engine never asks "are we on a GPU?" again.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from runner.worker.hf_config import text_config

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}  # fmt: skip

# Most greedy decode steps run back to back without a host sync (see ModelRunner.execute_decode_window).
MAX_DECODE_WINDOW = 32
# Measured on an H200 (W1 of benchmarks/generate.py): 8 -> 35%, 16 -> 39%, 32 -> 40% of the roofline.
DEFAULT_DECODE_WINDOW = 32
# Largest step a mixed-step CUDA graph covers by default (runner.worker.cuda_graphs): the token count
# whose decoder matmuls reach MIXED_GRAPH_WORK_FLOP (2 x decoder parameters x tokens), rounded down to a
# power of two within [512, 16384]. Why: an eager step costs roughly fixed host time (15-25 ms for 28
# layers), so a graph pays while the step's GPU work is not longer than that (1.6e13 FLOP is about
# 20 ms at an H200's dense bf16 rate), even after a bucket pads the step by up to half. W1's model
# (0.44B decoder parameters) gets 16384, a 7B model 1024. Measured: W1 behind `bridge serve` at 64
# clients, whose arrival bursts make steps of 4-16k tokens, ran at 0.87 of offline with a cap of
# 4096 and 0.89 with 16384 (256 clients: 0.87 and 0.90).
MIXED_GRAPH_WORK_FLOP = 1.6e13
MIXED_GRAPH_MAX_TOKENS_RANGE = (512, 16384)


def auto_mixed_graph_max_tokens(decoder_params: int) -> int:
    """The default `mixed_graph_max_tokens` for a decoder of `decoder_params` parameters (see above)."""
    lo, hi = MIXED_GRAPH_MAX_TOKENS_RANGE
    tokens = int(MIXED_GRAPH_WORK_FLOP / (2 * max(1, decoder_params)))
    return max(lo, min(hi, 1 << max(0, tokens.bit_length() - 1)))


def resolve_dtype(dtype: str | torch.dtype, config: Any = None) -> torch.dtype:
    """A torch dtype from a name ('bf16', 'float32', ...) or 'auto' (the checkpoint's own dtype)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point type, got {dtype}")
        return dtype
    if dtype == "auto":
        found = None
        if config is not None:
            found = getattr(text_config(config), "dtype", None) or getattr(config, "dtype", None)
        if isinstance(found, str):
            found = DTYPES.get(found.replace("torch.", ""))
        return found if isinstance(found, torch.dtype) and found.is_floating_point else torch.float32
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"unknown dtype {str(dtype)[:40]!r}; use 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def env_switch(name: str) -> bool:
    """A kernel switch from the environment: on unless set to '0' (A/B runs)."""
    return os.environ.get(name, "1") != "0"


def env_int(name: str, default: int, low: int) -> int:
    """A kernel knob from the environment: `default` when unset, else an int >= `low` (ValueError naming
    the variable otherwise)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {raw[:40]!r}")
    return value


def _check_int(name: str, value: Any, low: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {str(value)[:40]!r}")


@dataclass
class EngineConfig:
    """The engine's settings. Built by `LLM(...)`; `resolve` fills the device-dependent defaults.

    Fields left None are decided by `resolve`: `device` (CUDA when available), `max_num_seqs`
    (256 on a GPU, 32 on the CPU), `max_num_batched_tokens` (8192 / 2048), `max_model_len` (the
    model's context), `decode_window` (32 with CUDA graphs, else 1), `mixed_graph_max_tokens` (the
    largest prefill/mixed step replayed from a CUDA graph; None: decided from the model's size when it
    is loaded, `auto_mixed_graph_max_tokens`; 0: such steps run eagerly; only used with CUDA graphs;
    never above `max_num_batched_tokens`), and the kernel switches
    `fused_ops` / `fused_linear` / `fused_layers` (on on the GPU unless BRIDGE_FUSED_OPS /
    BRIDGE_FUSED_LINEAR / BRIDGE_FUSED_LAYERS is '0'; off on the CPU), and `warmup` (on on the GPU:
    a few dummy requests at construction compile the step's kernels, so the first real call does
    not pay for it).
    """

    model: str
    enable_prompt_embeds: bool = False
    dtype: str | torch.dtype = "auto"
    device: str | torch.device | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    decode_window: int | None = None
    mixed_graph_max_tokens: int | None = None
    enable_prefix_caching: bool = False
    async_scheduling: bool | None = None
    encoder_cache_budget: int | None = None
    fused_ops: bool | None = None
    fused_linear: bool | None = None
    fused_layers: bool | None = None
    warmup: bool | None = None

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda" if self.device is not None else False

    @property
    def use_cuda_graphs(self) -> bool:
        return self.on_gpu and not self.enforce_eager

    def resolve(self, hf_config: Any) -> EngineConfig:
        """A copy with every default decided for this model and device, each field validated."""
        c = dataclasses.replace(self, model=str(pathlib.Path(self.model)))
        device = torch.device(c.device) if c.device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        c.device = device
        gpu = device.type == "cuda"
        c.dtype = resolve_dtype(c.dtype, hf_config)
        c.max_num_seqs = c.max_num_seqs if c.max_num_seqs is not None else (256 if gpu else 32)
        c.max_num_batched_tokens = (c.max_num_batched_tokens if c.max_num_batched_tokens is not None
                                    else (8192 if gpu else 2048))
        _check_int("max_num_seqs", c.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", c.max_num_batched_tokens, 1)
        _check_int("block_size", c.block_size, 1)
        _check_int("num_kv_blocks", c.num_kv_blocks, 1, optional=True)
        _check_int("kv_cache_memory", c.kv_cache_memory, 1, optional=True)
        _check_int("encoder_cache_budget", c.encoder_cache_budget, 1, optional=True)
        _check_int("seed", c.seed, 0)
        if not isinstance(c.gpu_memory_utilization, int | float) or not 0 < c.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization!r}")
        context = getattr(text_config(hf_config), "max_position_embeddings", None) or 2048
        if c.max_model_len is None:
            c.max_model_len = context
        elif isinstance(c.max_model_len, bool) or not isinstance(c.max_model_len, int) \
                or not 1 <= c.max_model_len <= context:
            raise ValueError(
                f"max_model_len must be in [1, {context}] (the model's context), got {c.max_model_len!r}")
        if c.decode_window is None:
            c.decode_window = DEFAULT_DECODE_WINDOW if c.use_cuda_graphs else 1
        if isinstance(c.decode_window, bool) or not isinstance(c.decode_window, int) \
                or not 1 <= c.decode_window <= MAX_DECODE_WINDOW:
            raise ValueError(f"decode_window must be in [1, {MAX_DECODE_WINDOW}], got {c.decode_window!r}")
        if c.mixed_graph_max_tokens is not None:  # None: from the model's size (ModelRunner)
            _check_int("mixed_graph_max_tokens", c.mixed_graph_max_tokens, 0)
            c.mixed_graph_max_tokens = min(c.mixed_graph_max_tokens, c.max_num_batched_tokens)
        if c.fused_ops is None:
            c.fused_ops = gpu and env_switch("BRIDGE_FUSED_OPS")
        if c.fused_linear is None:
            c.fused_linear = c.fused_ops and env_switch("BRIDGE_FUSED_LINEAR")
        if c.fused_layers is None:
            c.fused_layers = c.fused_linear and env_switch("BRIDGE_FUSED_LAYERS")
        if c.warmup is None:
            c.warmup = gpu
        return c


__all__ = ["DEFAULT_DECODE_WINDOW", "DTYPES", "MAX_DECODE_WINDOW", "MIXED_GRAPH_WORK_FLOP", "EngineConfig",
           "auto_mixed_graph_max_tokens", "resolve_dtype"]
