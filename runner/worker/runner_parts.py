"""What the model runner's step helpers may use of it: one interface, below the runner.

Why: the decode window (`decode_window.py`), the graph bodies and their capture (`step_graphs.py`), the
activation profile (`memory_profile.py`) and the start-up build-ahead (`kernel_builds_ahead.py`) are
parts of `ModelRunner`'s work kept in their own modules. They take the runner as a `RunnerParts`: this
protocol lists every attribute and method they touch, so a reader sees what each may reach, and none of
them imports the runner back (`ModelRunner` meets the protocol structurally).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from runner.layers.attention_metadata import AttentionMetadata
    from runner.multimodal.state import MultimodalState
    from runner.step_io import SchedulerOutput, StepResult
    from runner.worker.cuda_graphs import DecodeGraphs, GraphBuckets
    from runner.worker.inputs_embeds import InputsEmbedsBuilder
    from runner.worker.kv_cache import KVCacheSpec
    from runner.worker.pending_tokens import PendingTokenFeed
    from runner.worker.prompt_embeds import PromptEmbedsState
    from runner.worker.staging import StagedStep, StagingBuffers


class RunnerParts(Protocol):
    """The model runner as its step helpers see it (`runner.worker.model_runner.ModelRunner`)."""

    # sizes and settings
    device: torch.device
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_req: int
    mixed_graph_max_tokens: int
    vocab_size: int
    head_dtype: torch.dtype
    kernel_build_threads: int
    kernels_built_ahead: bool
    # state the helpers read or swap
    mm: MultimodalState | None
    kv_spec: KVCacheSpec
    kv_caches: list[torch.Tensor]
    num_blocks_known: np.ndarray
    token_table: torch.Tensor
    staging: StagingBuffers
    embeds_builder: InputsEmbedsBuilder
    embed_tokens: Any
    decode_graphs: DecodeGraphs
    mixed_graphs: GraphBuckets
    token_feed: PendingTokenFeed
    prompt_embeds_state: PromptEmbedsState | None
    # counters
    num_forward_steps: int
    num_graph_replays: int
    num_decode_windows: int

    def stage(self, so: SchedulerOutput) -> StagedStep: ...

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor | None, *, to_float: bool = True,
                logits_out: torch.Tensor | None = None) -> torch.Tensor: ...

    def execute(self, so: SchedulerOutput) -> StepResult: ...

    def mixed_graph_rows(self, tokens: int) -> int: ...

    def startup_phase(self, name: str) -> contextlib.AbstractContextManager[None]: ...


__all__ = ["RunnerParts"]
