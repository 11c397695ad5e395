"""Item rows gathered on the device (`ItemTable` + the Triton item-gather kernel) against the old host
path (`EncoderCache.gather` + `assemble_inputs_embeds`'s masked scatter), bit for bit.

"torch" is the table's CPU path; "triton" runs the real kernel, interpreted on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU). Two levels:

- the table alone, on random batches of windows over items with and without `is_embed` masks;
- the engine: every step's `inputs_embeds` (recorded where the decoder reads it) equals what the
  old path builds for the same plan, through an item cut by chunk boundaries, two items in one
  request, items of several requests in one step, a preempted and resumed request, and a cache hit.
"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch
from helpers import IdentityEncoder, compile_for_sm90

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.multimodal.encoder_cache import (
    EncoderCache,
    MultiModalFeature,
    PlaceholderRange,
    RequestWindow,
    sort_features,
)
from runner.multimodal.item_table import ItemTable
from runner.sampling_params import SamplingParams
from runner.worker.inputs_embeds import assemble_inputs_embeds

pytestmark = [
    pytest.mark.filterwarnings("ignore:async scheduling turned off"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

# The kernel on CPU tensors needs the interpreter (on a GPU machine the `gpu` tests run it compiled).
PATHS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU triton path needs TRITON_INTERPRET=1"))]
HIDDEN = 64
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ----------------------------------------------------------------------------- the table alone
def _random_request(rng: random.Random, prompt_len: int, hidden: int) -> list[MultiModalFeature]:
    """Non-overlapping items (some with is_embed masks) at random places of a prompt."""
    features, pos = [], rng.randrange(0, 4)
    while pos < prompt_len - 2:
        length = rng.randrange(1, min(9, prompt_len - pos))
        mask = None
        if rng.random() < 0.4 and length > 1:
            mask = torch.tensor([rng.random() < 0.6 for _ in range(length)])
            mask[rng.randrange(length)] = True
        ph = PlaceholderRange(pos, length, mask)
        rows = torch.randn(ph.num_embeds, hidden)
        features.append(MultiModalFeature(f"prompt_embeds:{rng.random()}", "prompt_embeds", ph, rows))
        pos += length + rng.randrange(0, 5)
    return sort_features(features)


@pytest.mark.parametrize("path", PATHS)
def test_table_matches_the_host_gather_on_random_batches(path):
    rng = random.Random(7)
    torch.manual_seed(7)
    slots = 6
    cache = EncoderCache(10_000, HIDDEN, torch.float32, "cpu")
    table = ItemTable(slots, HIDDEN, torch.float32, "cpu", use_triton=(path == "triton"))
    embed = torch.nn.Embedding(50, HIDDEN)
    for trial in range(4):
        table.reset()
        reqs = {}
        for slot in rng.sample(range(slots), 4):
            feats = _random_request(rng, rng.randrange(6, 30), HIDDEN)
            cache.ensure(feats)
            for f in feats:
                table.register(slot, f.placeholder, cache.get(f.identifier))
            reqs[slot] = feats
        order = list(reqs)
        rng.shuffle(order)
        windows, computed = [], [0] * slots
        for slot in order:
            nc = rng.randrange(0, 28)
            windows.append(RequestWindow(reqs[slot], nc, rng.randrange(1, 12), prompt_len=10_000))
            computed[slot] = nc
        starts = [0]
        for w in windows:
            starts.append(starts[-1] + w.num_scheduled_tokens)
        ids = torch.randint(0, 50, (starts[-1],))
        ref = assemble_inputs_embeds(embed, ids, torch.zeros(starts[-1], HIDDEN))
        gathered = cache.gather(windows)
        if gathered.has_embeds:
            ref = assemble_inputs_embeds(embed, ids, ref, None, gathered.mm_embeds, gathered.is_mm_embed)
        out = assemble_inputs_embeds(embed, ids, torch.zeros(starts[-1], HIDDEN))
        table.apply(out, i32(order), i32(starts), i32(computed))
        assert torch.equal(out, ref), f"trial {trial}"


@pytest.mark.parametrize("path", PATHS)
def test_slot_release_reuse_and_growth(path):
    table = ItemTable(2, 8, torch.float32, "cpu", use_triton=(path == "triton"))
    a, b = torch.randn(3, 8), torch.randn(2, 8)
    table.register(1, PlaceholderRange(0, 3), a)
    table.release(1)
    table.register(1, PlaceholderRange(1, 2), b)  # a reused slot never serves its previous rows
    for i in range(5):  # more spans than the first capacity, in a slot past the first size
        table.register(3, PlaceholderRange(3 * i, 2), b)
    assert table.num_slots >= 4 and table.num_spans(3) == 5 and table.num_live_slots == 2
    out = torch.zeros(4 + 15, 8)
    table.apply(out, i32([1, 3]), i32([0, 4, 19]), i32([0, 0, 0, 0]))
    zero = torch.zeros(8)
    assert torch.equal(out[0], zero) and torch.equal(out[1:3], b) and torch.equal(out[3], zero)
    for i in range(5):
        assert torch.equal(out[4 + 3 * i : 6 + 3 * i], b) and torch.equal(out[6 + 3 * i], zero)
    with pytest.raises(ValueError, match="out of order"):
        table.register(3, PlaceholderRange(0, 2), b)
    table.reset()
    assert table.num_live_slots == 0


def test_strided_rows_are_copied_once_and_served():
    table = ItemTable(1, 8, torch.float32, "cpu", use_triton=True)
    base = torch.randn(8, 6)
    rows = base.t()[:5]  # (5, 8) with a column stride: not contiguous
    table.register(0, PlaceholderRange(0, 5), rows)
    out = torch.zeros(5, 8)
    table.apply(out, i32([0]), i32([0, 5]), i32([0]))
    assert torch.equal(out, rows)


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("mmgather") / "qwen3", "qwen3", seed=3)


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.5


def _engine(model_dir, path: str, device: str = "cpu", **kw) -> tuple[LLM, list[bool]]:
    """An LLM whose item table runs `path` ("default": the device's own), checking every launched step
    against the old host path. Returns the LLM and a list that gets one entry per step: whether the
    step had item rows."""
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("encoders", {"image": IdentityEncoder("image")})
    llm = LLM(model_dir, enable_prompt_embeds=True, device=device, dtype="float32", **kw)
    runner, mm = llm.runner, llm.mm
    if path != "default":
        use_triton = path == "triton"
        slots = llm.stats().num_total_slots
        mm.items = ItemTable(slots, HIDDEN, torch.float32, device, use_triton=use_triton)
    seen: list[torch.Tensor] = []
    steps: list[bool] = []
    forward, launch = runner.forward, runner.launch

    def spy_forward(embeds, *args, **kwargs):
        seen.append(embeds.clone())
        return forward(embeds, *args, **kwargs)

    def checked_launch(so, prev=None, **kwargs):
        seen.clear()
        step = launch(so, prev, **kwargs)
        windows = [RequestWindow(r.mm_features, r.num_computed_tokens, n, r.num_prompt_tokens)
                   for r, n in zip(so.requests, so.num_scheduled_tokens)]
        ids = torch.cat([torch.from_numpy(runner.token_table[r.slot, w.num_computed_tokens:
                                                             w.num_computed_tokens + w.num_scheduled_tokens])
                         for r, w in zip(so.requests, windows)]).to(device)
        got = seen[0][: ids.shape[0]]
        old = mm.cache.gather(windows, realtime=mm.realtime)
        ref = got.clone()  # rows that are neither tokens nor items keep whatever the buffer held
        assemble_inputs_embeds(runner.embed_tokens, ids, ref, None, old.mm_embeds, old.is_mm_embed)
        assert torch.equal(got, ref)
        steps.append(old.has_embeds)
        return step

    runner.forward, runner.launch = spy_forward, checked_launch
    return llm, steps


def _prompt(*items: torch.Tensor, image: torch.Tensor | None = None) -> dict:
    text = "red " + " blue ".join("<embeds>" for _ in items) + " green"
    data = {"prompt_embeds": list(items)}
    if image is not None:
        text += " <image> end"
        data["image"] = [image]
    return {"prompt": text, "multi_modal_data": data}


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _assert_clean(llm: LLM) -> None:
    assert llm.stats().all_free
    assert llm.mm.items.num_live_slots == 0
    assert llm.encoder_cache.num_evictable_tokens == llm.encoder_cache.num_cached_tokens


@pytest.mark.parametrize("path", PATHS)
def test_items_cut_by_chunks_two_per_request_and_several_requests_per_step(model_dir, path):
    llm, steps = _engine(model_dir, path, max_num_batched_tokens=16)
    prompts = [_prompt(_rows(11, 1), _rows(5, 2)), _prompt(_rows(3, 3), image=_rows(7, 4)),
               _prompt(_rows(9, 5))]
    tokens = _generate(llm, prompts)
    assert sum(steps) >= 3 and llm.scheduler.num_partial_prefills > 0
    assert llm.mm.num_gathers == sum(steps) and llm.mm.num_decode_gathers == 0
    assert llm.mm.items.num_launches == (sum(steps) if path == "triton" else 0)
    _assert_clean(llm)
    whole, _ = _engine(model_dir, "torch", max_num_batched_tokens=512)  # no chunking at all
    assert _generate(whole, prompts) == tokens


@pytest.mark.parametrize("path", PATHS)
def test_preempted_request_is_gathered_again_when_it_resumes(model_dir, path):
    llm, steps = _engine(model_dir, path, num_kv_blocks=16, block_size=4, max_num_batched_tokens=24)
    prompts = [_prompt(_rows(6, 10 + i), image=_rows(4, 20 + i)) for i in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.scheduler.num_preemptions > 0 and any(steps)
    _assert_clean(llm)
    roomy, _ = _engine(model_dir, "torch")
    assert [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)] == tokens


@pytest.mark.parametrize("path", PATHS)
def test_cache_hit_reuses_rows_without_upload_or_encode(model_dir, path):
    llm, steps = _engine(model_dir, path, max_num_batched_tokens=12)
    item, image = _rows(8, 30), _rows(5, 31)
    (first,) = _generate(llm, [_prompt(item, image=image)])
    cache, encoder = llm.encoder_cache, llm.mm.encoders["image"]
    uploads, calls = cache.num_uploads, list(encoder.calls)
    second = _generate(llm, [_prompt(item, image=image), _prompt(item)])  # hits, twice in one step
    assert cache.num_uploads == uploads and encoder.calls == calls
    assert second[0] == first and sum(steps) >= 2
    _assert_clean(llm)


@pytest.mark.parametrize("path", PATHS)
def test_realtime_rows_streamed_into_decode_steps(model_dir, path):
    llm, steps = _engine(model_dir, path, encoders={"audio": IdentityEncoder("audio", is_realtime=True)})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rid = llm.add_request({"prompt_token_ids": [5, 6, 7, 8]}, params)
    llm.step()
    llm.append_input(rid, _rows(3, 40))
    llm.append_input(rid, _rows(2, 41))  # queued right after the first chunk
    while llm.has_unfinished_requests():
        llm.step()
    assert sum(steps) == 5 and llm.mm.num_decode_gathers == 5  # one streamed row per decode step
    _assert_clean(llm)


# ----------------------------------------------------------------------------- compiled / on the GPU
_COMPILE_FOR_SM90 = r"""
import re
from runner.layers.item_gather_kernel import _item_gather_kernel as fn

types = dict(out_ptr="*bf16", idx_mapping_ptr="*i32", query_start_loc_ptr="*i32", num_computed_ptr="*i32",
             table_ptr="*i64")
consts = dict(HIDDEN=1024, LOG_SPANS=3, BLOCK_T=8, BLOCK_H=1024)
ptx = build_sm90(fn, types, consts, ("out_ptr", "out_row_stride", "table_ptr"), num_warps=4).asm["ptx"]
count = lambda op: len(re.findall(op + r"\.global[^\n]*\.v4", ptx))
print("v4 loads", count("ld"), "v4 stores", count("st"))
"""


def test_kernel_compiles_for_sm90_with_128_bit_row_copies():
    """Without a GPU: the kernel compiles for Hopper and its row loads and stores are 16 bytes wide
    (the int64 addresses read from the table carry the 16-byte alignment hint)."""
    stdout = compile_for_sm90(_COMPILE_FOR_SM90)
    loads, stores = map(int, re.findall(r"v4 loads (\d+) v4 stores (\d+)", stdout)[0])
    assert loads > 0 and stores > 0, stdout


@pytest.mark.gpu
def test_gpu_kernel_matches_torch_path_without_host_sync():
    device = torch.device("cuda", torch.cuda.current_device())
    rng = random.Random(3)
    for hidden, dtype in ((1024, torch.bfloat16), (1000, torch.float16), (24, torch.float32)):
        tables = [ItemTable(8, hidden, dtype, device, use_triton=flag) for flag in (True, False)]
        cache = EncoderCache(100_000, hidden, dtype, device)
        reqs = {}
        for slot in range(8):
            feats = _random_request(rng, rng.randrange(6, 60), hidden)
            cache.ensure(feats)
            for t in tables:
                for f in feats:
                    t.register(slot, f.placeholder, cache.get(f.identifier))
            reqs[slot] = feats
        order = rng.sample(range(8), 6)
        sched = [rng.randrange(1, 40) for _ in order]
        starts = [0] + [sum(sched[: i + 1]) for i in range(len(sched))]
        computed = [rng.randrange(0, 40) for _ in range(8)]
        args = [i32(v).to(device) for v in (order, starts, computed)]
        base = torch.randn(starts[-1] + 3, hidden, device=device).to(dtype)
        outs = [base.clone(), base.clone()]
        tables[1].apply(outs[1], *args)
        tables[0].apply(outs[0], *args)  # compiles
        outs[0].copy_(base)
        for t in tables:  # a released and re-registered slot: the checked launch uploads table rows too
            t.release(order[0])
            for f in reqs[order[0]]:
                t.register(order[0], f.placeholder, cache.get(f.identifier))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tables[0].apply(outs[0], *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], base), (hidden, dtype)


@pytest.mark.gpu
def test_gpu_engine_steps_match_the_host_gather(model_dir):
    llm, steps = _engine(model_dir, "default", "cuda", num_kv_blocks=16, block_size=4,
                         max_num_batched_tokens=24, enforce_eager=True)
    assert llm.mm.items.use_triton
    prompts = [_prompt(_rows(6, 50 + i), _rows(3, 60 + i), image=_rows(4, 70 + i)) for i in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.num_partial_prefills > 0
    assert llm.mm.items.num_launches == sum(steps) > 0
    _assert_clean(llm)
