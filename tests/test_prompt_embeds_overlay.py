"""PromptEmbedsState: the overlay contract of docs/ARCHITECTURE.md, checked on both runtime paths.

"torch" is the plain CPU path; "triton" runs the real kernel, interpreted on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU). Interpreted launches are slow,
so shapes stay small; a `gpu` test repeats the property test on CUDA (and under graph capture).
"""

from __future__ import annotations

import random

import pytest
import torch

from runner.worker.prompt_embeds import PromptEmbedsState

PATHS = ["torch", "triton"]


def make_state(path: str, max_num_reqs: int = 4, hidden: int = 24, dtype=torch.float32, device="cpu", **kw):
    return PromptEmbedsState(max_num_reqs, hidden, dtype, device, use_triton=(path == "triton"), **kw)


def i32(values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def batch(
    scheduled: list[int], slots: list[int], computed_by_slot: dict[int, int], max_num_reqs: int, device="cpu"
):
    """idx_mapping, query_start_loc and the slot-indexed num_computed_tokens for one step."""
    starts = [0]
    for q in scheduled:
        starts.append(starts[-1] + q)
    computed = [0] * max_num_reqs
    for slot, nc in computed_by_slot.items():
        computed[slot] = nc
    return i32(slots, device), i32(starts, device), i32(computed, device)


def reference_overlay(base, rows_by_slot, masks_by_slot, slots, starts, computed):
    """The contract written token by token, independent of the implementation."""
    out = base.clone()
    for b, slot in enumerate(slots):
        rows = rows_by_slot.get(slot)
        if rows is None:
            continue
        nc, n = computed[slot], rows.shape[0]
        for t in range(starts[b + 1] - starts[b]):
            pos = nc + t
            if pos >= n:
                break
            mask = masks_by_slot.get(slot)
            if mask is not None and bool(mask[pos]):
                continue
            out[starts[b] + t] = rows[pos].to(out.dtype)
    return out


@pytest.mark.parametrize("path", PATHS)
def test_chunked_prefill_and_decode_in_one_batch(path):
    torch.manual_seed(0)
    state = make_state(path)
    a, b = torch.randn(6, 24), torch.randn(5, 24)
    state.add_request(0, "a", a)
    state.add_request(1, "b", b)
    state.add_request(2, "c", None)
    idx, qsl, nc = batch([4, 1, 3], [0, 1, 2], {0: 2, 1: 7, 2: 1}, 4)
    base = torch.randn(8, 24)
    out = base.clone()
    state.apply(out, idx, qsl, nc)
    assert torch.equal(out[0:4], a[2:6])
    assert torch.equal(out[4:8], base[4:8])


@pytest.mark.parametrize("path", PATHS)
def test_clamp_at_end_of_embeds(path):
    torch.manual_seed(1)
    state = make_state(path)
    e = torch.randn(4, 24)
    state.add_request(3, "e", e)
    idx, qsl, nc = batch([3], [3], {3: 2}, 4)
    base = torch.randn(3, 24)
    out = base.clone()
    state.apply(out, idx, qsl, nc)
    assert torch.equal(out[0:2], e[2:4])
    assert torch.equal(out[2], base[2])


@pytest.mark.parametrize("path", PATHS)
def test_is_token_ids_positions_keep_the_base(path):
    torch.manual_seed(2)
    state = make_state(path)
    e = torch.randn(6, 24)
    is_tok = torch.tensor([True, False, True, True, False, False])
    state.add_request(1, "m", e, is_tok)
    idx, qsl, nc = batch([5], [1], {1: 1}, 4)
    base = torch.randn(5, 24)
    out = base.clone()
    state.apply(out, idx, qsl, nc)
    for t in range(5):
        expected = base[t] if is_tok[1 + t] else e[1 + t]
        assert torch.equal(out[t], expected), t


@pytest.mark.parametrize("path", PATHS)
def test_slot_reuse_remove_then_add(path):
    torch.manual_seed(3)
    state = make_state(path)
    a, d = torch.randn(4, 24), torch.randn(3, 24)
    state.add_request(0, "a", a)
    state.add_request(1, "d", d)
    assert state.remove_request("a")
    state.add_request(0, "b", None)
    idx, qsl, nc = batch([2, 2], [0, 1], {0: 0, 1: 0}, 4)
    base = torch.randn(4, 24)
    out = base.clone()
    state.apply(out, idx, qsl, nc)
    assert torch.equal(out[0:2], base[0:2])  # b has no embeds: a's rows must not come back
    assert torch.equal(out[2:4], d[0:2])  # the other live request is unaffected
    assert state.num_requests_with_embeds == 1


@pytest.mark.parametrize("path", PATHS)
def test_slot_reuse_add_then_remove_old_id(path):
    torch.manual_seed(4)
    state = make_state(path)
    a, b = torch.randn(4, 24), torch.randn(4, 24)
    state.add_request(0, "a", a)
    state.add_request(0, "b", b)  # b takes a's slot before a is removed
    assert not state.remove_request("a")  # by id: a is gone already, b must survive
    assert state.slot_of("b") == 0 and state.has_embeds("b")
    idx, qsl, nc = batch([3], [0], {0: 1}, 4)
    base = torch.randn(3, 24)
    out = base.clone()
    state.apply(out, idx, qsl, nc)
    assert torch.equal(out, b[1:4])


@pytest.mark.parametrize("path", PATHS)
def test_add_with_none_clears_previous_occupant(path):
    torch.manual_seed(5)
    state = make_state(path)
    state.add_request(2, "x", torch.randn(5, 24))
    state.add_request(2, "y", None)
    assert state.slot_of("x") is None and not state.has_embeds("y")
    assert state.num_requests_with_embeds == 0
    state.add_request(0, "z", torch.randn(5, 24))  # keep a live request so apply really runs
    idx, qsl, nc = batch([4], [2], {2: 0}, 4)
    base = torch.randn(4, 24)
    out = base.clone()
    state.apply(out, idx, qsl, nc)
    assert torch.equal(out, base)


@pytest.mark.parametrize("path", PATHS)
def test_request_moving_to_another_slot(path):
    torch.manual_seed(6)
    state = make_state(path)
    e = torch.randn(4, 24)
    state.add_request(0, "r", e)
    state.add_request(3, "r", e)
    assert state.slot_of("r") == 3 and state.num_requests_with_embeds == 1
    idx, qsl, nc = batch([2, 2], [0, 3], {3: 2}, 4)
    base = torch.randn(4, 24)
    out = base.clone()
    state.apply(out, idx, qsl, nc)
    assert torch.equal(out[0:2], base[0:2])
    assert torch.equal(out[2:4], e[2:4])


def test_no_live_embeds_launches_nothing():
    state = make_state("triton")
    calls = []
    state._launch = lambda *args: calls.append(args)
    state.add_request(0, "t", None)
    idx, qsl, nc = batch([2], [0], {}, 4)
    out = torch.zeros(2, 24)
    state.apply(out, idx, qsl, nc)
    assert calls == []
    state.add_request(1, "e", torch.randn(3, 24))
    state.apply(out, idx, qsl, nc)
    assert len(calls) == 1
    state.remove_request("e")
    state.apply(out, idx, qsl, nc)
    assert len(calls) == 1


def test_table_writes_wait_for_the_next_launch_and_go_up_together():
    """Adding and releasing requests writes nothing to the device tables; the next `apply` writes every
    noted entry first (one upload and one scatter per table), so its launch sees the current requests."""
    state = make_state("triton")
    launched = []
    state._launch = lambda *args: launched.append([t.clone() for t in args[4:7]])
    a, b = torch.randn(3, 24), torch.randn(2, 24)
    state.add_request(0, "a", a)
    state.add_request(2, "b", b, torch.tensor([True, False]))
    assert not state._rows_addr.any() and not state._num_rows.any()  # nothing written yet
    idx, qsl, nc = batch([2, 2], [0, 2], {}, 4)
    state.apply(torch.zeros(4, 24), idx, qsl, nc)
    rows_addr, num_rows, mask_addr = launched[-1]
    assert num_rows.tolist() == [3, 0, 2, 0]
    assert rows_addr[0] != 0 and rows_addr[2] != 0 and rows_addr[1] == rows_addr[3] == 0
    assert mask_addr[0] == 0 and mask_addr[2] != 0
    state.remove_request("a")
    state.add_request(2, "c", torch.randn(4, 24))  # "b" released by its slot's new occupant
    assert num_rows.tolist() == state._num_rows.tolist()  # still the previous launch's tables
    state.apply(torch.zeros(4, 24), idx, qsl, nc)
    assert launched[-1][1].tolist() == [0, 0, 4, 0] and launched[-1][2][2] == 0
    assert launched[-1][0][0] == 0


def test_rows_are_cast_once_to_the_state_dtype():
    state = make_state("torch", dtype=torch.bfloat16)
    e = torch.randn(3, 24, dtype=torch.float64)
    state.add_request(0, "c", e)
    idx, qsl, nc = batch([3], [0], {}, 4)
    out = torch.zeros(3, 24, dtype=torch.bfloat16)
    state.apply(out, idx, qsl, nc)
    assert torch.equal(out, e.to(torch.bfloat16))
    e.zero_()  # the state owns a copy: later changes to the caller's tensor do not leak in
    state.apply(out, idx, qsl, nc)
    assert not torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize(
    "embeds, mask, match",
    [
        (torch.randn(4, 23), None, "hidden size"),
        (torch.randn(4), None, "2-D"),
        (torch.randn(1, 4, 24), None, "2-D"),
        (torch.randn(0, 24), None, "no rows"),
        (torch.ones(4, 24, dtype=torch.int64), None, "floating point"),
        (torch.randn(4, 24), torch.tensor([True, False, True]), "shape"),
        (torch.randn(4, 24), torch.tensor([1, 0, 1, 0]), "bool"),
        (None, torch.tensor([True]), "without prompt_embeds"),
        ([[0.0] * 24], None, "torch.Tensor"),
    ],
)
def test_bad_input_raises_value_error(embeds, mask, match):
    state = make_state("torch")
    state.add_request(0, "keep", torch.randn(2, 24))
    with pytest.raises(ValueError, match=match):
        state.add_request(0, "bad", embeds, mask)
    assert state.has_embeds("keep") and state.slot_of("bad") is None  # nothing changed


def test_bad_slot_and_bad_apply_arguments_raise_value_error():
    with pytest.raises(ValueError):
        PromptEmbedsState(0, 24, torch.float32, "cpu")
    with pytest.raises(ValueError):
        PromptEmbedsState(4, 24, torch.int32, "cpu")
    state = make_state("torch")
    with pytest.raises(ValueError, match="req_index"):
        state.add_request(4, "x", torch.randn(2, 24))
    state.add_request(0, "x", torch.randn(2, 24))
    idx, qsl, nc = batch([2], [0], {}, 4)
    with pytest.raises(ValueError, match="inputs_embeds"):
        state.apply(torch.zeros(2, 25), idx, qsl, nc)
    with pytest.raises(ValueError, match="float32"):
        state.apply(torch.zeros(2, 24, dtype=torch.float16), idx, qsl, nc)
    with pytest.raises(ValueError, match="int32"):
        state.apply(torch.zeros(2, 24), idx.long(), qsl, nc)
    with pytest.raises(ValueError, match="num_reqs"):
        state.apply(torch.zeros(2, 24), idx, qsl[:1], nc)
    with pytest.raises(ValueError, match="indexed by slot"):
        state.apply(torch.zeros(2, 24), idx, qsl, nc[:2])


def run_random_trials(path: str, device: str, trials: int, seed: int, hiddens, dtypes, kernel_config=None):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    max_num_reqs = 8
    checked_rows = 0
    for trial in range(trials):
        dtype = dtypes[trial % len(dtypes)]
        hidden = hiddens[trial % len(hiddens)]
        state = make_state(path, max_num_reqs, hidden, dtype, device, kernel_config=kernel_config)
        rows_by_slot, masks_by_slot = {}, {}
        for slot in range(max_num_reqs):
            kind = rng.random()
            if kind < 0.2:
                continue  # empty slot
            if kind < 0.35:
                state.add_request(slot, f"t{trial}-{slot}", None)
                continue
            n = rng.randint(1, 12)
            rows = torch.randn(n, hidden, generator=gen)
            mask = torch.rand(n, generator=gen) < 0.3 if rng.random() < 0.4 else None
            state.add_request(slot, f"t{trial}-{slot}", rows, mask)
            rows_by_slot[slot] = rows.to(dtype)  # the state casts once at add time
            if mask is not None:
                masks_by_slot[slot] = mask
        # Churn: drop one request, sometimes put a token-only request in its place.
        if rows_by_slot and rng.random() < 0.5:
            victim = rng.choice(sorted(rows_by_slot))
            state.remove_request(f"t{trial}-{victim}")
            rows_by_slot.pop(victim)
            masks_by_slot.pop(victim, None)
            if rng.random() < 0.5:
                state.add_request(victim, f"t{trial}-{victim}-new", None)
        num_reqs = rng.randint(1, max_num_reqs)
        slots = rng.sample(range(max_num_reqs), num_reqs)
        scheduled = [rng.choice([0, 1, 1, 2, 3, 5, 7]) for _ in slots]
        computed = {s: rng.randint(0, 14) for s in range(max_num_reqs)}
        idx, qsl, nc = batch(scheduled, slots, computed, max_num_reqs, device)
        num_tokens = sum(scheduled) + rng.randint(0, 3)  # padding rows must stay untouched
        base = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
        expected = reference_overlay(base, rows_by_slot, masks_by_slot, slots, qsl.tolist(), nc.tolist())
        out = base.clone().to(device)
        state.apply(out, idx, qsl, nc)
        assert torch.equal(out.cpu(), expected), f"trial {trial}: {dtype}, hidden {hidden}"
        checked_rows += int((expected != base).any(dim=1).sum())
    assert checked_rows > 0  # the trials really overlaid something


@pytest.mark.parametrize("path", PATHS)
def test_randomized_against_reference(path):
    from runner.layers.overlay_kernel import OverlayConfig

    # Small tiles so that 40 and 100 are not multiples of BLOCK_H and blocks span several rows.
    config = OverlayConfig(block_t=4, block_h=32, num_warps=1) if path == "triton" else None
    trials = 40
    run_random_trials(
        path,
        "cpu",
        trials,
        seed=11,
        hiddens=[40, 100, 24],
        dtypes=[torch.float32, torch.bfloat16, torch.float16],
        kernel_config=config,
    )


def test_default_kernel_config_with_odd_hidden_size():
    run_random_trials(
        "triton", "cpu", 6, seed=12, hiddens=[72], dtypes=[torch.bfloat16, torch.float32, torch.float16]
    )


@pytest.mark.gpu
def test_randomized_against_reference_on_cuda():
    run_random_trials(
        "triton",
        "cuda",
        60,
        seed=13,
        hiddens=[4096, 1000, 2056, 1001, 24],
        dtypes=[torch.float32, torch.bfloat16, torch.float16],
    )


@pytest.mark.gpu
def test_cuda_graph_replay_serves_requests_added_after_capture():
    device = torch.device("cuda", torch.cuda.current_device())
    hidden, max_num_reqs = 256, 4
    state = PromptEmbedsState(max_num_reqs, hidden, torch.bfloat16, device)
    idx, qsl, nc = batch([3, 3], [0, 1], {0: 0, 1: 0}, max_num_reqs, device)
    out = torch.zeros(6, hidden, dtype=torch.bfloat16, device=device)
    graph = torch.cuda.CUDAGraph()
    state.add_request(0, "warm", torch.randn(2, hidden, device=device))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        state.apply(out, idx, qsl, nc)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(s)
    state.remove_request("warm")
    out.zero_()
    with pytest.raises(RuntimeError, match="sync_tables"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        state.apply(out, idx, qsl, nc)  # warm's zero entry is not on the device yet
    state.sync_tables()
    with torch.cuda.graph(graph):
        state.apply(out, idx, qsl, nc)  # no live embeds yet, but capture still records the launch
    e = torch.randn(5, hidden, device=device)
    state.add_request(1, "late", e)
    nc.copy_(i32([0, 2, 0, 0], device))
    out.zero_()
    state.sync_tables()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[3:6], e[2:5].to(torch.bfloat16))
    assert torch.equal(out[0:3], torch.zeros_like(out[0:3]))
    state.remove_request("late")
    out.zero_()
    state.sync_tables()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))
