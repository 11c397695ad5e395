"""Sampler: greedy equals argmax, filters collapse to greedy, seeds are batch-independent, temperature
draws the right distribution, penalties match a hand computation and never touch placeholder ids."""

from __future__ import annotations

import math

import pytest
import torch

from runner.layers.sampler import Sampler, SamplingBatch, apply_penalties
from runner.sampling_params import SamplingParams

VOCAB = 50


def _logits(n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_fast_path_and_processed_path():
    logits = _logits(7)
    greedy = [SamplingParams(temperature=0.0) for _ in range(7)]
    out = Sampler()(logits, SamplingBatch(greedy))
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None
    # Same answer on the slow path (logprobs requested forces it).
    with_lp = [SamplingParams(temperature=0.0, logprobs=0) for _ in range(7)]
    out = Sampler()(logits, SamplingBatch(with_lp))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    logits = _logits(6, seed=1)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    torch.manual_seed(0)
    out = Sampler()(logits, SamplingBatch(params))
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _logits(16, seed=2)
    expected = logits.argmax(-1)
    for params in (
        [SamplingParams(temperature=1.0, top_k=1) for _ in range(16)],
        [SamplingParams(temperature=1.0, top_p=1e-6) for _ in range(16)],
        [SamplingParams(temperature=5.0, top_k=3, top_p=1e-6) for _ in range(16)],
    ):
        gens = [_gen(100 + i) for i in range(16)]
        out = Sampler()(logits, SamplingBatch(params, generators=gens))
        assert torch.equal(out.token_ids, expected)


def test_top_k_never_samples_outside_the_k_largest():
    logits = _logits(1, seed=3).expand(4000, VOCAB).contiguous()
    params = [SamplingParams(temperature=2.0, top_k=5) for _ in range(4000)]
    torch.manual_seed(1)
    out = Sampler()(logits, SamplingBatch(params))
    allowed = set(logits[0].topk(5).indices.tolist())
    drawn = set(out.token_ids.tolist())
    assert drawn <= allowed
    assert len(drawn) > 1  # it did sample, not collapse to greedy


def test_top_p_keeps_the_smallest_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1}; 0.85 keeps {0, 1, 2} (HF/vLLM semantics).
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(3000, 4).contiguous()
    for top_p, allowed in ((0.7, {0, 1}), (0.85, {0, 1, 2})):
        torch.manual_seed(2)
        out = Sampler()(logits, SamplingBatch([SamplingParams(top_p=top_p) for _ in range(3000)]))
        assert set(out.token_ids.tolist()) == allowed


def test_seeded_rows_are_independent_of_batch_order_and_composition():
    logits = _logits(5, seed=4)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13, 14, 15)]
    first = Sampler()(logits, SamplingBatch(params, generators=[_gen(p.seed) for p in params]))
    perm = [3, 0, 4, 1, 2]
    permuted = Sampler()(
        logits[perm],
        SamplingBatch([params[i] for i in perm], generators=[_gen(params[i].seed) for i in perm]),
    )
    assert torch.equal(permuted.token_ids, first.token_ids[perm])
    # Row 2 alone, and next to unseeded rows and greedy rows: still the same token.
    alone = Sampler()(logits[2:3], SamplingBatch([params[2]], generators=[_gen(13)]))
    assert alone.token_ids.item() == first.token_ids[2].item()
    mixed_logits = torch.cat([_logits(3, seed=9), logits[2:3]])
    mixed = Sampler()(
        mixed_logits,
        SamplingBatch(
            [
                SamplingParams(temperature=0.7),
                SamplingParams(temperature=0.0),
                SamplingParams(top_k=4),
                params[2],
            ],
            generators=[None, None, None, _gen(13)],
        ),
    )
    assert mixed.token_ids[3].item() == first.token_ids[2].item()


def test_seeded_generator_advances_across_steps_deterministically():
    logits = _logits(1, seed=5) * 0.1  # flat enough that draws differ
    params = [SamplingParams(temperature=1.0, seed=7)]

    def run_steps() -> list[int]:
        g = _gen(7)
        return [Sampler()(logits, SamplingBatch(params, generators=[g])).token_ids.item() for _ in range(20)]

    a, b = run_steps(), run_steps()
    assert a == b
    assert len(set(a)) > 1


