"""Sliding-window and soft-capped paged attention: the torch path against a dense float64 reference, and the
Triton kernels (under TRITON_INTERPRET=1 on the CPU) against the same reference.

The batches are tests/test_paged_attention.py's (scattered pages, garbage-filled cache, NaN-poisoned
outputs). The cases put the window edge inside a query block, across tiles and pages, in a chunk whose
prefix is already cached, and in decode steps far past the window; tiles of 8 keys with 16-row query
blocks make a query block see the window edge at different keys per row.
"""

from __future__ import annotations

import pytest
import torch
from helpers import compile_for_sm90
from test_paged_attention import make_batch

from runner.layers.paged_attention import paged_attention, paged_attention_torch
from runner.layers.paged_attention_triton import DecodeConfig, PrefillConfig, paged_attention_triton

TINY_PREFILL = PrefillConfig(block_m=32, tile_n=8, num_warps=4, num_stages=1)

CASES = {
    "prefill": [(0, 23), (0, 5)],
    "chunk_over_the_window_edge": [(13, 11), (5, 19)],
    "decode_far_past_the_window": [(60, 1), (3, 1), (0, 1)],
    "mixed": [(0, 17), (41, 1), (20, 6)],
}
VARIANTS = [(5, None), (None, 1.5), (7, 2.0), (1, None)]


def dense_reference(batch, window: int | None, softcap: float | None) -> torch.Tensor:
    qsl = batch.meta.query_start_loc_cpu
    out = torch.full(batch.query.shape, float("nan"), dtype=torch.float64)
    for b, (keys, values) in enumerate(zip(batch.full_keys, batch.full_values)):
        q = batch.query[qsl[b] : qsl[b + 1]].double()
        q_len, seq_len = q.shape[0], keys.shape[0]
        group = q.shape[1] // keys.shape[1]
        k = keys.double().repeat_interleave(group, dim=1)
        v = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        k_pos, q_pos = torch.arange(seq_len)[None, :], torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window  # W keys, the query's own included (transformers' masks)
        out[qsl[b] : qsl[b + 1]] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -torch.inf)
                                                .softmax(-1), v)
    return out


def _check(got: torch.Tensor, want: torch.Tensor, batch) -> None:
    n = batch.meta.query_start_loc_cpu[-1]
    torch.testing.assert_close(got[:n].double(), want[:n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("window", "softcap"), VARIANTS)
def test_torch_path_matches_dense_reference(case, window, softcap):
    batch = make_batch(CASES[case], block_size=4)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_torch(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, out,
                          sliding_window=window, softcap=softcap)
    _check(out, dense_reference(batch, window, softcap), batch)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("window", "softcap"), VARIANTS)
def test_triton_kernels_match_dense_reference(case, window, softcap):
    batch = make_batch(CASES[case], block_size=4)
    splits = 3 if case.startswith("decode") else 1  # split-KV decode over a window-shortened range
    out = paged_attention_triton(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale,
        torch.full_like(batch.query, float("nan")), sliding_window=window, softcap=softcap,
        # decode-only cases load block ids a tile ahead; the mixed ones do not
        decode_config=DecodeConfig(tile_n=16, num_warps=4, num_stages=1, num_splits=splits,
                                   bt_ahead=splits > 1),
        prefill_config=TINY_PREFILL,
    )  # fmt: skip
    _check(out, dense_reference(batch, window, softcap), batch)


def test_window_wider_than_the_sequence_is_plain_causal_attention():
    batch = make_batch(CASES["mixed"], block_size=4)
    plain = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale,
                            backend="torch")
    wide = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale,
                           backend="torch", sliding_window=1000)
    _check(wide, plain.double(), batch)


def test_bad_window_or_softcap_is_a_value_error():
    batch = make_batch([(0, 3)])
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, 1.0, softcap=-1.0)


