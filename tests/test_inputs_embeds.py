"""inputs_embeds assembly: token rows, media rows, user prompt-embeds rows kept bit-exact."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

from runner.worker.inputs_embeds import InputsEmbedsBuilder, assemble_inputs_embeds

VOCAB, HIDDEN = 32, 24


class RangeCheckedEmbedding(nn.Embedding):
    """nn.Embedding that records every id it is asked for (and fails on an out-of-range one)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[int] = []

    def forward(self, ids):
        self.seen.extend(ids.tolist())
        assert int(ids.min()) >= 0 and int(ids.max()) < self.num_embeddings, "placeholder id reached lookup"
        return super().forward(ids)


def _overlay_reference(out, requests, idx_mapping, query_start_loc, num_computed_tokens):
    """The PromptEmbedsState.apply contract of docs/ARCHITECTURE.md, written plainly (local stand-in)."""
    for b, slot in enumerate(idx_mapping.tolist()):
        if slot not in requests:
            continue
        embeds, is_token_ids = requests[slot]
        nc, n = int(num_computed_tokens[slot]), embeds.shape[0]
        qs, qe = int(query_start_loc[b]), int(query_start_loc[b + 1])
        for t in range(min(qe - qs, max(n - nc, 0))):
            if is_token_ids is None or not is_token_ids[nc + t]:
                out[qs + t] = embeds[nc + t].to(out.dtype)


def _overlays():
    """The plain reference, plus the real overlay (torch and Triton paths) once it is importable."""
    impls = [("reference", None)]
    try:
        from runner.worker.prompt_embeds import PromptEmbedsState
    except ImportError:
        return impls
    impls.append(("overlay-torch", functools.partial(PromptEmbedsState, use_triton=False)))
    if os.environ.get("TRITON_INTERPRET") == "1":  # these tensors are on the CPU
        impls.append(("overlay-triton", functools.partial(PromptEmbedsState, use_triton=True)))
    return impls


def _apply_overlay(kind, cls, out, requests, idx_mapping, qsl, nct):
    if cls is None:
        _overlay_reference(out, requests, idx_mapping, qsl, nct)
        return
    max_num_reqs = 8
    state = cls(max_num_reqs, out.shape[1], out.dtype, out.device)
    for slot, (embeds, is_token_ids) in requests.items():
        state.add_request(slot, f"req{slot}", embeds, is_token_ids)
    nct_by_slot = torch.zeros(max_num_reqs, dtype=torch.int32)
    nct_by_slot[: nct.shape[0]] = nct
    state.apply(out, idx_mapping.to(torch.int32), qsl.to(torch.int32), nct_by_slot)


