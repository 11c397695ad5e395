"""`EngineConfig`: every engine setting in one validated object, device defaults resolved once.

`LLM(...)` keeps vLLM's keyword arguments and builds one of these; the engine core, the model
runner and the scheduler read their settings from it instead of passing a dozen keywords along.
Anything that depends on the device or the model (batch limits, the context, the dtype, CUDA
graphs, the decode window, which fused kernels are installed) is decided in `resolve`, so that
the rest of the engine never asks "are we on a GPU?" again.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from runner.hf_config import text_config

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}  # fmt: skip

# Most greedy decode steps run back to back without a host sync (see ModelRunner.execute_decode_window).
MAX_DECODE_WINDOW = 32
# Longer windows amortise the host sync over more steps; gains flatten out by 32 (benchmarks/generate.py).
DEFAULT_DECODE_WINDOW = 32
# Largest step a mixed-step CUDA graph covers by default (runner.worker.cuda_graphs): the token count
# whose decoder matmuls reach MIXED_GRAPH_WORK_FLOP (2 x decoder parameters x tokens), rounded down to a
# power of two within [512, 16384]. Why: an eager step costs roughly fixed host time (tens of ms for a
# few dozen layers), so a graph pays while the step's GPU work is not longer than that, even after a
# bucket pads the step by up to half: a 0.6B model gets 16384, a 7B model 1024. A server's arrival
# bursts make steps of thousands of tokens, so the cap is kept high (benchmarks/serve.py).
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


def _check_int(name: str, value: Any, low: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {str(value)[:40]!r}")


def option(default: Any, help: str, *, flag: bool = True) -> Any:
    """A field of `EngineConfig` with its help text; `flag=False` keeps it out of `bridge serve`'s flags
    (the model path is the command's positional argument)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class EngineConfig:
    """The engine's settings: the one list of engine options. `LLM(model, **options)` takes exactly
    these names (a misspelt one is refused with the nearest name), and `bridge serve` builds its engine
    flags from them (`--max-num-seqs` for `max_num_seqs`). Fields left None are decided by `resolve`
    for this device and model.
    """

    model: str = option(None, "a local Hugging Face model directory", flag=False)
    enable_prompt_embeds: bool = option(False, "accept prompt_embeds prompts")
    dtype: str | torch.dtype = option("auto", "weights and activations dtype ('auto': the checkpoint's)")
    device: str | torch.device | None = option(None, "device (default: CUDA when available)")
    max_num_seqs: int | None = option(None, "requests running at once (default 256 on a GPU, 32 on the CPU)")
    max_num_batched_tokens: int | None = option(
        None, "tokens one step takes, prefill chunks included (default 8192 on a GPU, 2048 on the CPU)")
    max_model_len: int | None = option(None, "context length (default: the model's)")
    block_size: int = option(16, "tokens per KV-cache block")
    kv_cache_memory: int | None = option(None, "bytes for the KV cache (overrides gpu_memory_utilization)")
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory the engine may use")
    num_kv_blocks: int | None = option(None, "a fixed KV pool size in blocks")
    enforce_eager: bool = option(False, "no CUDA graphs")
    seed: int = option(0, "the engine's base random seed")
    decode_window: int | None = option(
        None, f"greedy decode steps run back to back between host syncs (1..{MAX_DECODE_WINDOW}; default "
        f"{DEFAULT_DECODE_WINDOW} with CUDA graphs, else 1)")
    mixed_graph_max_tokens: int | None = option(
        None, "largest prefill/mixed step replayed from a CUDA graph (default: from the model's size; "
        "0: such steps run eagerly)")
    enable_prefix_caching: bool = option(False, "reuse KV blocks of identical prompt prefixes")
    batch_invariant: bool = option(
        False, "a prompt's greedy tokens and logprobs independent of what else runs (alone or in any batch, "
        "any chunking, prefix cache on or off): every kernel reduces in an order fixed by the model; slower "
        "(no fused decoder layers, one matmul tile for every size)")
    async_scheduling: bool | None = option(
        None, "plan and launch step n+1 while step n runs (default: on, off with multimodal input)")
    encoder_cache_budget: int | None = option(
        None, "encoder-cache budget in rows (default: 4 x max_num_batched_tokens, at least 16384)")
    fused_ops: bool | None = option(None, "Bridge's fused RMSNorm/rotary kernels (default: on on a GPU)")
    fused_linear: bool | None = option(
        None, "merged q/k/v and gate/up projections (default: with fused_ops)")
    fused_layers: bool | None = option(
        None, "fused decoder-layer forwards for llama-family layers (default: with fused_linear)")
    warmup: bool | None = option(
        None, "run dummy requests at construction so the first call builds no kernel (default: on on a GPU)")
    kernel_build_threads: int | None = option(
        None, "threads that build start-up's Triton kernels side by side (default: the usable cores, up "
        "to 8; 0 or 1 builds them one by one where they first run)")

    def determinism_settings(self) -> dict[str, Any]:
        """The resolved settings a generation's arithmetic depends on, as plain JSON values, for run
        outputs to record (`bridge eval`'s eval.json): without `batch_invariant` a greedy output may
        also change with the step sizes these allow (batch, chunk budget, graph buckets, fused kernels)."""
        out: dict[str, Any] = {}
        for name in DETERMINISM_FIELDS:
            value = getattr(self, name)
            out[name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype | torch.device) \
                else value
        return out

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
            c.fused_ops = gpu
        if c.fused_linear is None:
            c.fused_linear = c.fused_ops
        if not isinstance(c.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {str(c.batch_invariant)[:40]!r}")
        if c.fused_layers is None:
            c.fused_layers = c.fused_linear and not c.batch_invariant
        elif c.fused_layers and c.batch_invariant:
            raise ValueError("fused_layers=True cannot run batch_invariant: its norm-GEMM and split-K "
                             "kernels choose their reduction by the step's size; leave fused_layers unset")
        if c.warmup is None:
            c.warmup = gpu
        if c.kernel_build_threads is None:
            c.kernel_build_threads = min(8, usable_cores())
        _check_int("kernel_build_threads", c.kernel_build_threads, 0)
        return c


# The fields `EngineConfig.determinism_settings` records.
DETERMINISM_FIELDS = ("batch_invariant", "dtype", "device", "enforce_eager", "max_num_seqs",
                      "max_num_batched_tokens", "enable_prefix_caching", "decode_window",
                      "mixed_graph_max_tokens", "fused_ops", "fused_linear", "fused_layers", "seed")


def check_option_names(names: Any, where: str = "LLM()") -> None:
    """TypeError for a keyword that is not an `EngineConfig` field, naming the nearest one."""
    fields = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    for name in names:
        if name not in fields:
            near = difflib.get_close_matches(name, fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; engine options: {', '.join(fields)}"
            raise TypeError(f"{where} got an unexpected keyword argument {str(name)[:60]!r}{hint}")


def options_table_markdown() -> str:
    """The README's table of engine options, generated from `EngineConfig`'s fields and their help."""
    lines = ["| option | default | what it sets |", "|---|---|---|"]
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        default = "-" if f.default is None else f"`{f.default!r}`"
        lines.append(f"| `{f.name}` | {default} | {f.metadata['help']} |")
    return "\n".join(lines) + "\n"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one, e.g. under taskset or
    a container's cpuset), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


__all__ = ["DEFAULT_DECODE_WINDOW", "DTYPES", "MAX_DECODE_WINDOW", "MIXED_GRAPH_WORK_FLOP", "EngineConfig",
           "auto_mixed_graph_max_tokens", "check_option_names", "option", "resolve_dtype", "usable_cores"]
