"""Step CUDA graphs: decode steps by batch-size bucket, mixed (prefill) steps by token-count bucket.

A graph covers the decoder and the LM head of a step on fixed staging views (see
`runner.worker.staging`); its input is the persistent inputs_embeds buffer, so the assembly
(token lookup, item gather, prompt-embeds overlay) runs eagerly right before each replay and no
encoder ever runs at capture.

- Decode graphs (`DecodeGraphs`): one query row per request. Padding rows of a bucket write no KV
  (slot -1) and attend to nothing (seq_len 0).
- Mixed graphs (`GraphBuckets` keyed by token count): any step of at most `mixed_graph_max_tokens`
  tokens, prefill chunks and decodes together. Why: an eager step launches every kernel of every
  layer from Python, host time that for a small model is many times a short prefill's GPU time; a
  server admitting requests as they arrive runs a
  chain of such steps, each waiting on the host. The attention kernels' grids depend only on the
  token count and the request count (both fixed per bucket), and they find each query block's
  request on the device, so the same graph replays any mix. A bucket of T tokens holds up to
  min(T, max_num_seqs) requests; padding requests have no query rows, padding tokens belong to no
  request and write no KV; the LM head runs on one row per request slot, sampled rows first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def mixed_graph_token_sizes(max_tokens: int) -> list[int]:
    """Mixed-step token buckets: 16, 32, ..., 512, then steps of half a power of two (768, 1024,
    1536, 2048, 3072, ...), and `max_tokens` itself; a bucket pads a step by less than half."""
    if max_tokens <= 0:
        return []
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b = b * 2 if b < 512 else (b // 2 * 3 if b & (b - 1) == 0 else b // 3 * 4)
    return [*sizes, max_tokens]


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


def _capture(body: Callable[[], None], pool: tuple | None) -> torch.cuda.CUDAGraph:
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


class GraphBuckets:
    """Captured graphs by size bucket (a decode batch size, or a mixed step's token count)."""

    kind = "mixed-step"

    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph | _EagerReplay] = {}
        self.sizes: list[int] = []

    def bucket(self, n: int) -> int | None:
        """The smallest captured size that holds `n` (requests or tokens), or None."""
        for b in self.sizes if self.graphs else ():
            if b >= n:
                return b
        return None

    def capture(self, make_body: Callable[[int], Callable[[], None]], *, pool: tuple | None = None,
                emulate: bool = False, warmups: int = 2) -> tuple | None:
        """Capture `make_body(b)` for every bucket, largest first, in one memory pool (`pool`, or a
        new one); returns the pool, so that the next set's graphs can share it.

        Each body runs `warmups` times before its capture (Triton builds and loads its kernels, cuBLAS
        picks its own); 1 where a build-ahead pass already ran every body once
        (`runner.worker.kernel_builds_ahead`). With one warm-up, a capture that fails gets a second
        warm-up and one more try, as the two-warm-up default would have had.

        `emulate=True` (tests, CPU): no capture; "replay" runs the same body eagerly on the same
        fixed views, which exercises the bucket, padding and fixed-offset logic without a GPU.
        """
        if emulate:
            self.graphs = {b: _EagerReplay(make_body(b)) for b in self.sizes}
            return pool
        for b in reversed(self.sizes):
            body = make_body(b)
            for _ in range(max(1, warmups)):
                body()
            try:
                graph = _capture(body, pool)
            except RuntimeError as exc:  # e.g. something set up lazily on a body's second run
                if warmups >= 2:
                    raise
                logger.info("capturing the %s graph of size %d after one warm-up failed (%s); warming up "
                            "once more", self.kind, b, str(exc).splitlines()[0][:200] if str(exc) else "")
                torch.cuda.synchronize()
                body()
                graph = _capture(body, pool)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured %d %s CUDA graphs for sizes %s", len(self.graphs), self.kind, self.sizes)
        return pool

    def release(self) -> None:
        """Drop the graphs (and with them their share of the memory pool)."""
        for graph in self.graphs.values():
            if hasattr(graph, "reset"):
                graph.reset()
        self.graphs = {}


class DecodeGraphs(GraphBuckets):
    """Decode graphs by batch-size bucket, plus the fixed output buffers every replay writes.

    A decode graph writes its LM-head output, in the head's dtype, into `head_logits`; the runner casts
    the rows it samples into `logits` (fp32, one row per bucket slot) after the replay, and a greedy
    decode window takes its argmax from `head_logits` directly, without the cast (an fp32 copy of a whole
    vocabulary's logits per row, every step). A mixed-step graph writes `logits` itself.
    `window_tokens` holds the argmax of every step of a decode window (`ModelRunner.execute_decode_window`);
    each window's tokens are copied from it into one of two host buffers (`host_tokens`, pinned on a GPU,
    made at the first window), used in turn, so the host reads a window's tokens while the next window
    runs and overwrites `window_tokens` (`runner.worker.decode_window`).
    """

    kind = "decode"

    def __init__(self) -> None:
        super().__init__()
        self.logits: torch.Tensor | None = None
        self.head_logits: torch.Tensor | None = None
        self.window_tokens: torch.Tensor | None = None
        self.window_tokens_host: list[torch.Tensor] = []

    def allocate(self, sizes: list[int], vocab_size: int, max_window: int, device: torch.device,
                 head_dtype: torch.dtype = torch.float32) -> None:
        self.sizes = sizes
        self.logits = torch.zeros(sizes[-1], vocab_size, dtype=torch.float32, device=device)
        self.head_logits = torch.zeros(sizes[-1], vocab_size, dtype=head_dtype, device=device)
        self.window_tokens = torch.zeros(max_window, sizes[-1], dtype=torch.int64, device=device)

    def release(self) -> None:
        """Drop the graphs (and with them their memory pool) and the output buffers."""
        super().release()
        self.logits, self.head_logits, self.window_tokens = None, None, None
        self.window_tokens_host = []

    def host_tokens(self, turn: int) -> torch.Tensor:
        """Host buffer `turn % 2` for a window's tokens, shaped like `window_tokens` (made on first use:
        start-up's scratch outputs and engines that never run a window need none)."""
        if not self.window_tokens_host:
            shape, pin = self.window_tokens.shape, self.window_tokens.device.type == "cuda"
            self.window_tokens_host = [torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
                                       for _ in range(2)]
        return self.window_tokens_host[turn % 2]


__all__ = ["DecodeGraphs", "GraphBuckets", "cuda_graph_batch_sizes", "mixed_graph_token_sizes"]