def _mixed_batch(dtype):
    """Three requests in one step:
    r0 (slot 0): text + an image placeholder (ids -5 and VOCAB+3 at the media positions);
    r1 (slot 2): whole-prompt user embeds, positions 1 and 4 are real token ids;
    r2 (slot 1): plain text, decoding (one token).
    """
    gen = torch.Generator().manual_seed(0)
    ids_r0 = torch.tensor([3, 4, -5, VOCAB + 3, -5, 7, 8])
    media_r0 = torch.tensor([0, 0, 1, 1, 1, 0, 0], dtype=torch.bool)
    user = torch.randn(6, HIDDEN, generator=gen).to(dtype)
    user_is_token = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool)
    ids_r1 = torch.where(user_is_token, torch.tensor([0, 9, 0, 0, 11, 0]), torch.full((6,), -1))
    ids_r2 = torch.tensor([VOCAB - 1])
    input_ids = torch.cat([ids_r0, ids_r1, ids_r2])
    is_token_ids = torch.cat([~media_r0, user_is_token, torch.ones(1, dtype=torch.bool)])
    is_mm_embed = torch.cat([media_r0, torch.zeros(7, dtype=torch.bool)])
    mm_embeds = torch.randn(3, HIDDEN, generator=gen).to(dtype)
    user_rows = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    user_rows[7:13] = ~user_is_token
    overlay = {
        2: (user, user_is_token),
    }
    idx_mapping = torch.tensor([0, 2, 1])
    qsl = torch.tensor([0, 7, 13, 14])
    nct = torch.tensor([0, 5, 0])  # by slot: r0 prefill from 0, r2 decoding at 5, r1 prefill from 0
    return dict(
        input_ids=input_ids,
        is_token_ids=is_token_ids,
        is_mm_embed=is_mm_embed,
        mm_embeds=mm_embeds,
        user=user,
        user_rows=user_rows,
        overlay=overlay,
        idx_mapping=idx_mapping,
        qsl=qsl,
        nct=nct,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overlay_first", [False, True])
@pytest.mark.parametrize("overlay", _overlays(), ids=lambda x: x[0])
def test_mixed_media_and_user_embeds_keep_every_user_row(dtype, overlay_first, overlay):
    kind, cls = overlay
    torch.manual_seed(1)
    embed = RangeCheckedEmbedding(VOCAB, HIDDEN).to(dtype)
    b = _mixed_batch(dtype)
    builder = InputsEmbedsBuilder(32, HIDDEN, dtype, "cpu")
    builder.buffer.fill_(float("nan"))  # stale contents must never survive into a used row
    n = b["input_ids"].shape[0]
    out = builder.dummy_inputs_embeds(n)
    if overlay_first:
        _apply_overlay(kind, cls, out, b["overlay"], b["idx_mapping"], b["qsl"], b["nct"])
    result = builder.build(embed, b["input_ids"], b["is_token_ids"], b["mm_embeds"], b["is_mm_embed"])
    if not overlay_first:
        _apply_overlay(kind, cls, result, b["overlay"], b["idx_mapping"], b["qsl"], b["nct"])

    assert result.data_ptr() == builder.buffer.data_ptr()
    # Every user row bit-exact, at its prompt position.
    user_positions = b["user_rows"].nonzero().flatten()
    assert torch.equal(result[user_positions], b["user"][user_positions - 7])
    # Media rows in order; token rows from the lookup.
    assert torch.equal(result[b["is_mm_embed"]], b["mm_embeds"])
    token_rows = b["is_token_ids"] & ~b["is_mm_embed"]
    assert torch.equal(result[token_rows], embed.weight.detach()[b["input_ids"][token_rows]])
    assert not result.isnan().any()
    assert all(0 <= i < VOCAB for i in embed.seen)


def test_out_of_range_placeholder_ids_never_reach_a_plain_embedding():
    embed = nn.Embedding(VOCAB, HIDDEN)  # raises IndexError on an out-of-range id
    ids = torch.tensor([-5, 1, VOCAB + 3, 2, VOCAB])
    out = torch.full((5, HIDDEN), 7.0)
    # Marked as non-token positions, and even (a guard) marked as token positions.
    assemble_inputs_embeds(embed, ids, out, torch.tensor([False, True, False, True, False]))
    assert torch.equal(out[[0, 2, 4]], torch.full((3, HIDDEN), 7.0))
    assert torch.equal(out[[1, 3]], embed.weight.detach()[[1, 2]])
    out2 = torch.full((5, HIDDEN), 7.0)
    assemble_inputs_embeds(embed, ids, out2)
    assert torch.equal(out2[[0, 2, 4]], torch.full((3, HIDDEN), 7.0))


def test_token_only_and_decode_steps_and_int32_ids():
    embed = nn.Embedding(VOCAB, HIDDEN)
    builder = InputsEmbedsBuilder(8, HIDDEN, torch.float32, "cpu")
    ids = torch.tensor([5, 6, 7], dtype=torch.int32)
    out = builder.build(embed, ids)
    assert torch.equal(out, embed.weight.detach()[ids.long()])
    assert out.data_ptr() == builder.dummy_inputs_embeds(3).data_ptr()


def test_dummy_inputs_embeds_is_a_view_of_the_one_buffer():
    builder = InputsEmbedsBuilder(16, HIDDEN, torch.bfloat16, "cpu")
    a, b = builder.dummy_inputs_embeds(4), builder.dummy_inputs_embeds(16)
    assert a.data_ptr() == b.data_ptr() == builder.buffer.data_ptr()
    assert a.shape == (4, HIDDEN) and a.dtype == torch.bfloat16 and not a.any()
    with pytest.raises(ValueError, match="do not fit"):
        builder.dummy_inputs_embeds(17)


def test_bad_arguments_raise_value_errors():
    embed = nn.Embedding(VOCAB, HIDDEN)
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="both or neither"):
        assemble_inputs_embeds(embed, ids, torch.zeros(2, HIDDEN), mm_embeds=torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError, match="num_tokens"):
        assemble_inputs_embeds(embed, ids, torch.zeros(3, HIDDEN))
    with pytest.raises(ValueError, match="hidden"):
        assemble_inputs_embeds(
            embed,
            ids,
            torch.zeros(2, HIDDEN),
            mm_embeds=torch.zeros(1, HIDDEN + 1),
            is_mm_embed=torch.tensor([True, False]),
        )


@pytest.mark.gpu
def test_gpu_assembly_has_no_host_sync_and_captures_in_a_cuda_graph():
    device = torch.device("cuda")
    dtype = torch.bfloat16
    embed = nn.Embedding(VOCAB, HIDDEN).to(device, dtype)
    b = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in _mixed_batch(dtype).items()}
    builder = InputsEmbedsBuilder(32, HIDDEN, dtype, device)
    n = b["input_ids"].shape[0]
    user_mask = b["user_rows"][7:13]

    def reset():  # stale NaNs everywhere except the user rows the overlay already wrote
        builder.buffer[:n] = float("nan")
        builder.buffer[7:13][user_mask] = b["user"][user_mask]

    reset()
    args = (embed, b["input_ids"], b["is_token_ids"], b["mm_embeds"], b["is_mm_embed"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside build raises
    try:
        out = builder.build(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = out.clone()
    user_positions = b["user_rows"].nonzero().flatten()
    assert torch.equal(out[user_positions], b["user"][user_positions - 7])
    assert torch.equal(out[b["is_mm_embed"]], b["mm_embeds"])
    # The same assembly captured and replayed as a CUDA graph gives the same rows.
    reset()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        builder.build(*args)  # warm-up on a side stream, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        builder.build(*args)
    reset()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(builder.buffer[:n], expected)
