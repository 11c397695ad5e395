"""L2 prefetches from the decode layer's norm and SiLU*mul (runner.layers.l2_prefetch).

A prefetch changes no value, so what can go wrong is where it points and whether the instruction is
there at all: the host tables cover each weight exactly, the K/V budget becomes the right block count,
the kernels compiled for Hopper carry `cp.async.bulk.prefetch.L2` only when asked, the fused layers get
a plan naming the next layer, and on the GPU the engine's tokens and logprobs are bitwise those without.
"""

from __future__ import annotations

import pytest
import torch
from helpers import gpu_tokens_and_logprobs

from bridge.tiny_models import build_tiny_model
from runner.layers import fused_layers, l2_prefetch
from runner.sampling_params import SamplingParams


def test_chunk_table_covers_each_weight_in_16_byte_chunks():
    a = torch.zeros(10_000, dtype=torch.bfloat16)  # 20,000 bytes
    b = torch.zeros(3, 7, dtype=torch.float32)  # 84 bytes: its last chunk rounds up to 96
    table = l2_prefetch.chunk_table([a, b], chunk_bytes=4096).tolist()
    assert all(size % 16 == 0 and 0 < size <= 4096 for _, size in table)
    a_rows = [r for r in table if a.data_ptr() - 16 < r[0] < a.data_ptr() + 20_000]
    start = a.data_ptr() - a.data_ptr() % 16
    assert a_rows[0][0] == start
    assert all(nxt[0] == cur[0] + cur[1] for cur, nxt in zip(a_rows, a_rows[1:]))  # back to back
    assert a_rows[-1][0] + a_rows[-1][1] >= a.data_ptr() + 20_000 > a_rows[-1][0]
    assert [r for r in table if r not in a_rows] == [[b.data_ptr() - b.data_ptr() % 16, 96]]
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch.chunk_table([a.view(100, 100).t()])


def test_weight_prefetch_rebuilds_its_table_when_a_weight_moves():
    holder = {"w": torch.zeros(64, dtype=torch.float32)}
    plan = l2_prefetch.WeightPrefetch(lambda: [holder["w"]])
    first = plan.table()
    assert plan.table() is first  # cached while nothing moves
    holder["w"] = torch.zeros(64, dtype=torch.float32)
    assert plan.table()[0, 0].item() == holder["w"].data_ptr() - holder["w"].data_ptr() % 16


def test_kv_budget_becomes_a_block_count_per_request():
    kc = torch.zeros(100, 16, 2, 8, dtype=torch.bfloat16)  # 512 bytes a block
    vc = torch.zeros_like(kc)
    bt = torch.zeros(4, 10, dtype=torch.int32)
    seq = torch.zeros(4, dtype=torch.int32)
    plan = l2_prefetch.KVPrefetch.for_budget(bt, seq, kc, vc, 4 * 2 * 512 * 3 + 100)
    assert plan.per_req == 3
    args = plan.args()
    assert args[2:4] == (4, 10) and args[6:9] == (512, 16, 3)
    assert l2_prefetch.KVPrefetch.for_budget(bt, seq, kc, vc, 10**9).per_req == 10  # at most the table
    assert l2_prefetch.KVPrefetch.for_budget(bt, seq, kc, vc, 1000) is None  # not one block each
    assert l2_prefetch.KVPrefetch.for_budget(bt[:0], seq[:0], kc, vc, 10**9) is None


_SM90 = r"""
import runner.layers.fused_linear as fl
import runner.layers.fused_ops as fo
import runner.layers.l2_prefetch as lp

pf = dict(table_ptr="*i64", bt_ptr="*i32", seq_ptr="*i32", k_addr="i64", v_addr="i64")
for has in ((False, False), (True, False), (False, True), (True, True)):
    consts = dict(HAS_TABLE=has[0], HAS_KV=has[1], VEC=128)
    norm = build_sm90(fo._rmsnorm_kernel,
                      dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", eps="fp32", **pf),
                      dict(BLOCK_R=4, BLOCK_N=1024, **consts), num_warps=4)
    silu = build_sm90(fl._silu_mul_kernel, dict(x_ptr="*bf16", out_ptr="*bf16", **pf),
                      dict(BLOCK=1024, RELEASE=False, **consts), num_warps=4)
    for name, k in (("norm", norm), ("silu", silu)):
        print(name, *has, k.asm["ptx"].count("cp.async.bulk.prefetch.L2.global"))
"""


