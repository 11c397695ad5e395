"""Turn one step's logits into one token per row.

The engine calls `Sampler()(logits, batch)` once per step on the rows that need a token. The work is
vectorized over the batch: penalties are scatters over padded id tensors, top-k/top-p share one sort,
and sampling is an exponential race (`argmax(probs / q)`, `q ~ Exp(1)`), which draws from `probs`
exactly like `torch.multinomial` but lets every seeded row use its own generator. The only Python
loop per row is one `exponential_` call for each row that has a seed: that is what makes "same seed,
same logits => same token" hold whatever else is in the batch and wherever the row sits.

Semantics (vLLM / OpenAI / Hugging Face):

- temperature below `GREEDY_TEMPERATURE_EPS` is greedy: `argmax` of the processed logits, ties to the
  lowest id like `torch.argmax` (so it equals Hugging Face greedy `generate()` when no penalty is set).
- order of processing: min-tokens EOS suppression, repetition penalty, frequency and presence
  penalties, then (sampled rows only) temperature, top-k, top-p.
- repetition penalty (Hugging Face / vLLM): for a token seen in the prompt or the output, a positive
  logit is divided by the penalty and a negative one multiplied by it.
- frequency / presence penalties (OpenAI): over output tokens only,
  `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
- logprobs: the log-softmax of the *raw* logits the model produced (before penalties, temperature,
  top-k/top-p), gathered at the sampled token; this is vLLM's default ("raw_logprobs"). The top-k
  alternatives, when any row asks for `logprobs > 0`, come from the same raw distribution.

Placeholder positions: the engine passes in `penalty_prompt_ids` only the ids of real prompt tokens,
never the placeholder id that stands under an embedding row. As a second guard, any id `< 0` or
`>= vocab` is ignored here, so nothing indexes the vocabulary with a placeholder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runner.layers.batch_invariant import batch_invariant_ops
from runner.sampling_params import SamplingParams

# vLLM's threshold: below it a temperature would overflow `logits / t` and is treated as greedy.
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step, in the row order of the logits.

    `generators[i]` is the request's own generator (created by the engine from `params[i].seed` on the
    logits' device and kept across steps) or None to use the global RNG. `penalty_prompt_ids[i]` are
    the prompt token ids that count for the repetition penalty: real-token positions only, never the
    placeholder ids under embedding rows. `output_ids[i]` are the tokens generated so far.
    `eos_token_ids` (the tokenizer's / generation config's EOS ids) and each request's
    `stop_token_ids` are suppressed while a row has fewer than `min_tokens` outputs.
    Missing lists (None) mean "nothing" for every row.
    """

    params: list[SamplingParams]
    generators: list[torch.Generator | None] | None = None
    penalty_prompt_ids: list[list[int]] | None = None
    output_ids: list[list[int]] | None = None
    eos_token_ids: Sequence[int] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        n = len(self.params)
        for name in ("generators", "penalty_prompt_ids", "output_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"SamplingBatch.{name} has {len(value)} rows, params has {n}")

    def __len__(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    """Sampled ids `(n,)` int64; `logprobs` `(n,)` float32 of each sampled token under the raw
    distribution, or None when no row asked for logprobs; `topk_ids` / `topk_logprobs` `(n, k)` with
    `k = max(params.logprobs)` when some row asked for `logprobs > 0` (rows asking for fewer slice)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_TEMPERATURE_EPS


def _padded_ids(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(len(rows), max_len) int64 with every padding slot and every out-of-vocabulary id (placeholders,
    negative ids) replaced by `vocab_size`, the sentinel column that the caller drops after a scatter."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), max(width, 1)), vocab_size, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    ids[(ids < 0) | (ids > vocab_size)] = vocab_size
    return ids.to(device, non_blocking=True)


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(len(rows), vocab_size) float32 counts of each valid id per row (invalid ids ignored)."""
    ids = _padded_ids(rows, vocab_size, device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _row_values(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True).unsqueeze(1)


class Sampler:
    """Stateless: everything per request lives in the `SamplingBatch` the engine builds each step.
    `batch_invariant` (`EngineConfig.batch_invariant`): the log-softmax of the logprobs (and the other
    row reductions) take their batch-invariant forms (`runner.layers.batch_invariant`)."""

    def __init__(self, *, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        with batch_invariant_ops(self.batch_invariant):
            return self._sample_rows(logits, batch)

    def _sample_rows(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be (num_rows, vocab), got shape {tuple(logits.shape)}")
        n, vocab = logits.shape
        if len(batch) != n:
            raise ValueError(f"logits have {n} rows but the sampling batch has {len(batch)}")
        if n == 0:
            return SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64, device=logits.device))
        params = batch.params

        want_logprobs = any(p.logprobs is not None for p in params)
        needs_processing = self._needs_processing(batch)
        all_greedy = all(_is_greedy(p) for p in params)

        if all_greedy and not needs_processing and not want_logprobs:
            # Fast path: one kernel, no per-row host work.
            return SamplerOutput(token_ids=logits.argmax(dim=-1))

        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
        processed = logits.float().clone() if needs_processing else logits.float()
        if needs_processing:
            self._suppress_stop_tokens(processed, batch)
            apply_penalties(processed, batch)

        if all_greedy:
            token_ids = processed.argmax(dim=-1)
        else:
            token_ids = self._sample(processed, batch)

        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            k = max((p.logprobs or 0) for p in params)
            if k > 0:
                out.topk_logprobs, out.topk_ids = raw_logprobs.topk(min(k, vocab), dim=-1)
        return out

    # -- processing -------------------------------------------------------------------------------------

    @staticmethod
    def _needs_processing(batch: SamplingBatch) -> bool:
        if any(p.uses_penalties for p in batch.params):
            return True
        if any(p.min_tokens > 0 for p in batch.params):
            outputs = batch.output_ids or [[]] * len(batch)
            return any(len(o) < p.min_tokens for p, o in zip(batch.params, outputs))
        return False

    @staticmethod
    def _suppress_stop_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
        """Below `min_tokens`, EOS and the request's stop ids get -inf (vLLM's min_tokens semantics)."""
        vocab = logits.shape[1]
        outputs = batch.output_ids or [[]] * len(batch)
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, out) in enumerate(zip(batch.params, outputs)):
            if len(out) >= p.min_tokens:
                continue
            for t in {*batch.eos_token_ids, *(p.stop_token_ids or [])}:
                if 0 <= t < vocab:
                    rows.append(i)
                    cols.append(t)
        if rows:
            r = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
            c = torch.tensor(cols, dtype=torch.int64).to(logits.device, non_blocking=True)
            logits[r, c] = float("-inf")

    # -- sampling ---------------------------------------------------------------------------------------

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Greedy rows take the argmax; the others are tempered, top-k/top-p filtered and drawn."""
        device = logits.device
        params = batch.params
        n, vocab = logits.shape
        greedy = torch.tensor([_is_greedy(p) for p in params]).to(device, non_blocking=True)
        greedy_ids = logits.argmax(dim=-1)

        temps = _row_values([1.0 if _is_greedy(p) else p.temperature for p in params], device)
        logits = logits / temps

        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = _apply_top_k_top_p(logits, top_ks, top_ps)

        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        generators = batch.generators or [None] * n
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == n:
            q.exponential_()
        else:
            if unseeded:
                idx = torch.tensor(unseeded, dtype=torch.int64).to(device, non_blocking=True)
                q.index_copy_(0, idx, torch.empty(len(unseeded), vocab, device=device).exponential_())
            for i, g in enumerate(generators):
                if g is not None:
                    q[i].exponential_(generator=g)
        # A zero draw would make 0/0 = nan for a filtered token; keep q strictly positive.
        sampled_ids = (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        return torch.where(greedy, greedy_ids, sampled_ids)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place on `(n, vocab)` float logits: repetition penalty over prompt + output ids, then
    frequency / presence penalties over output ids, for the rows whose params set them."""
    rows = [i for i, p in enumerate(batch.params) if p.uses_penalties]
    if not rows:
        return
    device = logits.device
    vocab = logits.shape[1]
    sel = [batch.params[i] for i in rows]
    prompts = batch.penalty_prompt_ids or [[]] * len(batch)
    outputs = batch.output_ids or [[]] * len(batch)
    out_counts = _token_counts([outputs[i] for i in rows], vocab, device)
    row_idx = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    sub = logits.index_select(0, row_idx)

    if any(p.repetition_penalty != 1.0 for p in sel):
        prompt_ids = _padded_ids([prompts[i] for i in rows], vocab, device)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (out_counts > 0)
        rep = _row_values([p.repetition_penalty for p in sel], device)
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)

    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in sel):
        freq = _row_values([p.frequency_penalty for p in sel], device)
        pres = _row_values([p.presence_penalty for p in sel], device)
        sub = sub - freq * out_counts - pres * (out_counts > 0).float()

    logits.index_copy_(0, row_idx, sub)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Hugging Face / vLLM semantics on one ascending sort: top-k keeps every token at least as large
    as the k-th largest (ties kept); top-p then drops the smallest tokens whose cumulative probability
    is at most `1 - top_p`, always keeping the most likely one. Filtered logits become -inf."""
    device = logits.device
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    k = torch.tensor(top_ks, dtype=torch.int64).to(device, non_blocking=True)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))

    p = _row_values(top_ps, device)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1.0 - p
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
