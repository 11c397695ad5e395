"""Continuous batching: which requests run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests go first, decodes before partial prefills, so generation
never stalls behind a long prompt; waiting requests then fill what budget is left, a long
prompt taking a chunk now and the rest in later steps (chunked prefill). When the KV pool runs
dry the most recently admitted request is preempted by recompute: its blocks are freed, its
progress reset, and it returns to the front of the waiting queue, tokens generated so far
kept, to be prefilled again later.

Request slots (rows of the per-request state tensors) come from a free list. The runner is
told through `on_admit` / `on_release`; `on_release` runs before the slot is put back, so a
request's model state (its prompt-embeds rows) is gone before anyone else can get the slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from runner.engine.block_manager import BlockManager
from runner.request import Request, RequestStatus
from runner.step_io import SchedulerOutput, StepResult


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_admit: Callable[[Request], None] | None = None,
        on_release: Callable[[Request], None] | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_admit = on_admit or (lambda req: None)
        self.on_release = on_release or (lambda req: None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: deque[int] = deque(range(max_num_seqs))
        self.requests: dict[str, Request] = {}
        # Counters for tests and metrics.
        self.num_preemptions = 0
        self.num_partial_prefills = 0  # chunks that did not finish their request's prefill
        self.num_mixed_steps = 0  # steps that carried decodes and prefill chunks together
        self.num_discarded_tokens = 0  # async scheduling: sampled for a request that had already ended

    # ----------------------------------------------------------------------------- queue
    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status == RequestStatus.RUNNING:
            self._retire(request)
        else:
            self.waiting.remove(request)
            del self.requests[request_id]
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    # ----------------------------------------------------------------------------- slots
    def _admit(self, request: Request) -> None:
        """Slot, RUNNING and in `running` before the runner is told, so that if `on_admit` raises
        (say, out of device memory) `abort_request` still finds the request and frees everything."""
        request.slot = self.free_slots.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.on_admit(request)

    def _release(self, request: Request) -> None:
        """Free KV blocks, then clean the model state, then return the slot: in that order."""
        self.block_manager.free(request)
        if request.slot is not None:
            self.on_release(request)
            self.free_slots.append(request.slot)
            request.slot = None

    def _retire(self, request: Request) -> None:
        """A running request finished: out of the running set, everything it held released."""
        self.running.remove(request)
        self._release(request)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.reset_for_recompute()
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # ----------------------------------------------------------------------------- schedule
    def schedule(self, *, allow_preemption: bool = True) -> SchedulerOutput | None:
        """Plan the next step. With `allow_preemption=False` (async scheduling, a step in flight)
        return None instead of preempting: the caller finishes the step in flight and asks again.

        A request whose tokens in flight will certainly end it (max_tokens or the context limit
        reached whatever their values) is not planned again.
        """
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        bm = self.block_manager

        decodes: list[Request] = []
        partial: list[Request] = []
        for r in self.running:
            (decodes if r.num_tokens - r.num_computed_tokens == 1 else partial).append(r)
        for request in (decodes + partial) if partial else decodes:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.finishes_by_length_when_resolved:
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not bm.allocate_slots(request, request.num_computed_tokens + n):
                if not allow_preemption:
                    return None
                while True:
                    victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is request or bm.allocate_slots(request, request.num_computed_tokens + n):
                        break
            if request.status != RequestStatus.RUNNING:
                continue
            self._add(out, request, n, scheduled)
            budget -= n

        if not out.preempted:
            while (budget > 0 and self.waiting and self.free_slots
                   and len(self.running) < self.max_num_seqs):
                request = self.waiting[0]
                _, num_cached = bm.get_computed_blocks(request)  # prefix-cache hits join its table
                n = min(request.num_tokens - num_cached, budget)
                if not bm.allocate_slots(request, num_cached + n):
                    bm.free(request)  # give back the hits taken above; retried next step
                    break
                self.waiting.popleft()
                request.num_computed_tokens = num_cached
                if request.num_cached_tokens is None:  # first admission (not a recompute)
                    request.num_cached_tokens = num_cached
                self._admit(request)
                self._add(out, request, n, scheduled)
                budget -= n

        if 1 in out.num_scheduled_tokens and not out.is_single_token:
            self.num_mixed_steps += 1
        return out

    def _add(self, out: SchedulerOutput, request: Request, n: int, scheduled: set[str]) -> None:
        samples = request.num_computed_tokens + n == request.num_tokens
        out.requests.append(request)
        out.num_scheduled_tokens.append(n)
        out.samples.append(samples)
        out.decoding.append(request.num_computed_tokens >= request.num_prompt_tokens)
        scheduled.add(request.request_id)
        if not samples:
            self.num_partial_prefills += 1

    def window_requests(self) -> list[Request]:
        """The running requests a decode window planned now would carry: all of them, less those whose
        tokens in flight (a window still on the device) will end them by length whatever their values."""
        return [r for r in self.running if not r.finishes_by_length_when_resolved]

    def decode_window_size(self, max_window: int, max_model_len: int) -> int:
        """How many greedy decode steps may run without looking at their tokens (1 = not now).

        Only when nothing waits for admission and every request of the window (`window_requests`)
        decodes greedily with no penalties, logprobs, pending min_tokens or grammar (structured
        outputs: each token's mask needs the matcher to have read the token before it). The window
        never reaches past any request's context (`max_model_len`), nor past the step at which every
        request has reached its max_tokens. A request that stops inside the window (EOS, stop ids or
        strings, max_tokens) wastes the rest of it on its own KV blocks, and its later tokens are dropped.
        Tokens of a window still in flight count as produced (`num_pending_outputs`), so the next
        window can be planned before they are read.
        """
        if max_window <= 1 or self.waiting or not self.running:
            return 1
        k = max_window
        most_left = 0  # tokens the longest-running request may still produce
        for r in self.window_requests():
            p = r.sampling_params
            produced = r.num_output_tokens + r.num_pending_outputs
            if (r.num_tokens - r.num_computed_tokens != 1 or not p.is_greedy or p.uses_penalties
                    or p.logprobs is not None or produced < p.min_tokens
                    or r.grammar is not None):
                return 1
            k = min(k, max_model_len - r.num_tokens)
            most_left = max(most_left, p.max_tokens - produced)
        return min(k, most_left)

    def schedule_decode_window(self, k: int) -> SchedulerOutput | None:
        """Every request of the window (`window_requests`) decodes `k` tokens; KV blocks for all of them
        are taken now.

        None (nothing scheduled) if the pool cannot cover the window: the caller then takes a
        normal step, which preempts as needed. Blocks already added stay with their requests.
        """
        bm = self.block_manager
        requests = self.window_requests()
        for r in requests:
            if not bm.allocate_slots(r, r.num_computed_tokens + k):
                return None
        n = len(requests)
        return SchedulerOutput(requests, [1] * n, [True] * n)

    def mark_window_launched(self, out: SchedulerOutput, k: int) -> None:
        """A window of `k` steps is on the device: its KV counts as computed and its `k` tokens per request
        as pending outputs, so the next window can be planned before they are read (`update_window`
        takes these provisional counts back before it appends the tokens)."""
        for request in out.requests:
            request.num_computed_tokens += k
            request.num_pending_outputs += k
            request.num_tokens += k

    def update_window(self, out: SchedulerOutput, tokens: list[list[int]], k: int) -> list[Request]:
        """Advance each request through its window tokens until it stops; later tokens are dropped. A
        request that ended while the window ran (it stopped in the window before, or was aborted) has
        them all dropped. A request that stops here has the tokens of the window launched after this one
        dropped too: its counts fall back to the tokens it keeps."""
        finished: list[Request] = []
        for request, toks in zip(out.requests, tokens):
            if request.is_finished:
                self.num_discarded_tokens += len(toks)
                continue
            request.num_pending_outputs -= k
            request.num_tokens -= k
            request.num_computed_tokens -= k
            request.num_computed_tokens += request.append_window_tokens(toks)
            if request.is_finished:
                request.drop_pending_outputs()
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                self._retire(request)
                finished.append(request)
        return finished

    # ----------------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Advance every scheduled request by the step's result; returns the requests that finished."""
        self.mark_launched(out)
        return self.finish_step(out, result)

    def mark_launched(self, out: SchedulerOutput) -> None:
        """The step is on the device: its tokens count as computed and each sampling request has
        one more (pending) token, so the next step can be planned before the values are read."""
        for request, n, samples in zip(out.requests, out.num_scheduled_tokens, out.samples):
            request.num_computed_tokens += n
            if samples:
                request.add_pending_output()

    def finish_step(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """The step's sampled tokens arrived: append them and run the stop checks. A request that
        finished after the step was planned (async scheduling) has its output here discarded."""
        finished: list[Request] = []
        for i, request in enumerate(out.requests):
            if request.is_finished:
                self.num_discarded_tokens += result.sampled_token_ids[i] is not None
                continue
            if result.prompt_logprobs and request.prompt_logprobs is not None:
                first, entries = result.prompt_logprobs.get(request.request_id, (0, []))
                known = request.prompt_logprobs
                # A recomputed (preempted) prefill produces entries we already hold: keep the first.
                known.extend(entries[max(0, len(known) - first):])
            token = result.sampled_token_ids[i]
            if token is None:
                continue
            logprob = result.logprobs[i] if result.logprobs is not None else None
            top = result.top_logprobs[i] if result.top_logprobs is not None else None
            request.resolve_pending_output(token, logprob, top)
            if request.check_stop():
                request.drop_pending_outputs()
                self._retire(request)
                finished.append(request)
        return finished

    @staticmethod
    def without(out: SchedulerOutput, drop: Callable[[Request, bool], bool]) -> SchedulerOutput:
        """`out` less the requests for which `drop(request, samples)` holds. A dropped request keeps
        the blocks planned for it (it needs them next step) and its progress is not advanced."""
        keep = [i for i, (r, s) in enumerate(zip(out.requests, out.samples)) if not drop(r, s)]
        if len(keep) == out.num_reqs:
            return out
        return SchedulerOutput([out.requests[i] for i in keep], [out.num_scheduled_tokens[i] for i in keep],
                               [out.samples[i] for i in keep], decoding=[out.decoding[i] for i in keep])
