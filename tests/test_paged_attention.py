"""Paged attention: the torch path against a dense causal reference, the Triton kernels against the torch
path (under TRITON_INTERPRET=1 on the CPU), and the KV write.

Batches are built the way the runner builds them: each request's earlier tokens are already in the cache,
this step's K/V go through `write_kv`, block tables are shuffled so pages are scattered, and the cache is
filled with random garbage first so a kernel that reads a wrong slot shows up. Outputs are poisoned with
NaN so rows a kernel forgot to write show up too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import compile_for_sm90

from runner.layers.attention_metadata import AttentionMetadata
from runner.layers.paged_attention import paged_attention, paged_attention_torch, write_kv
from runner.layers.paged_attention_triton import DecodeConfig, PrefillConfig, paged_attention_triton

# Small tiles so the interpreter stays fast and tiles span several pages / pages span several tiles.
SMALL_DECODE = DecodeConfig(tile_n=16, num_warps=4, num_stages=1, num_splits=1)
SMALL_PREFILL = PrefillConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1)


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    full_keys: list[torch.Tensor]  # per request, (seq_len, kv_heads, head_dim): the whole sequence
    full_values: list[torch.Tensor]
    scale: float


def make_batch(
    specs: list[tuple[int, int]],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    seed: int = 0,
    padding_reqs: int = 0,
    padding_tokens: int = 0,
    decode_only: bool = False,
) -> Batch:
    """`specs` lists (cached context length, query length) per request.

    `padding_reqs` appends requests with no rows and seq_len 0 (a padded CUDA-graph batch);
    `padding_tokens` appends rows that belong to no request and have slot -1.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in specs]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_needed) + 1
    block_tables = torch.full((len(specs) + padding_reqs, max_blocks), -1, dtype=torch.int32)

    query_start_loc, slots, new_k, new_v, full_keys, full_values = [0], [], [], [], [], []
    for b, ((ctx, q_len), seq_len) in enumerate(zip(specs, seq_lens)):
        for j in range(blocks_needed[b]):
            block_tables[b, j] = free.pop()
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        full_keys.append(keys)
        full_values.append(values)
        for pos in range(seq_len):
            slot_block, slot_off = int(block_tables[b, pos // block_size]), pos % block_size
            if pos < ctx:  # cached by earlier steps
                key_cache[slot_block, slot_off] = keys[pos]
                value_cache[slot_block, slot_off] = values[pos]
            else:  # written by this step
                slots.append(slot_block * block_size + slot_off)
        new_k.append(keys[ctx:])
        new_v.append(values[ctx:])
        query_start_loc.append(query_start_loc[-1] + q_len)
    query_start_loc += [query_start_loc[-1]] * padding_reqs
    seq_lens_all = seq_lens + [0] * padding_reqs
    slots += [-1] * padding_tokens
    num_tokens = len(slots)
    pad = torch.zeros(padding_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    write_kv(
        torch.cat(new_k + [pad]),
        torch.cat(new_v + [pad]),
        key_cache,
        value_cache,
        slot_mapping,
        backend="torch",
    )

    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens_all, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
        num_reqs=len(specs) + padding_reqs,
        is_decode_only=decode_only,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_all,
    )
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)
    return Batch(query, key_cache, value_cache, meta, full_keys, full_values, head_dim**-0.5)


def dense_reference(batch: Batch) -> torch.Tensor:
    """Naive causal attention in float64 on each request's contiguous K/V (no paging involved)."""
    qsl = batch.meta.query_start_loc_cpu
    out = torch.full(batch.query.shape, float("nan"), dtype=torch.float64)
    for b, (keys, values) in enumerate(zip(batch.full_keys, batch.full_values)):
        q = batch.query[qsl[b] : qsl[b + 1]].double()
        q_len, seq_len = q.shape[0], keys.shape[0]
        group = q.shape[1] // keys.shape[1]
        k = keys.double().repeat_interleave(group, dim=1)
        v = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qsl[b] : qsl[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def poisoned(batch: Batch) -> torch.Tensor:
    return torch.full_like(batch.query, float("nan"))


def owned_rows(batch: Batch) -> int:
    return batch.meta.query_start_loc_cpu[-1]


CASES = {
    "prefill_from_scratch": [(0, 23), (0, 5), (0, 2)],
    "chunked_prefill_with_paged_prefix": [(37, 11), (16, 16), (5, 30)],
    "decode": [(40, 1), (0, 1), (63, 1), (16, 1)],
    "mixed": [(0, 19), (33, 1), (50, 7), (15, 1), (0, 1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "block_size"), [(4, 2, 16), (2, 2, 16), (6, 2, 32), (4, 1, 16)]
)
def test_torch_path_matches_dense_reference(case, num_q_heads, num_kv_heads, block_size):
    batch = make_batch(CASES[case], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    out = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, out=poisoned(batch)
    )
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


def test_torch_path_without_host_copies_matches():
    batch = make_batch(CASES["mixed"], seed=3)
    expected = paged_attention_torch(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, poisoned(batch)
    )
    batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu = [], []
    got = paged_attention_torch(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, poisoned(batch)
    )
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def run_triton(batch: Batch, decode=SMALL_DECODE, prefill=SMALL_PREFILL) -> torch.Tensor:
    return paged_attention_triton(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, poisoned(batch),
        decode_config=decode, prefill_config=prefill,
    )  # fmt: skip


def run_torch(batch: Batch) -> torch.Tensor:
    return paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, poisoned(batch),
        backend="torch",
    )  # fmt: skip


@pytest.mark.parametrize("case", ["prefill_from_scratch", "chunked_prefill_with_paged_prefix", "mixed"])
def test_triton_prefill_matches_torch_path(case):
    batch = make_batch(CASES[case], seed=1)
    torch.testing.assert_close(run_triton(batch), run_torch(batch), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("block_size", "tile_n", "block_m", "num_q_heads", "num_kv_heads"),
    [
        (16, 32, 16, 4, 2),  # a key tile spans two pages
        (32, 16, 32, 6, 2),  # a page spans two tiles; group of 3 padded to 4
        (64, 16, 16, 2, 2),  # MHA: one query head per KV head
    ],
)
def test_triton_prefill_tilings_match_torch_path(block_size, tile_n, block_m, num_q_heads, num_kv_heads):
    batch = make_batch(
        [(45, 20), (0, 33)], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size, seed=2
    )
    prefill = PrefillConfig(block_m=block_m, tile_n=tile_n, num_warps=4, num_stages=1)
    torch.testing.assert_close(run_triton(batch, prefill=prefill), run_torch(batch), atol=2e-5, rtol=2e-5)


def test_triton_prefill_flat_grid_with_many_requests_and_padding():
    """Query lengths that are multiples of BLOCK_Q, decodes in between, and trailing padding requests and
    rows: every program must find its own request in the flat grid."""
    specs = [(0, 16), (5, 1), (20, 8), (0, 1), (3, 24), (9, 1), (0, 2)]
    batch = make_batch(specs, seed=12, padding_reqs=2, padding_tokens=3)
    out = run_triton(batch)  # block_m 16 with a group of 2: BLOCK_Q = 8
    real = owned_rows(batch)
    torch.testing.assert_close(out[:real], run_torch(batch)[:real], atol=2e-5, rtol=2e-5)
    assert torch.isnan(out[real:]).all()


def test_triton_prefill_finds_its_request_past_one_search_block():
    """More requests than PREFILL_SEARCH_BLOCK: the programs' search loops over blocks of requests."""
    from runner.layers.paged_attention_triton import PREFILL_SEARCH_BLOCK

    specs = [(i % 3, 1 + (i % 4)) for i in range(PREFILL_SEARCH_BLOCK + 6)]
    batch = make_batch(specs, seed=13)
    out = run_triton(batch)
    real = owned_rows(batch)
    torch.testing.assert_close(out[:real], run_torch(batch)[:real], atol=2e-5, rtol=2e-5)


def test_split_counts_fill_one_wave_at_most():
    from runner.layers import paged_attention_triton as pat

    cfg = DecodeConfig(tile_n=16, num_warps=4, num_stages=1)
    slots = pat._num_sms(torch.device("cpu")) * cfg.programs_per_sm
    for num_reqs in range(1, 300):
        splits = pat.choose_num_splits(num_reqs, 8, torch.device("cpu"), cfg)
        assert 1 <= splits <= cfg.max_splits
        assert splits == 1 or num_reqs * 8 * splits <= slots  # one wave
        assert splits == min(cfg.max_splits, max(1, slots // (num_reqs * 8)))  # the most that fit


def test_default_decode_config_by_grid_size(monkeypatch):
    """The small-tile launch only for grids of 3 x SMs < pairs <= 4 x SMs (request, KV head) pairs at
    head_dim 128 in 16-bit (the interpreter's device has 4 "SMs")."""
    from runner.layers import paged_attention_triton as pat

    bf16, cpu = torch.bfloat16, torch.device("cpu")
    sms = pat._num_sms(cpu)
    for pairs in (3 * sms + 1, 4 * sms):
        assert pat._default_decode_config(bf16, pairs, 128, cpu) == pat.SMALL_TILE_CONFIG
    for pairs in (1, 3 * sms, 4 * sms + 1, 64 * sms):
        assert pat._default_decode_config(bf16, pairs, 128, cpu) == DecodeConfig()
    assert pat._default_decode_config(bf16, 4 * sms, 64, cpu) == DecodeConfig()
    assert pat._default_decode_config(torch.float32, 4 * sms, 128, cpu).tile_n == 32


def test_default_prefill_config_by_head_dim_rows_and_fresh_prompts(monkeypatch):
    import runner.layers.paged_attention_triton as pat

    bf16, f16 = torch.bfloat16, torch.float16
    assert pat._default_prefill_config(128, bf16, 512, 2) == pat.PREFILL_TILES_128  # a prefix may be cached
    assert pat._default_prefill_config(128, f16, 512, 2, True) == pat.PREFILL_FRESH_64  # nothing cached
    assert pat._default_prefill_config(128, bf16, 64, 4, True) == pat.PREFILL_TILES_128  # groups > 2
    assert pat._default_prefill_config(128, bf16, 16, 2, True) == PrefillConfig(32, 64, 4, 3)  # short rows
    assert pat._default_prefill_config(64, bf16, 512, 2, True) == PrefillConfig(128, 64, 4, 3)
    assert pat._default_prefill_config(96, bf16, 512, 2, True) == PrefillConfig(128, 64, 8, 3)  # padded


def test_split_count_is_not_compiled_into_the_decode_kernels():
    """The count is a runtime argument: a server's eager steps meet every batch size, and each new
    constexpr value was a kernel build of seconds mid-traffic. Only split-or-not is compiled in."""
    import inspect

    from runner.layers import paged_attention_triton as pat

    for kernel in (pat._decode_kernel, pat._decode_reduce_kernel):
        assert "num_splits" in kernel.arg_names and "NUM_SPLITS" not in kernel.arg_names
        # `@triton.jit(...)` keeps its options in `kwargs` under the interpreter (CI) and as an attribute
        # when compiling; names or indices, by Triton version.
        unspecialised = set(getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"])
        assert unspecialised & {"num_splits", kernel.arg_names.index("num_splits")}
    assert "SPLIT" in inspect.signature(pat._decode_kernel.fn).parameters


@pytest.mark.parametrize("bt_ahead", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("block_size", "tile_n"), [(16, 16), (16, 32), (32, 16)])
def test_triton_decode_matches_torch_path(num_splits, block_size, tile_n, bt_ahead):
    batch = make_batch([(70, 1), (0, 1), (17, 1), (31, 1)], block_size=block_size, seed=4, decode_only=True)
    decode = DecodeConfig(tile_n=tile_n, num_warps=4, num_stages=1, num_splits=num_splits, bt_ahead=bt_ahead)
    torch.testing.assert_close(run_triton(batch, decode=decode), run_torch(batch), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_half_precision_branch_matches_torch_path(num_splits):
    """The 16-bit branch (P cast to the value dtype before the second dot). fp16, because the interpreter's
    bf16 dot is not faithful; on the GPU bf16 and fp16 compile the same code."""
    batch = make_batch(CASES["mixed"], seed=13)
    batch.query, batch.key_cache, batch.value_cache = (
        t.half() for t in (batch.query, batch.key_cache, batch.value_cache)
    )
    decode = DecodeConfig(tile_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    out = run_triton(batch, decode=decode)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), run_torch(batch).float(), atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_padded_batch_is_harmless(num_splits):
    """A CUDA-graph-style padded batch: extra requests with no rows and seq_len 0, trailing slot -1 rows."""
    batch = make_batch(
        [(40, 1), (9, 1)], seed=5, padding_reqs=3, padding_tokens=2, decode_only=True, num_q_heads=8
    )
    decode = DecodeConfig(tile_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    out = run_triton(batch, decode=decode)
    real = owned_rows(batch)
    torch.testing.assert_close(out[:real], run_torch(batch)[:real], atol=2e-5, rtol=2e-5)
    assert torch.isnan(out[real:]).all(), "rows of no request must be left alone"


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_decode_one_row_padding_request_gets_zeros(num_splits):
    """Padding as one row per request with seq_len 0: the row is written with zeros, never NaN."""
    batch = make_batch([(20, 1)], seed=6, decode_only=True)
    batch.meta.query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32)
    batch.meta.seq_lens = torch.tensor([21, 0], dtype=torch.int32)
    batch.meta.block_tables = torch.cat([batch.meta.block_tables, torch.zeros_like(batch.meta.block_tables)])
    batch.meta.num_reqs = 2
    batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu = [0, 1, 2], [21, 0]
    batch.query = torch.cat([batch.query, torch.randn(1, *batch.query.shape[1:])])
    decode = DecodeConfig(tile_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    out = run_triton(batch, decode=decode)
    ref = run_torch(batch)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert (out[1] == 0).all()


def test_triton_mixed_batch_with_default_configs_and_dispatcher():
    """The dispatcher's `backend="triton"` with the default launch choices (auto split count)."""
    batch = make_batch(CASES["mixed"], seed=7, padding_tokens=1)
    out = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, out=poisoned(batch),
        backend="triton",
    )  # fmt: skip
    real = owned_rows(batch)
    torch.testing.assert_close(out[:real].double(), dense_reference(batch)[:real], atol=2e-5, rtol=2e-5)
    assert torch.isnan(out[real:]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_query_and_out(backend):
    """Queries arrive as a transposed view of a (1, heads, tokens, dim) projection; no copy is needed."""
    batch = make_batch(CASES["mixed"], seed=8)
    strided_query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided_query.is_contiguous()
    out = torch.full((batch.query.shape[1], batch.query.shape[0], batch.query.shape[2]), float("nan"))
    if backend == "triton":
        paged_attention_triton(
            strided_query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, out.transpose(0, 1),
            decode_config=SMALL_DECODE, prefill_config=SMALL_PREFILL,
        )  # fmt: skip
    else:
        paged_attention(strided_query, batch.key_cache, batch.value_cache, batch.meta, batch.scale,
                        out=out.transpose(0, 1), backend="torch")  # fmt: skip
    torch.testing.assert_close(out.transpose(0, 1).double(), dense_reference(batch), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_write_kv_writes_slots_and_skips_padding(backend):
    gen = torch.Generator().manual_seed(9)
    key_cache = torch.randn(4, 16, 2, 16, generator=gen)
    value_cache = torch.randn(4, 16, 2, 16, generator=gen)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slot_mapping = torch.tensor([5, -1, 40, 63, -1, 16], dtype=torch.int64)
    # A strided view, as a transposed projection output would be.
    key = torch.randn(2, 6, 16, generator=gen).transpose(0, 1)
    value = torch.randn(2, 6, 16, generator=gen).transpose(0, 1)
    write_kv(key, value, key_cache, value_cache, slot_mapping, backend=backend)

    expected_k, expected_v = before_k.clone(), before_v.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // 16, slot % 16] = key[t]
            expected_v[slot // 16, slot % 16] = value[t]
    assert not torch.equal(expected_k, before_k)
    torch.testing.assert_close(key_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_v, atol=0, rtol=0)


def test_bad_inputs_raise_value_error():
    batch = make_batch([(3, 2)])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(batch.query[:, :3], batch.key_cache, batch.value_cache, batch.meta, 1.0)
    with pytest.raises(ValueError, match="dtype|is torch"):
        paged_attention(batch.query.double(), batch.key_cache, batch.value_cache, batch.meta, 1.0)
    odd_cache = torch.zeros(2, 12, 2, 16)  # a head_dim of 24 is padded; a block_size of 12 is refused
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(torch.zeros(2, 4, 16), odd_cache, odd_cache, batch.meta, 1.0, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, 1.0, backend="cuda")
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), batch.key_cache, batch.value_cache,
                 torch.zeros(2, dtype=torch.int64))  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# GPU: the compiled kernels in bf16, and a decode captured in a CUDA graph then replayed with new lengths.
# --------------------------------------------------------------------------------------------------------


def _to_cuda(batch: Batch, dtype: torch.dtype) -> Batch:
    m = batch.meta
    meta = AttentionMetadata(
        slot_mapping=m.slot_mapping.cuda(), query_start_loc=m.query_start_loc.cuda(),
        seq_lens=m.seq_lens.cuda(),
        block_tables=m.block_tables.cuda(), max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
        num_reqs=m.num_reqs, is_decode_only=m.is_decode_only, query_start_loc_cpu=list(m.query_start_loc_cpu),
        seq_lens_cpu=list(m.seq_lens_cpu),
    )  # fmt: skip
    return Batch(
        batch.query.to("cuda", dtype), batch.key_cache.to("cuda", dtype), batch.value_cache.to("cuda", dtype),
        meta, batch.full_keys, batch.full_values, batch.scale,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_kernels_match_torch_path(dtype, head_dim, case):
    specs = [(ctx * 9, q * 13 if q > 1 else 1) for ctx, q in CASES[case]]
    batch = _to_cuda(
        make_batch(specs, num_q_heads=16, num_kv_heads=8, head_dim=head_dim, decode_only=case == "decode"),
        dtype,
    )
    got = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale,
                          out=torch.full_like(batch.query, float("nan")))  # fmt: skip
    ref = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, backend="torch"
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["prefill_from_scratch", "mixed"])
def test_gpu_fresh_prefill_launch_matches_torch_path(dtype, case):
    """Steps whose prefill rows all start at position 0 (`fresh_prefill`, set by the runner) take the
    64-row launch at head_dim 128; decode rows in the step go to the decode kernel as before."""
    specs = [(0, q * 13 if q > 1 else 1) if q > 1 else (ctx * 9, 1) for ctx, q in CASES[case]]
    batch = _to_cuda(make_batch(specs, num_q_heads=16, num_kv_heads=8, head_dim=128), dtype)
    batch.meta.fresh_prefill = True
    got = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale,
                          out=torch.full_like(batch.query, float("nan")))  # fmt: skip
    ref = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, backend="torch"
    )
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_small_tile_decode_on_a_one_wave_grid_matches_torch_path():
    """64 requests x 8 KV heads: on a GPU with 128-170 SMs the default launch is the small-tile one
    (32-key tiles, block ids a tile ahead, 4 programs per SM); it must agree with the torch path, in a
    CUDA graph too."""
    from runner.layers import paged_attention_triton as pat

    specs = [(40 + 37 * i % 300, 1) for i in range(64)]
    batch = _to_cuda(make_batch(specs, num_q_heads=16, num_kv_heads=8, head_dim=128, decode_only=True,
                                seed=21), torch.bfloat16)  # fmt: skip
    cfg = pat._default_decode_config(torch.bfloat16, 64 * 8, 128, batch.query.device)
    sms = pat._num_sms(batch.query.device)
    if not 3 * sms < 64 * 8 <= 4 * sms:
        pytest.skip(f"{sms} SMs: 512 pairs do not take the small tiles here")
    assert cfg == pat.SMALL_TILE_CONFIG
    out = torch.full_like(batch.query, float("nan"))

    def step():
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, out=out)

    step()
    torch.cuda.synchronize()
    ref = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale,
                          backend="torch")  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_decode_replays_in_cuda_graph_with_new_lengths(num_splits):
    dtype = torch.bfloat16
    first = _to_cuda(make_batch([(100, 1), (300, 1), (7, 1)], num_q_heads=16, num_kv_heads=8, head_dim=128,
                                padding_reqs=1, decode_only=True, seed=10), dtype)  # fmt: skip
    config = DecodeConfig(num_splits=num_splits)
    out = torch.empty_like(first.query)
    q = first.query.clone()

    def step():
        paged_attention_triton(q, first.key_cache, first.value_cache, first.meta, first.scale, out,
                               decode_config=config)  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # New step: other lengths and other pages, written into the captured tensors in place.
    second = _to_cuda(make_batch([(250, 1), (3, 1), (60, 1)], num_q_heads=16, num_kv_heads=8, head_dim=128,
                                 padding_reqs=1, decode_only=True, seed=11), dtype)  # fmt: skip
    assert second.key_cache.shape[0] <= first.key_cache.shape[0]
    first.key_cache.zero_()
    first.value_cache.zero_()
    first.key_cache[: second.key_cache.shape[0]] = second.key_cache
    first.value_cache[: second.value_cache.shape[0]] = second.value_cache
    first.meta.seq_lens.copy_(second.meta.seq_lens)
    first.meta.block_tables.fill_(0)
    first.meta.block_tables[:, : second.meta.block_tables.shape[1]] = second.meta.block_tables
    q.copy_(second.query)
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention(second.query, second.key_cache, second.value_cache, second.meta, second.scale,
                          backend="torch")  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------------------
# CPU: the kernels compile for Hopper (sm_90) with the ptxas that ships with Triton, so a kernel that only
# the interpreter accepts is caught without a GPU. Runs in a subprocess: this process is in interpreter mode.
# --------------------------------------------------------------------------------------------------------

_COMPILE_FOR_SM90 = r"""
import runner.layers.paged_attention_triton as pat

COMMON = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_kb",
          "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_ot", "stride_oh"]
UNIT = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1)

def build(fn, types, consts, aligned, **opts):
    ptx = build_sm90(fn, types, consts, aligned, **opts).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == bool(consts.get("WAIT")), fn.__name__
    assert ("griddepcontrol.launch_dependents" in ptx) == bool(consts.get("RELEASE")), fn.__name__
    print(fn.__name__, "ok")

bf16 = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16", block_tables_ptr="*i32",
            seq_lens_ptr="*i32", query_start_loc_ptr="*i32", qk_scale="fp32", part_out_ptr="*fp32",
            part_lse_ptr="*fp32")
# release: PDL's trigger and wait; ahead: block ids a tile ahead
for split, release, ahead in ((False, False, False), (True, False, False), (False, True, False),
                              (True, True, True)):
    build(pat._decode_kernel, bf16, dict(UNIT, SPLIT=split, BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_G=16,
          TILE_N=128, IS_FP32=False, RELEASE=release, WAIT=release, BT_AHEAD=ahead), COMMON, num_warps=4,
          num_stages=3 if ahead else 2, launch_pdl=release)
for release in (False, True):
    build(pat._decode_reduce_kernel, bf16, dict(stride_od=1, SPLITS_PAD=16, HEAD_DIM=128, RELEASE=release),
          COMMON, num_warps=2)
# the 128-row launch of head_dim 64-256 and the two 16-bit head_dim-128 defaults
for cfg in (pat.PrefillConfig(128, 64, 8, 3), pat.PREFILL_TILES_128, pat.PREFILL_FRESH_64):
    build(pat._prefill_kernel, bf16, dict(UNIT, BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_M=cfg.block_m,
          BLOCK_Q=cfg.block_m // 2, G_PAD=2, TILE_N=cfg.tile_n, SEARCH_BLOCK=pat.PREFILL_SEARCH_BLOCK,
          IS_FP32=False), COMMON, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
build(pat._write_kv_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*bf16",
      value_cache_ptr="*bf16", slot_ptr="*i64"), dict(stride_kd=1, stride_vd=1, stride_kcd=1, stride_vcd=1,
      BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128), [], num_warps=4)
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    stdout = compile_for_sm90(_COMPILE_FOR_SM90)
    assert stdout.count(" ok") == 10, stdout
