"""Prompt embeds to the device before their requests run: upload, keep, and the NaN/Inf check.

`PromptProcessor` (`runner.engine.prompts`) parses a call's prompts; this module takes their embeds to
the device through the runner's `HostUploader` (pinned ring, copy stream), keeps the device copies within
the uploader's budget so admission uploads nothing, and refuses a call whose embeds hold NaN/Inf (or
values the cast to the model dtype turns into Inf) with a `ValueError` naming the first bad prompt. A call
may leave its later prompts to a `DeferredEmbeds`, run once its first step is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from runner.multimodal.placeholders import tensors_fit_dtype
from runner.request import Request
from runner.worker.host_upload import HostUploader

if TYPE_CHECKING:  # the processor calls this module, not the other way round
    from runner.engine.parsed_prompt import ParsedPrompt


def refuse_not_finite(bad: list[int], dtype: torch.dtype | None, first_index: int = 0) -> None:
    """A ValueError naming the first of the `bad` prompts (indices counted from `first_index`)."""
    if bad:
        raise ValueError(f"prompt {first_index + min(bad)}: prompt_embeds contains NaN or Inf (or values "
                         f"beyond the range of the model dtype {dtype})")


def check_embeds_finite(parsed: Sequence[ParsedPrompt], dtype: torch.dtype | None = None, *,
                        first_index: int = 0) -> None:
    """NaN/Inf in any prompt's embeds, or a value that the cast to the model `dtype` turns into
    Inf, is a ValueError naming the first such prompt.

    One host sync per device for the whole call instead of one per prompt (64 prompts on a GPU
    paid 64 round trips before anything was scheduled).
    """
    where = [i for i, p in enumerate(parsed) if p.embeds is not None]
    fits = tensors_fit_dtype([parsed[i].embeds for i in where], dtype)
    refuse_not_finite([i for i, ok in zip(where, fits) if not ok], dtype, first_index)


def stage_embeds(parsed: Sequence[ParsedPrompt], dtype: torch.dtype, uploader: HostUploader, *,
                 keep: bool, first_index: int = 0) -> None:
    """Upload every prompt's embeds through `uploader` (pinned ring, copy stream) and check them there:
    NaN/Inf, or a value the cast to `dtype` turns into Inf, is a ValueError naming the first such prompt.

    The check costs the host one `memcpy` per prompt and one wait on the copy stream per call, where a
    check on the CPU cost several passes over the rows. With `keep`, a prompt's device copy replaces
    its host tensor while the uploader's keep budget allows, so admission uploads nothing; the others
    are uploaded again (asynchronously) when admitted. Errors count prompts from `first_index`.
    """
    if keep and _stage_as_one(parsed, dtype, uploader, first_index):
        return
    flags, where = [], []
    for i, p in enumerate(parsed):
        if p.embeds is None:
            continue
        rows, ok = uploader.upload(p.embeds, dtype, check_fits=True)
        flags.append(ok)
        where.append(i)
        if keep and uploader.keep(rows):
            p.embeds = rows
    bad = [i for i, ok in zip(where, uploader.read_flags(flags)) if not ok]
    refuse_not_finite(bad, dtype, first_index)


def stage_or_check(parsed: Sequence[ParsedPrompt], dtype: torch.dtype, uploader: HostUploader | None, *,
                   keep: bool, first_index: int = 0) -> None:
    """`stage_embeds` through `uploader`, or without one (off a GPU) `check_embeds_finite` on the CPU."""
    if uploader is not None:
        stage_embeds(parsed, dtype, uploader, keep=keep, first_index=first_index)
    else:
        check_embeds_finite(parsed, dtype, first_index=first_index)


def _stage_as_one(parsed: Sequence[ParsedPrompt], dtype: torch.dtype, uploader: HostUploader,
                  first_index: int = 0) -> bool:
    """`stage_embeds` for a call whose embeds are all host tensors (or all tensors on the uploader's
    device) of one dtype and width: batched uploads (see `stage_calls_as_one`); False (nothing done)
    otherwise."""
    bad = stage_calls_as_one([parsed], dtype, uploader)
    if bad is None:
        return False
    refuse_not_finite(bad[0], dtype, first_index)
    return True


#: prompts beyond the keep budget are checked on the device in uploads of at most this many bytes
CHECK_CHUNK_BYTES = 64 << 20


def stage_calls_as_one(calls: Sequence[Sequence[ParsedPrompt]], dtype: torch.dtype,
                        uploader: HostUploader) -> list[list[int]] | None:
    """The embeds of several calls in batched uploads when they can go together (tensors of one dtype
    and width, at least two, all on the host or all on the uploader's device): per call the indices of
    its prompts that fail the NaN/Inf check. None (nothing done) when they cannot.

    The leading prompts that fit the uploader's keep budget go up as one tensor that stays on the
    device (their admission uploads nothing); the rest are checked in `CHECK_CHUNK_BYTES` uploads and
    stay on the host until admitted. Why: a call beyond the budget went prompt by prompt, each with its
    own allocation, copy, events and check kernels, and its `memcpy` on one thread, a measurable share
    of the call against the same prompts already on the device. Device prompts went prompt by prompt
    too, all of it host time before the first step.
    """
    where = [(c, i) for c, parsed in enumerate(calls) for i, p in enumerate(parsed) if p.embeds is not None]
    if len(where) < 2:
        return None
    srcs = [calls[c][i].embeds for c, i in where]
    first = srcs[0]
    # All on the host, or all already on the uploader's device (an in-process encoder's output).
    device = uploader.device if first.device == uploader.device else torch.device("cpu")
    if any(t.device != device or t.dtype != first.dtype or t.dim() != 2 or t.shape[1] != first.shape[1]
           for t in srcs):
        return None
    row_bytes = first.shape[1] * dtype.itemsize
    if row_bytes % 16:  # each view must start 16-byte aligned (the overlay's)
        return None
    sizes = [t.shape[0] * row_bytes for t in srcs]
    kept, room = 0, uploader.keep_bytes - uploader.kept_bytes
    while kept < len(srcs) and sizes[kept] <= room:
        room -= sizes[kept]
        kept += 1
    flags, whole, views = [], None, []
    if kept:
        whole, views, ok = uploader.upload_rows(srcs[:kept], dtype)
        flags.append(ok)
    start = kept
    while start < len(srcs):  # chunks of at most CHECK_CHUNK_BYTES, at least one prompt each
        end, size = start + 1, sizes[start]
        while end < len(srcs) and size + sizes[end] <= CHECK_CHUNK_BYTES:
            size += sizes[end]
            end += 1
        flags.append(uploader.check_rows(srcs[start:end], dtype))
        start = end
    bad: list[list[int]] = [[] for _ in calls]
    for (c, i), fits in zip(where, uploader.read_flag_tensor(flags)):
        if not fits:
            bad[c].append(i)
    if whole is not None:
        uploader.keep(whole)  # charged once; given back when the last prompt's view is freed
    for (c, i), view in zip(where[:kept], views):
        if not bad[c]:  # a refused call keeps its host tensors: nothing of it holds the device copy
            calls[c][i].embeds = view
    return bad


def num_leading_prompts(parsed: Sequence[ParsedPrompt], rows: int, prompts: int) -> int:
    """How many leading prompts to check now: those the first step can take (the fewest whose rows reach
    `rows`, at most `prompts`, at least one), or all when a later one's embeds are already on a device
    (their check reads them after the caller's queued work, which would then include the first step)."""
    total, n = 0, min(len(parsed), max(1, prompts))
    for i, p in enumerate(parsed[:n]):
        total += len(p.token_ids)
        if total >= rows:
            n = i + 1
            break
    if any(p.embeds is not None and p.embeds.device.type != "cpu" for p in parsed[n:]):
        return len(parsed)
    return n


class DeferredEmbeds:
    """The prompt embeds of a call's later prompts, not yet checked for NaN/Inf nor uploaded
    (`runner.engine.prompts.PromptProcessor.process_leading`).

    `run()` does what `process` would have done for them: the upload through the pinned ring (kept on
    the device within the uploader's budget, so their admission uploads nothing) and the check, a
    ValueError naming the first bad prompt by its index in the call. The caller runs it once the first
    step is launched and must then drop the whole call when it raises: until then a bad later prompt
    may only have been computed (its KV blocks are freed with the call; nothing is returned).
    """

    def __init__(self, parsed: list[ParsedPrompt], requests: list[Request], first_index: int,
                 dtype: torch.dtype, uploader: HostUploader | None, keep: bool) -> None:
        self.parsed = parsed
        self.requests = requests
        self.first_index = first_index
        self.dtype = dtype
        self.uploader = uploader  # None: checked on the CPU
        self.keep = keep

    def run(self) -> None:
        stage_or_check(self.parsed, self.dtype, self.uploader, keep=self.keep, first_index=self.first_index)
        for parsed, request in zip(self.parsed, self.requests):
            # The kept device copy serves the request's admission (or re-admission after a preemption).
            request.prompt_embeds = parsed.embeds


__all__ = [
    "CHECK_CHUNK_BYTES", "DeferredEmbeds", "check_embeds_finite", "num_leading_prompts", "refuse_not_finite",
    "stage_calls_as_one", "stage_embeds", "stage_or_check",
]
