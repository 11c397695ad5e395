"""Fused q/k/v and gate/up projections (runner.layers.fused_linear) compute what HF's modules compute.

Tiny fp32 llama / qwen2 (q/k/v bias) / qwen3 models: after fusing, each MLP and each attention's
projections match an unfused copy, the whole model's logits match, parameters stay views of the
fused weights with unchanged `state_dict`, and the engine's greedy tokens with every fused op on
(RMSNorm, rotary, q/k/v, gate/up, SiLU*mul under TRITON_INTERPRET) equal HF `generate`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_runner_with_fused_ops, load_hf_fp32

from bridge.tiny_models import build_tiny_model
from runner.layers import fused_linear, fused_ops
from runner.llm import LLM
from runner.sampling_params import SamplingParams

FAMILIES = ("llama", "qwen2", "qwen3")
NUM_LAYERS = 2


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_linear_models")
    return {f: build_tiny_model(root / f, f, seed=5, num_layers=NUM_LAYERS) for f in FAMILIES}


@pytest.fixture
def triton_on_cpu():
    fused_linear.SILU_MUL_ON_CPU = True
    fused_ops.ROTARY_ON_CPU = True
    try:
        yield
    finally:
        fused_linear.SILU_MUL_ON_CPU = False
        fused_ops.ROTARY_ON_CPU = False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 128), (1, 7, 2 * 200), (0, 2 * 64)])
def test_silu_mul_triton_matches_torch(shape, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    got = fused_linear.silu_mul_triton(x)
    want = fused_linear.silu_mul_reference(x)
    assert got.shape == want.shape == (*shape[:-1], shape[-1] // 2)
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: a rounding step (one or two ulps) apart at most
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # A strided input (a column slice) is read correctly too.
    wide = torch.randn((*shape[:-1], shape[-1] + 6), generator=g).to(dtype)
    torch.testing.assert_close(fused_linear.silu_mul_triton(wide[..., 3:-3]),
                               fused_linear.silu_mul_reference(wide[..., 3:-3]), rtol=tol, atol=tol)


def test_silu_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        fused_linear.silu_mul_triton(torch.zeros(2, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden, inter", [(5, 96, 200), (3, 64, 1500), (0, 64, 64)])
def test_silu_mul_rownorm_is_the_norm_then_the_projection(rows, hidden, inter, dtype, triton_on_cpu):
    """With an RMSNorm's weight folded into the gate/up weight, scaling the unnormalised projection by
    each row's RMS scale gives RMSNorm -> gate/up -> SiLU*mul: the kernel (interpreter) equals its torch
    twin, and both equal the unfolded composition within the dtype's rounding. 1,500 columns span two
    programs per row; a hidden size off a power of two masks the row's tail."""
    g = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    w = (torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    eps = 1e-6
    folded = (w.float() * norm_w.float()).to(dtype)
    got = fused_linear.silu_mul_rownorm(x @ folded.T, x, eps)
    twin = fused_linear.silu_mul_rownorm_reference(x @ folded.T, x, eps)
    x32 = x.float()
    h = (norm_w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)).to(dtype)
    unfolded = fused_linear.silu_mul_reference(h @ w.T)
    assert got.shape == (rows, inter) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, twin, rtol=tol, atol=tol)
    torch.testing.assert_close(got, unfolded, rtol=tol, atol=tol if dtype == torch.float32 else 6e-2)
    with pytest.raises(ValueError, match="gate_up must be"):
        fused_linear.silu_mul_rownorm(torch.zeros(2, 7), torch.zeros(2, 4), eps)