def test_temperature_draws_softmax_of_scaled_logits():
    torch.manual_seed(3)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.softmax(base / temperature, dim=-1)
        params = [SamplingParams(temperature=temperature) for _ in range(n)]
        out = Sampler()(base.expand(n, 6).contiguous(), SamplingBatch(params))
        counts = torch.bincount(out.token_ids, minlength=6).float()
        exp_counts = expected * n
        mask = exp_counts >= 5
        chi2 = (((counts - exp_counts) ** 2) / exp_counts)[mask].sum().item()
        dof = int(mask.sum().item()) - 1
        # p ~ 1e-6 threshold for <= 5 degrees of freedom; with a fixed seed the value is deterministic.
        assert chi2 < 40.0, (temperature, chi2, dof, counts, exp_counts)


def test_logprobs_are_raw_log_softmax_of_sampled_tokens():
    logits = _logits(4, seed=6)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=5, logprobs=0, repetition_penalty=1.3),
        SamplingParams(temperature=1.2, logprobs=1, seed=3),
        SamplingParams(temperature=0.0),
    ]
    batch = SamplingBatch(
        params,
        generators=[None, None, _gen(3), None],
        penalty_prompt_ids=[[], [1, 2, 3], [], []],
        output_ids=[[], [4], [], []],
    )
    torch.manual_seed(4)
    out = Sampler()(logits, batch)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.topk_ids.shape == (4, 3)
    assert torch.equal(out.topk_ids, raw.topk(3, dim=-1).indices)
    assert torch.allclose(out.topk_logprobs, raw.topk(3, dim=-1).values)


def _reference_penalties(logits, prompt, output, rep, pres, freq):
    """Straight from the definitions, one token at a time."""
    ref = logits.clone()
    seen = set(prompt) | set(output)
    for t in seen:
        ref[t] = ref[t] / rep if ref[t] > 0 else ref[t] * rep
    for t in set(output):
        c = output.count(t)
        ref[t] -= freq * c + pres
    return ref


def test_penalties_match_a_hand_computed_reference():
    logits = torch.tensor([[3.0, -2.0, 1.0, 0.5, -0.5, 4.0, 2.5, -1.0]])
    prompt, output = [0, 1, 3, 5], [2, 2, 4, 1]
    rep, pres, freq = 2.0, 0.5, 0.25
    ref = _reference_penalties(logits[0], prompt, output, rep, pres, freq)
    # By hand: token 0 (prompt, +) 3/2; token 1 (prompt + output once, -) -2*2 - 0.25 - 0.5;
    # token 2 (output twice, +) 1/2 - 2*0.25 - 0.5; token 5 (prompt, +) 4/2; token 6 untouched.
    assert ref.tolist() == [1.5, -4.75, -0.5, 0.25, -1.75, 2.0, 2.5, -1.0]
    params = SamplingParams(
        temperature=0.0, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq
    )
    out = Sampler()(logits, SamplingBatch([params], penalty_prompt_ids=[prompt], output_ids=[output]))
    assert out.token_ids.item() == 6  # token 5 would win without the penalty


def test_penalized_logits_equal_reference_for_every_token():
    # Compare the processed logits themselves (the same function the sampler calls), token by token.
    logits = _logits(3, seed=7)
    prompts = [[0, 1, 2, 3], [5], []]
    outputs = [[4, 4, 9], [], [1, 1, 1, 7]]
    cfg = [(1.5, 0.0, 0.0), (0.7, 0.3, 0.0), (1.2, -0.4, 0.6)]
    params = [
        SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f) for r, p, f in cfg
    ]
    processed = logits.clone()
    apply_penalties(processed, SamplingBatch(params, penalty_prompt_ids=prompts, output_ids=outputs))
    for i, (r, p, f) in enumerate(cfg):
        ref = _reference_penalties(logits[i], prompts[i], outputs[i], r, p, f)
        assert torch.allclose(processed[i], ref, atol=1e-6), i


