"""Start-up's Triton kernels built side by side, before the profile step and the captures need them.

Why: on a cold Triton cache most of construction is building kernel specialisations, one after
another as the profile step and then each graph capture first meets them (W1's model on an H200: 13
builds, about 7.5 s of a 15 s construction). Here every step start-up will run executes once with its
Triton launches only building (`runner.layers.triton_launch`): the profile's largest prefill step and
the body of every mixed-step and decode graph bucket, on a temporary KV cache and temporary graph
output buffers. All their builds go to one thread pool at once; leaving the block waits for them.
The torch ops in between run for real on scratch data (so cuBLAS has picked its kernels too, and a
capture needs one warm-up, not two); the one thing the host reads back, the profile step's sampled
ids (argmax of scratch logits, so valid ids), is dropped.

`ModelRunner.kernel_build_threads` (from BRIDGE_KERNEL_BUILD_THREADS) turns it on; any failure is
logged and start-up goes on as without it: the real runs build whatever is missing, as they always did.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from runner.config import MAX_DECODE_WINDOW
from runner.layers.triton_launch import build_ahead
from runner.worker.cuda_graphs import mixed_graph_token_sizes
from runner.worker.kv_cache import allocate_kv_caches
from runner.worker.memory_profile import blocks_for, largest_step, largest_step_lens
from runner.worker.step_graphs import decode_graph_body, decode_graph_sizes, mixed_graph_body

if TYPE_CHECKING:  # type hints only: the runner calls this module, not the other way round
    from runner.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@torch.inference_mode()
def build_startup_kernels(runner: ModelRunner, *, graphs: bool) -> bool:
    """Build the kernels of the profile step and (with `graphs`) of every graph bucket's body at once, on
    `runner.kernel_build_threads` threads. Returns whether the pass ran to its end."""
    lens = largest_step_lens(runner)
    decode_sizes = decode_graph_sizes(runner) if graphs else []
    mixed_sizes = mixed_graph_token_sizes(runner.mixed_graph_max_tokens) if graphs else []
    saved_caches, saved_steps = runner.kv_caches, runner.num_forward_steps
    done = False
    try:
        runner.kv_caches = allocate_kv_caches(runner.kv_spec, blocks_for(runner, lens), runner.device)
        if decode_sizes:  # the graph bodies' output buffers (the capture allocates its own)
            runner.decode_graphs.allocate(decode_sizes, runner.vocab_size, MAX_DECODE_WINDOW, runner.device)
        with build_ahead(runner.kernel_build_threads) as on:
            if on:
                runner.execute(largest_step(runner, lens))
                for tokens in reversed(mixed_sizes):
                    mixed_graph_body(runner, tokens)()
                for b in reversed(decode_sizes):
                    decode_graph_body(runner, b)()
        done = on
    except Exception as exc:  # noqa: BLE001 - an optimisation: the real runs build what is missing
        logger.warning("building start-up kernels ahead failed (%s: %s); they are built as they are met",
                       type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
    finally:
        runner.kv_caches = saved_caches
        runner.num_forward_steps = saved_steps
        runner.num_blocks_known[:] = 0
        runner.decode_graphs.release()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return done


__all__ = ["build_startup_kernels"]