def test_rms_norm_reads_strided_views_in_place():
    """The q part of a fused q/k/v output, viewed per head, is a non-contiguous input to q_norm."""
    g = torch.Generator().manual_seed(4)
    y = torch.randn(1, 9, 4 * 16 + 2 * 2 * 16, generator=g)
    q = y[..., : 4 * 16].view(1, 9, 4, 16)
    assert not q.is_contiguous()
    weight = torch.randn(16, generator=g)
    got = fused_ops.rms_norm(q, weight, 1e-6)
    want = fused_ops.rms_norm(q.contiguous(), weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    x32 = q.contiguous()
    ref = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_modules_match_hf_modules(family, model_dirs, triton_on_cpu):
    ref, model = load_hf_fp32(model_dirs[family]), load_hf_fp32(model_dirs[family])
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fused_linear.fuse_linears(model) == (NUM_LAYERS, NUM_LAYERS)
    assert fused_linear.fuse_linears(model) == (0, 0)  # idempotent
    state_after = model.state_dict()
    assert state_after.keys() == state_before.keys()
    for k, v in state_before.items():
        assert torch.equal(state_after[k], v), k

    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 11, model.config.hidden_size, generator=g)
    with torch.no_grad():
        for layer_ref, layer in zip(ref.model.layers, model.model.layers):
            mlp, attn = layer.mlp, layer.self_attn
            # The original parameters are views into the fused weights (no second copy).
            assert mlp.gate_proj.weight.data_ptr() == mlp.bridge_gate_up_weight.data_ptr()
            assert attn.k_proj.weight.data_ptr() > attn.bridge_qkv_weight.data_ptr()
            assert (attn.q_proj.bias is not None) == (family == "qwen2")
            torch.testing.assert_close(mlp(x), layer_ref.mlp(x), rtol=1e-5, atol=1e-5)
            a_ref = layer_ref.self_attn
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            torch.testing.assert_close(q, a_ref.q_proj(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(k, a_ref.k_proj(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, a_ref.v_proj(x), rtol=1e-5, atol=1e-5)
            for part in (k, v):  # k and v came out of q_proj's one GEMM
                assert part.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
            # Another input (or k/v without a q first) takes the plain projection.
            x2 = x.clone()
            torch.testing.assert_close(attn.k_proj(x2), a_ref.k_proj(x2), rtol=1e-5, atol=1e-5)
            attn.q_proj(x)
            torch.testing.assert_close(attn.v_proj(x2), a_ref.v_proj(x2), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(attn.v_proj(x), a_ref.v_proj(x), rtol=1e-5, atol=1e-5)
        ids = torch.randint(5, model.config.vocab_size, (2, 13), generator=g)
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_unfusable_layouts_are_left_alone(model_dirs):
    model = load_hf_fp32(model_dirs["llama"])
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # not SiLU
    model.model.layers[1].self_attn.k_proj.bias = torch.nn.Parameter(torch.zeros(32))  # bias on k only
    assert fused_linear.fuse_linears(model) == (NUM_LAYERS - 1, NUM_LAYERS - 1)
    assert not hasattr(model.model.layers[0].mlp, "bridge_gate_up_weight")
    assert not hasattr(model.model.layers[1].self_attn, "bridge_qkv_weight")


@pytest.mark.parametrize("disabled", [False, True])
def test_model_runner_installs_fused_linears_with_the_fused_ops(model_dirs, disabled):
    path = model_dirs["qwen3"]
    runner = cpu_runner_with_fused_ops(path, **({"fused_linear": False} if disabled else {}))
    assert runner.num_fused_norms == NUM_LAYERS * 4 + 1
    assert runner.num_fused_linears == ((0, 0) if disabled else (NUM_LAYERS, NUM_LAYERS))


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_with_all_fused_ops_matches_hf(family, model_dirs, triton_on_cpu):
    ref = load_hf_fp32(model_dirs[family])
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(10, ref.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 30)]
    max_tokens = 8
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):]
                    .tolist() for p in prompts]

    llm = LLM(model_dirs[family], dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=32,
              max_num_seqs=4)
    model = llm.runner.model
    assert fused_ops.fuse_rmsnorms(model) > 0
    assert fused_ops.fuse_rotary(model)
    assert fused_linear.fuse_linears(model) == (NUM_LAYERS, NUM_LAYERS)
    llm.runner.capture_cuda_graphs(emulate=True)  # decode steps on fixed buffers, as the GPU replays them
    llm.decode_window = 3
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.runner.num_graph_replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_linears_on_cuda_bf16(family, model_dirs):
    """On the GPU (real Triton, cuBLAS): the fused model's bf16 logits stay within bf16 noise of HF's."""
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.bfloat16).cuda().eval()

    ref, model = load(), load()
    assert fused_linear.fuse_linears(model) == (NUM_LAYERS, NUM_LAYERS)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, model.config.vocab_size, (2, 37), generator=g).cuda()
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
        x = torch.randn(64, 2 * 3072, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(fused_linear.silu_mul(x), fused_linear.silu_mul_reference(x),
                                   rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)  # GEMM tiling differs: bf16 noise