def test_engine_on_the_triton_kernels_matches_hf_for_gemma2(tmp_path):
    """Gemma 2 (alternating window-8 / full layers, soft-capped logits, query_pre_attn_scalar) through the
    engine with the Triton kernels, chunked prefill across the window edge and decode past it."""
    from transformers import AutoModelForCausalLM

    from bridge.tiny_families import build_family_model
    from runner.layers.hf_attention import set_attention_backend
    from runner.llm import LLM
    from runner.sampling_params import SamplingParams

    path = build_family_model(tmp_path / "gemma2", "gemma2", seed=11, init_std=0.1)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [list(range(20, 39)), [7, 99, 5]]
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    previous = set_attention_backend("triton")
    try:
        llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=32,
                  max_num_batched_tokens=12)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    finally:
        set_attention_backend(previous)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("case", ["mixed", "decode_far_past_the_window"])
@pytest.mark.parametrize("head_dim", [24, 12])
def test_triton_kernels_with_a_head_dim_that_is_not_a_power_of_two(case, head_dim):
    """Phi-3-mini's head_dim is 96: the kernels pad it to a power of two and mask the extra lanes."""
    batch = make_batch(CASES[case], block_size=4, head_dim=head_dim)
    splits = 2 if case.startswith("decode") else 1
    out = paged_attention_triton(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale,
        torch.full_like(batch.query, float("nan")), sliding_window=7,
        decode_config=DecodeConfig(tile_n=16, num_warps=4, num_stages=1, num_splits=splits),
        prefill_config=TINY_PREFILL,
    )  # fmt: skip
    _check(out, dense_reference(batch, 7, None), batch)


_COMPILE_VARIANTS_FOR_SM90 = r"""
import runner.layers.paged_attention_triton as pat

ALIGNED = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"]
UNIT = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1)
types = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16",
             block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", qk_scale="fp32",
             softcap_l2="fp32", part_out_ptr="*fp32", part_lse_ptr="*fp32")
# Every switch on at once: a window, soft-capping, and a head_dim (96, Phi-3-mini) padded to 128.
for head_dim in (128,):
    variant = dict(SLIDING=True, SOFTCAP=True, PAD_D=True)
    for fn, consts, opts in (
        (pat._decode_kernel, dict(UNIT, SPLIT=True, BLOCK_SIZE=16, HEAD_DIM=head_dim, BLOCK_G=16,
                                  TILE_N=64, IS_FP32=False, RELEASE=False, WAIT=False, BT_AHEAD=True,
                                  **variant),
         dict(num_warps=4, num_stages=2)),
        (pat._prefill_kernel, dict(UNIT, BLOCK_SIZE=16, HEAD_DIM=head_dim, BLOCK_M=64, BLOCK_Q=32, G_PAD=2,
                                   TILE_N=32, SEARCH_BLOCK=256, IS_FP32=False, **variant),
         dict(num_warps=4, num_stages=2)),
    ):
        build_sm90(fn, types, consts, ALIGNED, **opts)
        print(fn.__name__, head_dim, "ok")
"""


def test_window_softcap_and_padded_head_dim_kernels_compile_for_sm90_without_a_gpu():
    """A kernel only the interpreter accepts is caught without a GPU (as in tests/test_paged_attention.py)."""
    stdout = compile_for_sm90(_COMPILE_VARIANTS_FOR_SM90)
    assert stdout.count(" ok") == 2, stdout


def test_triton_half_precision_branch_with_window_and_softcap():
    batch = make_batch(CASES["mixed"], block_size=4)
    out = paged_attention_triton(
        batch.query.half(), batch.key_cache.half(), batch.value_cache.half(), batch.meta, batch.scale,
        torch.full_like(batch.query, float("nan")).half(), sliding_window=7, softcap=2.0,
        decode_config=DecodeConfig(tile_n=16, num_warps=4, num_stages=1, num_splits=2),
        prefill_config=TINY_PREFILL,
    )  # fmt: skip
    n = batch.meta.query_start_loc_cpu[-1]
    torch.testing.assert_close(out[:n].double(), dense_reference(batch, 7, 2.0)[:n], rtol=2e-2, atol=2e-2)
