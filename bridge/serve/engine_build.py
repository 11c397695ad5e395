"""The engine a server runs: the model PATH resolved, the `LLM` built with its encoders, warmed for serving.

Shared by `bridge serve` in one process and by the engine process (`bridge.serve.engine_process`),
which builds the same engine from the same flags on its side of the pipe.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bridge.serve.engine_flags import engine_options

if TYPE_CHECKING:
    from runner.llm import LLM

logger = logging.getLogger("bridge.serve")


@dataclass
class LoadedModel:
    llm_dir: Path
    encoders: dict[str, Any]
    dtype: str
    name: str


def audio_sample_rates(encoders: dict[str, Any]) -> dict[str, int]:
    """The rate each audio encoder reads, by modality (its tower's `sample_rate`)."""
    rates = {}
    for modality, encoder in encoders.items():
        rate = getattr(getattr(encoder, "tower", None), "sample_rate", None)
        if modality == "audio" and isinstance(rate, int) and rate > 0:
            rates[modality] = rate
    return rates


def resolve_model(path: str | Path, verify: bool = True) -> LoadedModel:
    """A HF model dir as is; a Bridge run or checkpoint dir -> its LLM dir, encoders and dtype (the
    checkpoint checked against its manifest first unless not `verify`: `--no-verify`)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory (give a Hugging Face model dir or a Bridge "
                         "run/checkpoint)")
    if (path / "config.json").is_file() and not (path / "meta.json").is_file():
        return LoadedModel(path, {}, "auto", path.name)
    from bridge.training import checkpoint as ckpt_io
    from encoders.api import load_encoder

    if not (path / "meta.json").is_file() and ckpt_io.latest_checkpoint(path) is None:
        raise ValueError(f"{path} has no config.json (not a HF model dir) and no checkpoint "
                         "(not a Bridge run)")
    directory = ckpt_io.open_checkpoint(path, verify=verify)
    meta = ckpt_io.read_meta(directory)
    llm_dir = directory / meta["llm_dir"] if meta["llm_dir"] == "llm" else Path(meta["llm_dir"])
    encoders = {m: load_encoder(directory / "encoder" / m) for m in meta["modalities"]}
    return LoadedModel(llm_dir, encoders, meta.get("llm_dtype", "float32"), path.name)


def build_llm(model: LoadedModel, args: argparse.Namespace) -> LLM:
    """The engine, with the checkpoint's encoders (moved to the engine's device) registered."""
    from runner.llm import LLM  # here: the processes that only read the flags need not load the engine

    dtype = args.dtype if args.dtype != "auto" else model.dtype
    llm = LLM(str(model.llm_dir), **engine_options(args, dtype=dtype))
    for encoder in model.encoders.values():
        llm.register_encoder(encoder.to(llm.device).eval())
    return llm


def set_torch_threads(args: argparse.Namespace, device_type: str) -> None:
    """CPU threads for torch's ops in the server process: 1 on a GPU server unless told otherwise.

    There the process's own CPU tensor work is small (step inputs, uploads), while the host is busy
    with HTTP, the ingest workers and often the clients; an OpenMP team spread over busy cores waits
    at its barriers for descheduled threads, so a tiny copy can take orders of magnitude longer. vLLM
    runs its GPU workers with OMP_NUM_THREADS=1 for the same reason. A CPU server keeps torch's
    default: there the model runs on those threads.
    """
    import torch

    threads = args.torch_threads if args.torch_threads is not None else (1 if device_type == "cuda" else None)
    if threads is not None:
        torch.set_num_threads(threads)


def build_ready_llm(model: LoadedModel, args: argparse.Namespace) -> LLM:
    """The engine as a server runs it: built, torch threads set, and on CUDA warmed for serving."""
    from runner.warmup import warm_up_serving

    llm = build_llm(model, args)
    set_torch_threads(args, llm.device.type)
    if llm.device.type == "cuda":  # the kernels a server's bursts meet, built before the first one
        compiles = llm.kernel_compiles
        before = compiles.count if compiles is not None else 0
        seconds = warm_up_serving(llm)
        built = (compiles.count - before) if compiles is not None else 0
        logger.info("serving warm-up: %.2f s, %d Triton kernels built", seconds, built)
    return llm


def engine_device_type(args: argparse.Namespace) -> str:
    """The device type the engine will use, as `runner.LLM` picks it (`--device`, else CUDA if present)."""
    if args.device is not None:
        return str(args.device).split(":")[0]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
