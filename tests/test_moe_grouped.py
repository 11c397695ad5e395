"""The grouped expert GEMM (runner.layers.moe_grouped) computes what Hugging Face's sparse MoE blocks compute.

Under TRITON_INTERPRET=1 on the CPU, on tiny shapes: the kernel against HF's Qwen3-MoE, Mixtral and OLMoE
blocks (eager experts) in fp32; the expert sort's invariants; the engine's greedy tokens with the kernel
installed against HF generate; the runner installs it when the fused ops are on.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from helpers import compile_for_sm90, cpu_runner_with_fused_ops

from bridge.tiny_families import build_family_model
from runner.layers import moe_grouped
from runner.llm import LLM
from runner.sampling_params import SamplingParams

BLOCKS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralSparseMoeBlock",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    "olmoe": ("OlmoeConfig", "OlmoeSparseMoeBlock",
              dict(num_experts=5, num_experts_per_tok=3, intermediate_size=24)),
}


@pytest.fixture
def grouped_on_cpu():
    moe_grouped.GROUPED_MOE_ON_CPU = True
    try:
        yield
    finally:
        moe_grouped.GROUPED_MOE_ON_CPU = False


def _hf_block(family: str):
    config_name, block_name, kwargs = BLOCKS[family]
    config = getattr(transformers, config_name)(hidden_size=40, num_attention_heads=4, num_key_value_heads=2,
                                                **kwargs)
    config._experts_implementation = "eager"  # HF's per-expert loop: the plainest reference
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    block = getattr(module, block_name)(config).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block


def _out(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("family", sorted(BLOCKS))
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_grouped_kernel_matches_hf_sparse_moe_block(family, num_tokens, grouped_on_cpu):
    block = _hf_block(family)
    x = torch.randn(1, num_tokens, 40, generator=torch.Generator().manual_seed(num_tokens))
    moe_grouped.GROUPED_MOE_ON_CPU = False
    with torch.no_grad():
        want = _out(block(x))
        assert moe_grouped.install_grouped_moe(block) == 1
        assert moe_grouped.install_grouped_moe(block) == 0  # idempotent
        moe_grouped.GROUPED_MOE_ON_CPU = True
        got = _out(block(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_kernel_low_precision_branch_matches_hf(grouped_on_cpu):
    """The non-fp32 branch (tensor-core dots, HF's rounding of the projections and of SiLU * up), in fp16:
    the interpreter's bf16 dot is not exact, fp16's is. 70 tokens over 8 experts: 32-row blocks."""
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=True)
    config._experts_implementation = "eager"
    module = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    block = module.Qwen3MoeSparseMoeBlock(config).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    block = block.half()
    x = torch.randn(1, 70, 64, generator=g).half()
    moe_grouped.GROUPED_MOE_ON_CPU = False
    with torch.no_grad():
        want = _out(block(x)).float()
        moe_grouped.install_grouped_moe(block)
        moe_grouped.GROUPED_MOE_ON_CPU = True
        got = _out(block(x)).float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3)


def test_sort_pairs_by_expert_groups_and_pads_every_pair_once():
    top_k = torch.tensor([[3, 0], [0, 2], [3, 2], [0, 3], [1, 0]])
    block_m = 4
    sorted_pairs, block_expert = moe_grouped.sort_pairs_by_expert(top_k, 5, block_m)
    num_pairs = top_k.numel()
    flat = top_k.reshape(-1)
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    for b, expert in enumerate(block_expert.tolist()):
        rows = sorted_pairs[b * block_m : (b + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows.long()] == expert).all()
    assert set(block_expert.tolist()) - {-1} == {0, 1, 2, 3}  # expert 4 got no pair: no block


def test_engine_with_the_grouped_kernel_matches_hf_generate(tmp_path, grouped_on_cpu):
    path = build_family_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=11, init_std=0.1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(20, 33)), [7, 99, 5]]
    moe_grouped.GROUPED_MOE_ON_CPU = False
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    moe_grouped.GROUPED_MOE_ON_CPU = True
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, max_num_batched_tokens=16)
    assert moe_grouped.install_grouped_moe(llm.runner.model) == 2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_model_runner_installs_the_grouped_kernel_with_the_fused_ops(tmp_path):
    path = build_family_model(tmp_path / "olmoe", "olmoe", seed=1)
    assert cpu_runner_with_fused_ops(path).num_grouped_moe == 2


_COMPILE_FOR_SM90 = r"""
from runner.layers import moe_grouped as mg

types = dict(x_ptr="*bf16", w_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32", inter_ptr="*bf16",
             weights_ptr="*bf16", out_ptr="*bf16")
for fn, consts in ((mg._gate_up_kernel, dict(TOP_K=8, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IS_FP32=False)),
                   (mg._down_kernel, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, IS_FP32=False))):
    build_sm90(fn, types, consts, num_warps=4, num_stages=3)
    print(fn.__name__, "ok")
"""


def test_grouped_kernels_compile_for_sm90_without_a_gpu():
    stdout = compile_for_sm90(_COMPILE_FOR_SM90)
    assert stdout.count(" ok") == 2, stdout


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 700])
def test_grouped_kernel_on_cuda_matches_hf_grouped_mm_in_bf16(num_tokens):
    block = _hf_block("qwen3_moe").cuda().to(torch.bfloat16)
    block.experts.config._experts_implementation = "grouped_mm"
    x = torch.randn(1, num_tokens, 40, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = _out(block(x))
        moe_grouped.install_grouped_moe(block)
        got = _out(block(x))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
