"""Start-up's Triton kernels built side by side, before the profile step and the captures need them.

Why: on a cold Triton cache most of construction is building kernel specialisations, one after another as the
profile step and then each graph capture first meets them. Here every step start-up will run executes once
with its Triton launches only building (`runner.layers.triton_launch`): the profile's largest prefill step and
the body of every mixed-step and decode graph bucket, on a temporary KV cache and temporary graph output
buffers. All their builds go to one thread pool at once; leaving the block waits for them. The torch ops in
between run for real on scratch data (so cuBLAS has picked its kernels too, and a capture needs one warm-up,
not two); the one thing the host reads back, the profile step's sampled ids (argmax of scratch logits, so
valid ids), is dropped.

`ModelRunner.kernel_build_threads` (the engine option `kernel_build_threads`; 0 or 1 turns it off) sets
the threads; any failure is logged and start-up goes on as without it: the real runs build whatever is
missing, as they always did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from runner.config import MAX_DECODE_WINDOW
from runner.layers.greedy_argmax import greedy_argmax
from runner.layers.triton_launch import build_ahead
from runner.worker import window_advance
from runner.worker.cuda_graphs import mixed_graph_token_sizes
from runner.worker.memory_profile import largest_step_on_scratch_cache
from runner.worker.step_graphs import decode_graph_body, decode_graph_sizes, mixed_graph_body

if TYPE_CHECKING:
    from runner.step_io import SchedulerOutput
    from runner.worker.runner_parts import RunnerParts

logger = logging.getLogger(__name__)


@torch.inference_mode()
def build_startup_kernels(runner: RunnerParts, *, graphs: bool) -> bool:
    """Build the kernels of the profile step and (with `graphs`) of every graph bucket's body at once, on
    `runner.kernel_build_threads` threads. Returns whether the pass ran to its end."""
    try:
        with largest_step_on_scratch_cache(runner) as largest_step, \
                build_ahead(runner.kernel_build_threads) as on:
            if on:
                _run_startup_steps(runner, largest_step, graphs)
        return on
    except Exception as exc:  # noqa: BLE001 - an optimisation: the real runs build what is missing
        logger.warning("building start-up kernels ahead failed (%s: %s); they are built as they are met",
                       type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return False
    finally:
        runner.decode_graphs.release()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _run_startup_steps(runner: RunnerParts, largest_step: Callable[[], SchedulerOutput],
                       graphs: bool) -> None:
    """The profile's step and the prompt-embeds overlay, then every mixed-step and decode graph body (on
    temporary output buffers: the capture allocates its own)."""
    runner.execute(largest_step())
    if runner.prompt_embeds_state is not None:  # skipped by every step without live embeds
        runner.prompt_embeds_state.build_kernel()
    if not graphs:
        return
    decode_sizes = decode_graph_sizes(runner)
    outputs = runner.decode_graphs
    outputs.allocate(decode_sizes, runner.vocab_size, MAX_DECODE_WINDOW, runner.device, runner.head_dtype)
    for tokens in reversed(mixed_graph_token_sizes(runner.mixed_graph_max_tokens)):
        mixed_graph_body(runner, tokens)()
    for b in reversed(decode_sizes):
        decode_graph_body(runner, b)()
    greedy_argmax(outputs.head_logits[:1], outputs.window_tokens[0, :1])  # a decode window's argmax
    window_advance.build_kernels(runner.device, runner.block_size)  # and its step advance


__all__ = ["build_startup_kernels"]
