"""Host-side work on passthrough items (issue 14): the batched hashing, finiteness check and placeholder
expansion give what the one-item-at-a-time code gave.

References here are the previous implementations, written out: the identifier recipe (sha256 of
"dtype|shape|" and the raw bytes), the `(abs(t) <= limit).all()` check, and the per-token expansion.
Checked: same identifiers for the same content whatever the object, different ones for different
content, dtype or shape; one hash per tensor object of a call; every dtype verdict of the old check;
a NaN item refused with the message naming its prompt and item, and refused first when an earlier
check would have met it first; expansion equal token for token; outputs of a generate unchanged
between one call of many prompts and one call per prompt.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.multimodal import encoder_protocol
from runner.multimodal.encoder_cache import feature_identifier
from runner.multimodal.encoder_protocol import (
    PROMPT_EMBEDS_MODALITY,
    tensor_content_hash,
    tensor_content_hashes,
)
from runner.multimodal.placeholders import (
    PassthroughBatch,
    expand_mm_prompt,
    fits_dtype,
    tensors_fit_dtype,
)
from runner.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.filterwarnings("ignore:async scheduling turned off"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

HIDDEN = 64
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def reference_hash(tensor: torch.Tensor) -> str:
    """The identifier recipe before issue 14, verbatim: sha256 over dtype, shape and raw bytes."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.sha256()
    digest.update(f"{flat.dtype}|{tuple(tensor.shape)}|".encode())
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def reference_fits(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """The finiteness check before issue 14, verbatim."""
    limit = torch.finfo(tensor.dtype).max
    if dtype is not None and dtype.is_floating_point:
        limit = min(limit, torch.finfo(dtype).max)
    return bool((tensor.abs() <= limit).all())


def _rows(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.5).to(dtype)


def _mm(text: str, *items: torch.Tensor) -> dict:
    return {"prompt": text, "multi_modal_data": {"prompt_embeds": list(items)}}


# ----------------------------------------------------------------------------- identifiers
def test_batched_hashes_equal_the_identifier_recipe():
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    tensors = [
        base,
        base.clone(),  # same content, another object
        base,  # the same object again
        base.to(torch.bfloat16),
        base.to(torch.bfloat16).view(torch.float16),  # same bytes, another dtype
        base.reshape(8, 6),  # same bytes, another shape
        base.t(),  # not contiguous
        base[:, ::2],  # a strided view
        torch.zeros(0, 8),
        torch.tensor(3.5),
        torch.arange(10, dtype=torch.int64),
    ]
    want = [reference_hash(t) for t in tensors]
    assert tensor_content_hashes(tensors) == want
    assert [tensor_content_hash(t) for t in tensors] == want
    assert want[0] == want[1] == want[2]
    assert len({want[0], *want[3:8]}) == 6  # dtype, bytes, shape and layout all tell tensors apart
    assert want[3] != want[4] and want[0] != want[5]


def test_pool_path_equals_the_inline_path(monkeypatch):
    tensors = [torch.randn(300, 512, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
               for s in range(6)]
    want = [reference_hash(t) for t in tensors]
    monkeypatch.setattr(encoder_protocol, "_PARALLEL_MIN_BYTES", 0)
    assert tensor_content_hashes(tensors + tensors[:2]) == want + want[:2]
    monkeypatch.setattr(encoder_protocol, "_PARALLEL_MIN_BYTES", 1 << 40)
    assert tensor_content_hashes(tensors) == want


@pytest.mark.gpu
def test_cuda_tensors_hash_and_check_as_on_the_host(monkeypatch):
    """CUDA items: staged through pinned memory in bounded groups, one wait per group; a tensor
    larger than the bound goes alone. Digests and verdicts equal the host tensors'."""
    g = torch.Generator().manual_seed(3)
    host = [torch.randn(n, 256, generator=g).to(dtype) for n, dtype in
            [(5, torch.float32), (300, torch.bfloat16), (1, torch.float16), (2000, torch.float32)]]
    host[2][0, 0] = torch.nan
    cuda = [t.cuda() for t in host]
    mixed = [cuda[0], host[1], cuda[3], cuda[1], cuda[0], host[2], cuda[2], cuda[3][:, ::2]]
    want = [reference_hash(t.cpu()) for t in mixed]
    monkeypatch.setattr(encoder_protocol, "_PARALLEL_MIN_BYTES", 0)
    for staging in (64 << 20, 1 << 12, 200_000):  # all in one group; each alone; a few per group
        monkeypatch.setattr(encoder_protocol, "_STAGING_BYTES", staging)
        assert tensor_content_hashes(mixed) == want
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert tensors_fit_dtype(mixed, dtype) == [reference_fits(t.cpu(), dtype) for t in mixed]


def test_hash_refuses_what_it_refused():
    with pytest.raises(ValueError, match="expects a torch.Tensor"):
        tensor_content_hashes([torch.zeros(2), [1, 2]])
    with pytest.raises(ValueError, match="dense tensor"):
        tensor_content_hash(torch.zeros(2, 2).to_sparse())


def test_one_hash_per_tensor_object_in_a_call(model_dir, monkeypatch):
    llm = _llm(model_dir)
    shared, other = _rows(5, 1), _rows(5, 2)
    prompts = [_mm("red <embeds> blue", shared) for _ in range(6)] + [_mm("<embeds> <embeds>", other, shared)]
    calls = []
    real = encoder_protocol._digests
    monkeypatch.setattr(encoder_protocol, "_digests", lambda jobs: calls.extend(jobs) or real(jobs))
    requests = llm.processor.process(prompts, [GREEDY] * len(prompts), [str(i) for i in range(len(prompts))])
    assert len(calls) == 2
    ids = [f.identifier for r in requests for f in r.mm_features]
    assert ids == [feature_identifier(PROMPT_EMBEDS_MODALITY, shared)] * 6 + [
        feature_identifier(PROMPT_EMBEDS_MODALITY, other), feature_identifier(PROMPT_EMBEDS_MODALITY, shared)]
    assert ids[0] == f"prompt_embeds:{reference_hash(shared)}"


# ----------------------------------------------------------------------------- finiteness
def test_batched_check_gives_the_old_verdicts():
    nan = torch.zeros(3, 4)
    nan[1, 2] = torch.nan
    inf, neg_inf = torch.zeros(3, 4), torch.zeros(3, 4)
    inf[0, 0], neg_inf[2, 3] = torch.inf, -torch.inf
    cases = [torch.zeros(3, 4), nan, inf, neg_inf, torch.zeros(0, 4),
             torch.full((2, 2), 1e39, dtype=torch.float64),  # finite in float64, Inf in bf16/fp32
             torch.full((2, 2), -1e39, dtype=torch.float64),
             torch.full((2, 2), 7e4),  # beyond float16
             torch.full((2, 2), 6e4, dtype=torch.bfloat16), nan.to(torch.bfloat16), nan.double(),
             torch.full((2, 2), 65504.0, dtype=torch.float16)]
    for dtype in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
        want = [reference_fits(t, dtype) for t in cases]
        assert tensors_fit_dtype(cases, dtype) == want, dtype
        assert [bool(fits_dtype(t, dtype)) for t in cases] == want, dtype
    assert want.count(False) == 5  # float64 model: only the NaN and Inf tensors fail


@pytest.mark.parametrize("bad", ["nan", "inf", "big"])
def test_bad_item_is_refused_naming_prompt_and_item(model_dir, bad):
    llm = _llm(model_dir)
    item = _rows(3, 5, torch.float64)
    item[1, 1] = {"nan": torch.nan, "inf": -torch.inf, "big": 1e39}[bad]
    prompts = ["fine", _mm("<embeds> a <embeds>", _rows(2, 1), item)]
    message = (r"^prompt 1: prompt_embeds item 1: a prompt_embeds item contains NaN or Inf \(or values "
               r"beyond the range of the model dtype torch.float32\)$")
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats().num_steps == 0 and not llm.has_unfinished_requests()
    assert len(llm.encoder_cache) == 0


def test_first_bad_item_wins_as_when_checked_one_by_one(model_dir):
    llm = _llm(model_dir)
    nan = torch.full((2, HIDDEN), torch.nan)

    def mm(*items, text=None):
        return _mm(text or " ".join(["<embeds>"] * len(items)), *items)

    def error(prompts):
        with pytest.raises(ValueError) as err:
            llm.processor.process(prompts, [GREEDY] * len(prompts), [str(i) for i in range(len(prompts))])
        return str(err.value)

    wrong_shape = torch.zeros(2, HIDDEN + 1)
    # a NaN item before a later prompt's structural error: the NaN (it was checked as met)
    nan_1 = "prompt 1: prompt_embeds item 0: a prompt_embeds item contains NaN"
    assert error(["a", mm(nan), mm(wrong_shape)]).startswith(nan_1)
    assert error(["a", mm(nan), {"prompt": 5}]).startswith(nan_1)
    # ... and within one prompt, before a later item's error and before the prompt-length check
    assert error([mm(nan, wrong_shape)]).startswith("prompt 0: prompt_embeds item 0: a prompt_embeds item")
    assert error([mm(nan, text="<embeds>" + " red" * 300)]).startswith("prompt 0: prompt_embeds item 0: a")
    # a structural error before the NaN item: the structural error
    assert error([mm(wrong_shape), mm(nan)]).startswith("prompt 0: prompt_embeds item 0: a prompt_embeds "
                                                        "item must be (n >= 1")
    # two NaN items: the first; a NaN item beside a NaN whole-prompt tensor earlier: the item, as before
    assert error([mm(_rows(2, 0)), mm(nan), mm(nan)]).startswith("prompt 1: ")
    assert error([{"prompt_embeds": nan}, mm(nan)]).startswith("prompt 1: prompt_embeds item 0")
    assert error([{"prompt_embeds": nan}, mm(_rows(2, 0))]).startswith("prompt 0: prompt_embeds contains NaN")


def test_cached_content_is_not_read_again(model_dir, monkeypatch):
    from runner.multimodal import placeholders

    llm = _llm(model_dir)
    item = _rows(4, 3)
    llm.generate(_mm("red <embeds>", item), GREEDY, use_tqdm=False)
    checked = []
    real = placeholders.tensors_fit_dtype
    monkeypatch.setattr(placeholders, "tensors_fit_dtype",
                        lambda ts, d: checked.append(len(ts)) or real(ts, d))
    fresh = _rows(4, 4)
    llm.processor.process([_mm("<embeds> b <embeds>", item.clone(), fresh)], [GREEDY], ["x"])
    assert checked == [1]  # only the new content

    batch = PassthroughBatch()  # without `known`, every distinct object is read
    expand_mm_prompt([7, 1, 7, 7], {"prompt_embeds": [item, fresh, item]}, {"prompt_embeds": 7}, {}, HIDDEN,
                     passthrough=batch)
    checked.clear()
    batch.finish(torch.float32)
    assert checked == [2]


# ----------------------------------------------------------------------------- expansion
def reference_expand(token_ids, mm_data, placeholder_ids, positions=None):
    """The per-token expansion before issue 14 (passthrough items only): ids, mask, spans, identifiers."""
    modality_of_id = {pid: m for m, pid in placeholder_ids.items() if m in mm_data}
    if positions is None:
        modality_at = [modality_of_id.get(t) for t in token_ids]
    else:
        modality_at = [None] * len(token_ids)
        for pos, m in positions:
            modality_at[pos] = m
    out, mask, spans, used = [], [], [], {m: 0 for m in mm_data}
    for t, m in zip(token_ids, modality_at):
        if m is None:
            out.append(int(t))
            mask.append(True)
            continue
        item = mm_data[m][used[m]]
        used[m] += 1
        n = item.shape[0]
        spans.append((len(out), n, f"{m}:{reference_hash(item)}"))
        out.extend([int(t)] * n)
        mask.extend([False] * n)
    return out, torch.tensor(mask, dtype=torch.bool), spans


@pytest.mark.parametrize("seed", range(6))
def test_expansion_equals_the_per_token_expansion(seed):
    g = torch.Generator().manual_seed(seed)
    pid = 9
    n_text = int(torch.randint(0, 30, (1,), generator=g))
    n_items = int(torch.randint(0, 5, (1,), generator=g))
    ids = torch.randint(10, 50, (n_text,), generator=g).tolist()
    for _ in range(n_items):  # at the start, the end, side by side
        ids.insert(int(torch.randint(0, len(ids) + 1, (1,), generator=g)), pid)
    items = [_rows(int(torch.randint(1, 6, (1,), generator=g)), seed * 10 + k) for k in range(n_items)]
    if n_items > 1:
        items[-1] = items[0]  # one object twice
    mm_data = {"prompt_embeds": items}
    want_ids, want_mask, want_spans = reference_expand(ids, mm_data, {"prompt_embeds": pid})
    for positions in (None, [(p, "prompt_embeds") for p, t in enumerate(ids) if t == pid]):
        got = expand_mm_prompt(ids, mm_data, {"prompt_embeds": pid}, {}, HIDDEN,
                               placeholder_positions=positions)
        assert got.token_ids == want_ids
        assert got.is_token_ids.dtype == torch.bool and torch.equal(got.is_token_ids, want_mask)
        spans = [(f.placeholder.offset, f.placeholder.length, f.identifier) for f in got.features]
        assert spans == want_spans
        mrope = [(m.offset, m.length, m.grid_thw) for m in got.mrope_items]
        assert mrope == [(o, n, None) for o, n, _ in want_spans]


def test_token_id_checks_keep_their_answers(model_dir):
    import enum

    class Tok(enum.IntEnum):
        A = 11

    llm = _llm(model_dir)
    vocab = llm.runner.vocab_size
    ok = llm.processor.process([{"prompt_token_ids": [Tok.A, 12, 13]}], [GREEDY], ["a"])
    assert ok[0].prompt_token_ids == [11, 12, 13]
    for ids, match in [([1, True], "must be a list of ints"), ([1, 2.0], "must be a list of ints"),
                       ([1, vocab, -1, 2], rf"token ids \[{vocab}, -1\] are outside")]:
        with pytest.raises(ValueError, match=match):
            llm.processor.process([{"prompt_token_ids": ids}], [GREEDY], ["a"])
    emb_id = llm.get_tokenizer().convert_tokens_to_ids("<embeds>")
    with pytest.raises(ValueError, match=rf"token ids \[{vocab}\] are outside"):
        llm.processor.process([{"prompt_token_ids": [emb_id, vocab],
                                "multi_modal_data": {"prompt_embeds": [_rows(2, 0)]}}], [GREEDY], ["a"])


# ----------------------------------------------------------------------------- outputs
def test_outputs_same_for_one_call_and_one_call_per_prompt(model_dir):
    """A batch's items hashed and checked together serve the same rows as items taken one call
    at a time (a fresh engine each, so no cache hit hides a wrong identifier)."""
    shared = _rows(5, 20)
    prompts = [
        _mm("red <embeds> blue", shared),
        _mm("<embeds> green <embeds>", _rows(3, 21), shared),
        _mm("yellow <embeds>", _rows(4, 22).to(torch.bfloat16)),
        _mm("yellow <embeds>", _rows(4, 22)),
        "plain text",
    ]
    together = [o.outputs[0].token_ids for o in _llm(model_dir).generate(prompts, GREEDY, use_tqdm=False)]
    alone = [_llm(model_dir).generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("passthrough") / "qwen3", "qwen3", seed=3)


def _llm(model_dir) -> LLM:
    return LLM(model_dir, enable_prompt_embeds=True, device="cpu", num_kv_blocks=128, max_model_len=256)
