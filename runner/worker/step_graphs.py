"""What a runner's step graphs replay, and their capture: mixed-step graphs first, then decode graphs.

The containers and bucket sizes are in `runner.worker.cuda_graphs`; the bodies here run the runner's
own forward on fixed views of its staging buffers (see there for why a mixed step needs no piecewise
capture), so a replay is exactly the eager step it stands for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from runner.config import MAX_DECODE_WINDOW
from runner.layers.attention_metadata import AttentionMetadata
from runner.worker.cuda_graphs import cuda_graph_batch_sizes, mixed_graph_token_sizes

if TYPE_CHECKING:
    from runner.worker.runner_parts import RunnerParts

logger = logging.getLogger(__name__)

# The prefill tile class every mixed-step graph is captured with (see `mixed_graph_body`).
MIXED_GRAPH_MIN_QUERY_ROWS = 64


def decode_graph_sizes(runner: RunnerParts) -> list[int]:
    """The decode graphs' batch-size buckets: up to the most requests one step can hold."""
    return cuda_graph_batch_sizes(min(runner.max_num_seqs, runner.max_num_batched_tokens))


def decode_graph_body(runner: RunnerParts, b: int) -> Callable[[], None]:
    """The work a decode graph of bucket `b` replays, on the fixed views of that bucket."""
    st = runner.staging
    v = st.views(st.dev64, st.dev32, b, b, runner.max_blocks_per_req, 0)
    v.input_ids.zero_()
    v.positions.zero_()
    v.slot_mapping.fill_(-1)
    v.query_start_loc.copy_(torch.arange(b + 1, dtype=torch.int32))
    v.seq_lens.zero_()
    v.block_tables.zero_()
    meta = AttentionMetadata(v.slot_mapping, v.query_start_loc, v.seq_lens, v.block_tables,
                             max_query_len=1, max_seq_len=runner.max_model_len, num_reqs=b,
                             is_decode_only=True)
    embeds = runner.embeds_builder.dummy_inputs_embeds(b)

    def body() -> None:
        # The head writes its own dtype's logits straight into the fixed buffer (see DecodeGraphs).
        runner.forward(embeds, v.positions, meta, None, logits_out=runner.decode_graphs.head_logits[:b])

    return body


def mixed_graph_body(runner: RunnerParts, tokens: int) -> Callable[[], None]:
    """The work a mixed-step graph of `tokens` tokens replays: the decoder over `tokens` rows and the LM
    head over one row per request slot (sampled rows first, `logits_indices`)."""
    st = runner.staging
    rows = runner.mixed_graph_rows(tokens)
    v = st.views(st.dev64, st.dev32, tokens, rows, runner.max_blocks_per_req, rows)
    v.input_ids.zero_()
    v.positions.zero_()
    v.slot_mapping.fill_(-1)
    v.logits_indices.zero_()
    v.query_start_loc.zero_()
    v.seq_lens.zero_()
    v.block_tables.zero_()
    # No host copies of the request layout: the kernels read it on the device, and both attention
    # kernels always launch. Every bucket uses the prefill tile class of 64-row queries or more (the one
    # the construction warm-up builds): the 16- and 32-token buckets' own classes built two more kernels
    # at start-up (about 1 s each on a cold machine) for steps of a few microseconds.
    meta = AttentionMetadata(v.slot_mapping, v.query_start_loc, v.seq_lens, v.block_tables,
                             max_query_len=max(tokens, MIXED_GRAPH_MIN_QUERY_ROWS),
                             max_seq_len=runner.max_model_len, num_reqs=rows)
    embeds = runner.embeds_builder.dummy_inputs_embeds(tokens)

    def body() -> None:
        logits = runner.forward(embeds, v.positions, meta, v.logits_indices, to_float=False)
        runner.decode_graphs.logits[:rows].copy_(logits)

    return body


@torch.inference_mode()
def capture_step_graphs(runner: RunnerParts, *, emulate: bool = False) -> None:
    """Capture the mixed-step graphs, then a decode graph per batch-size bucket, in one memory pool; on
    the CPU only with `emulate=True` (tests), where "replay" runs the same body eagerly.

    A model whose prefill forward cannot be captured (a host sync in some layer) keeps eager prefill
    steps: the failure is logged and only the decode graphs are kept.
    """
    if runner.device.type != "cuda" and not emulate:
        return
    sizes = decode_graph_sizes(runner)
    runner.decode_graphs.allocate(sizes, runner.vocab_size, MAX_DECODE_WINDOW, runner.device,
                                  runner.head_dtype)
    mixed = runner.mixed_graphs
    mixed.sizes = mixed_graph_token_sizes(runner.mixed_graph_max_tokens)  # capped at the step budget
    warmups = 1 if runner.kernels_built_ahead else 2  # the build-ahead pass ran every body once already
    pool = None
    if mixed.sizes:
        try:
            with runner.startup_phase("mixed_graphs"):
                pool = mixed.capture(lambda tokens: mixed_graph_body(runner, tokens), emulate=emulate,
                                    warmups=warmups)
        except RuntimeError as exc:  # e.g. "operation not permitted when stream is capturing"
            logger.warning("prefill and mixed steps stay eager: capturing their CUDA graphs failed (%s)",
                           str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
            mixed.release()
            mixed.sizes = []
            pool = None
            if not emulate:
                torch.cuda.synchronize()
    with runner.startup_phase("decode_graphs"):
        runner.decode_graphs.capture(lambda b: decode_graph_body(runner, b), pool=pool, emulate=emulate,
                                     warmups=warmups)


__all__ = [
    "MIXED_GRAPH_MIN_QUERY_ROWS", "capture_step_graphs", "decode_graph_body", "decode_graph_sizes",
    "mixed_graph_body",
]