def test_norm_and_silu_carry_the_bulk_prefetch_only_when_asked():
    """Compiled for Hopper without a GPU: one `cp.async.bulk.prefetch.L2` for a weight table, two for
    K/V (K and V), none without prefetches (the kernels stay as they were)."""
    from helpers import compile_for_sm90

    counts = {tuple(ln.split()[:3]): int(ln.split()[3]) for ln in compile_for_sm90(_SM90).splitlines()}
    for name in ("norm", "silu"):
        assert counts[(name, "False", "False")] == 0
        assert counts[(name, "True", "False")] == 1
        assert counts[(name, "False", "True")] == 2
        assert counts[(name, "True", "True")] == 3


def test_fused_layers_get_a_plan_naming_the_next_layer_only_when_on(tiny_model_root, monkeypatch):
    from transformers import AutoModelForCausalLM

    from runner.layers import fused_linear

    path = build_tiny_model(tiny_model_root / "prefetch_plan_qwen3", "qwen3", seed=3, num_layers=3)

    def fused(budget, weights, supported=True):
        monkeypatch.setattr(l2_prefetch, "KV_BUDGET_BYTES", budget)
        monkeypatch.setattr(l2_prefetch, "WEIGHTS", weights)
        monkeypatch.setattr(l2_prefetch, "supported", lambda device: supported)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        fused_linear.fuse_linears(model)
        assert fused_layers.fuse_decoder_layers(model) == 3
        return model.model.layers

    assert not any(hasattr(layer, "bridge_l2_prefetch") for layer in fused(0, False))
    assert not any(hasattr(layer, "bridge_l2_prefetch") for layer in fused(1 << 20, True, supported=False))
    layers = fused(1 << 20, True)
    plans = [layer.bridge_l2_prefetch for layer in layers]
    mlp0, attn1 = layers[0].mlp, layers[1].self_attn
    table = plans[0].mlp_table()
    assert table[:, 1].sum().item() >= sum(w.numel() * 4 for w in (mlp0.bridge_gate_up_weight,
                                                                   mlp0.down_proj.weight))
    assert plans[0].next_table()[0, 0].item() // 16 == attn1.bridge_qkv_weight.data_ptr() // 16
    assert plans[2].next_table() is None  # the last layer has no next one
    assert plans[2].next_kv(None) is None
    monkeypatch.setattr(l2_prefetch, "WEIGHTS", False)
    assert plans[0].mlp_table() is None and plans[0].next_table() is None


@pytest.mark.gpu
def test_gpu_prefetch_kernel_runs_eager_and_in_a_graph_and_writes_nothing():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kc = torch.randn(64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    kept = (kc.clone(), vc.clone())
    bt = torch.randint(0, 64, (5, 8), dtype=torch.int32, device="cuda")
    seq = torch.tensor([0, 1, 17, 128, 40], dtype=torch.int32, device="cuda")
    w = torch.randn(3000, 1000, dtype=torch.bfloat16, device="cuda")
    table = l2_prefetch.chunk_table([w])
    kv = l2_prefetch.KVPrefetch.for_budget(bt, seq, kc, vc, 1 << 20)
    l2_prefetch.prefetch(table, kv)
    l2_prefetch.prefetch(None, kv, programs=3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch.prefetch(table, kv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc, kept[0]) and torch.equal(vc, kept[1])


@pytest.mark.gpu
def test_gpu_prefetching_engine_is_bitwise_the_plain_one(tiny_model_root, monkeypatch):
    """48 requests (decode steps of 33-64 rows, where the norm and SiLU*mul prefetch): tokens and logprobs
    equal the engine's without prefetches, and the fused layers did carry a plan."""
    if not torch.cuda.is_available() or not l2_prefetch.supported(torch.device("cuda")):
        pytest.skip("needs a CUDA device of compute capability 9.0+")
    path = build_tiny_model(tiny_model_root / "prefetch_gpu_qwen3", "qwen3", seed=12, head_dim=64,
                            num_layers=3)
    prompts = [{"prompt_token_ids": [(5 * i + j) % 200 + 3 for j in range(4 + i % 30)]} for i in range(48)]
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(l2_prefetch, "KV_BUDGET_BYTES", (1 << 20) if on else 0)
        monkeypatch.setattr(l2_prefetch, "WEIGHTS", on)

        def check(llm, on=on):
            layers = llm.runner.model.model.layers
            assert all(hasattr(layer, "bridge_l2_prefetch") == on for layer in layers)

        runs[on] = gpu_tokens_and_logprobs(path, prompts, params, check)
    assert runs[True] == runs[False]
