"""Decode-step CUDA graphs: one per batch-size bucket, captured once, replayed every decode step.

A graph covers the decoder and the LM head of a decode step on fixed staging views (see
`runner.worker.staging`); its input is the persistent inputs_embeds buffer, so the assembly
(token lookup, prompt-embeds overlay) runs eagerly right before each replay and no encoder ever
runs at capture. Padding rows of a bucket write no KV (slot -1) and attend to nothing (seq_len 0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch-size buckets: 1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond."""
    sizes = [1, 2, 4]
    b = 8
    while b <= max_num_seqs:
        sizes.append(b)
        b += 8 if b < 64 else (16 if b < 256 else 32)
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return [s for s in sizes if s <= max_num_seqs]


class _EagerReplay:
    """Stands in for a CUDA graph where none can be captured: replay runs the body eagerly."""

    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


class DecodeGraphs:
    """The captured graphs by bucket, plus the fixed output buffers every replay writes.

    `logits` (fp32, one row per bucket slot) takes each replay's LM-head output; `window_tokens`
    holds the argmax of every step of a decode window (`ModelRunner.execute_decode_window`).
    """

    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph | _EagerReplay] = {}
        self.sizes: list[int] = []
        self.logits: torch.Tensor | None = None
        self.window_tokens: torch.Tensor | None = None

    def bucket(self, num_reqs: int) -> int | None:
        """The smallest captured batch size that holds `num_reqs` requests, or None."""
        for b in self.sizes if self.graphs else ():
            if b >= num_reqs:
                return b
        return None

    def allocate(self, sizes: list[int], vocab_size: int, max_window: int, device: torch.device) -> None:
        self.sizes = sizes
        self.logits = torch.zeros(sizes[-1], vocab_size, dtype=torch.float32, device=device)
        self.window_tokens = torch.zeros(max_window, sizes[-1], dtype=torch.int64, device=device)

    def capture(self, make_body: Callable[[int], Callable[[], None]], *, emulate: bool = False) -> None:
        """Capture `make_body(b)` for every bucket, largest first, sharing one memory pool.

        `emulate=True` (tests, CPU): no capture; "replay" runs the same body eagerly on the same
        fixed views, which exercises the bucket, padding and fixed-offset logic without a GPU.
        """
        if emulate:
            self.graphs = {b: _EagerReplay(make_body(b)) for b in self.sizes}
            return
        pool = None
        for b in reversed(self.sizes):
            body = make_body(b)
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                body()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                body()
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.sizes)

    def release(self) -> None:
        """Drop the graphs (and with them their memory pool) and the output buffers."""
        for graph in self.graphs.values():
            if hasattr(graph, "reset"):
                graph.reset()
        self.graphs, self.logits, self.window_tokens = {}, None, None


__all__ = ["DecodeGraphs", "cuda_graph_batch_sizes"]