def test_placeholder_ids_are_not_penalized_in_a_mixed_length_batch():
    """Embeds prompts use placeholder id 0 (and the engine may pad with -1). The engine passes only the
    real-token ids; the sampler additionally ignores ids outside the vocabulary. Token 0 must not be
    penalized for a prompt whose only '0's are placeholders."""
    vocab = 12
    logits = torch.full((3, vocab), -1.0)
    logits[:, 0] = 2.0  # token 0 is the favourite...
    logits[:, 5] = 1.9  # ...just ahead of token 5
    # Row 0: embeds prompt [<emb>, <emb>, 7, <emb>] -> placeholder id 0 at masked positions.
    prompt_ids = [[0, 0, 7, 0], [0, 0, 0, 0, 0, 0, 0, 0, 3], [4, 0, 6]]
    is_token = [
        [False, False, True, False],
        [False] * 8 + [True],
        [True, True, True],  # row 2 is a token prompt in which id 0 is a real token
    ]
    real_ids = [[t for t, keep in zip(ids, mask) if keep] for ids, mask in zip(prompt_ids, is_token)]
    real_ids[1] = real_ids[1] + [-1, vocab + 3]  # stray invalid ids are ignored, never indexed
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0) for _ in range(3)]
    out = Sampler()(logits, SamplingBatch(params, penalty_prompt_ids=real_ids, output_ids=[[], [], []]))
    assert out.token_ids.tolist() == [0, 0, 5]  # rows 0 and 1 keep token 0; row 2 penalizes its real 0

    # Had the placeholders been counted, token 0 would have lost to token 5 in rows 0 and 1 too.
    naive = Sampler()(logits, SamplingBatch(params, penalty_prompt_ids=prompt_ids, output_ids=[[], [], []]))
    assert naive.token_ids.tolist() == [5, 5, 5]


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(2, 6)
    logits[:, 2] = 5.0  # EOS is the favourite
    logits[:, 4] = 4.0  # then a stop id
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),
    ]
    out = Sampler()(logits, SamplingBatch(params, output_ids=[[1], [1, 1, 1]], eos_token_ids=(2,)))
    assert out.token_ids[0].item() not in (2, 4)
    assert out.token_ids[1].item() == 2  # min_tokens reached: EOS allowed again


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(_logits(2), SamplingBatch([SamplingParams()]))
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch([SamplingParams()], generators=[None, None])
    with pytest.raises(ValueError, match="vocab"):
        Sampler()(torch.zeros(VOCAB), SamplingBatch([SamplingParams()]))


def test_caller_logits_are_not_modified():
    logits = _logits(3, seed=10)
    before = logits.clone()
    params = [SamplingParams(temperature=0.9, repetition_penalty=1.5, min_tokens=2, top_p=0.5)] * 3
    batch = SamplingBatch(params, penalty_prompt_ids=[[1]] * 3, output_ids=[[2]] * 3, eos_token_ids=[3])
    Sampler()(logits, batch)
    assert torch.equal(logits, before)


def test_empty_batch():
    out = Sampler()(torch.zeros(0, VOCAB), SamplingBatch([]))
    assert out.token_ids.shape == (0,)


def test_extreme_temperature_is_finite():
    logits = _logits(2, seed=8)
    params = [SamplingParams(temperature=1e-4), SamplingParams(temperature=100.0)]
    out = Sampler()(logits, SamplingBatch(params))
    assert out.token_ids[0].item() == logits[0].argmax().item()
    assert 0 <= out.token_ids[1].item() < VOCAB
    assert not math.isnan(float(out.token_ids.float().sum()))


@pytest.mark.gpu
def test_on_cuda_seeds_greedy_and_penalties_agree_with_cpu():
    """The lead runs this on the GPU box: `python3 -m pytest -q tests/test_sampler.py -m gpu`."""
    device = torch.device("cuda")
    logits = _logits(6, seed=11, vocab=1000).to(device)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=s) for s in range(6)]

    def gens(order):
        return [torch.Generator(device=device).manual_seed(params[i].seed) for i in order]

    first = Sampler()(logits, SamplingBatch(params, generators=gens(range(6))))
    perm = [5, 2, 0, 4, 1, 3]
    permuted = Sampler()(logits[perm], SamplingBatch([params[i] for i in perm], generators=gens(perm)))
    assert torch.equal(permuted.token_ids, first.token_ids[perm])
    greedy = Sampler()(logits, SamplingBatch([SamplingParams(temperature=0.0)] * 6))
    assert torch.equal(greedy.token_ids, logits.argmax(-1))
    pen = [SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.5)] * 6
    batch = SamplingBatch(pen, penalty_prompt_ids=[[1, 2, -1, 5000]] * 6, output_ids=[[3, 3, 7]] * 6)
    on_gpu = logits.clone()
    on_cpu = logits.cpu()
    apply_penalties(on_gpu, batch)
    apply_penalties(on_cpu, batch)
    assert torch.allclose(on_gpu.cpu(), on_cpu)
