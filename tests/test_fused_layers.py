"""The fused decoder-layer forward (runner.layers.fused_layers) computes what Hugging Face's layers compute.

The new kernel (q/k norm + rotary + KV-cache write) against a torch reference under
TRITON_INTERPRET; the engine's greedy tokens with fused layers (chunked prefill, emulated decode
graphs, decode windows) equal HF `generate` on tiny fp32 llama / qwen2 / qwen3 models; outside a
Bridge forward the layers run HF's own forward; layouts the fused forward does not cover are left alone.
"""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_runner_with_fused_ops, gpu_tokens_and_logprobs, load_hf_fp32

from bridge.tiny_models import build_tiny_model
from runner.layers import fused_layers, fused_linear
from runner.llm import LLM
from runner.sampling_params import SamplingParams

FAMILIES = ("llama", "qwen2", "qwen3")
NUM_LAYERS = 2

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_layer_models")
    return {f: build_tiny_model(root / f, f, seed=7, num_layers=NUM_LAYERS) for f in FAMILIES}


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    original = fused_layers.qkv_norm_rope_write

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_layers, "qkv_norm_rope_write", counting)
    return calls


def _reference(qkv, hq, hkv, cos, sin, qk_norm):
    """HF's arithmetic: per-head RMSNorm (rounded to the input dtype, times the weight), rotary in fp32."""
    t, d = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    if qk_norm is not None:
        qw, kw, eps = qk_norm

        def norm(x, w):
            x32 = x.float()
            return (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)

        q, k = norm(q, qw), norm(k, kw)

    def rope(x):
        x32, c, s = x.float(), cos.float()[:, None], sin.float()[:, None]
        rot = torch.cat([-x32[..., d // 2 :], x32[..., : d // 2]], dim=-1)
        return (x32 * c + rot * s).to(x.dtype)

    return rope(q), rope(k), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qkv_norm_rope_write_matches_reference(dtype, with_norm):
    g = torch.Generator().manual_seed(11)
    t, hq, hkv, d, block_size, num_blocks = 6, 4, 2, 16, 4, 5
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    angles = torch.randn(t, d // 2, generator=g)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    qk_norm = None
    if with_norm:
        qw, kw = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
        qk_norm = (qw, kw, 1e-6)
    slots = torch.tensor([3, 17, -1, 0, 9, 12])  # -1: a padding row writes nothing
    sentinel = 7.0
    key_cache = torch.full((num_blocks, block_size, hkv, d), sentinel, dtype=dtype)
    value_cache = torch.full_like(key_cache, sentinel)

    q = fused_layers.qkv_norm_rope_write(qkv, hq, hkv, cos, sin, key_cache, value_cache, slots, qk_norm)
    want_q, want_k, want_v = _reference(qkv, hq, hkv, cos, sin, qk_norm)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    flat_k, flat_v = key_cache.view(-1, hkv, d), value_cache.view(-1, hkv, d)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        torch.testing.assert_close(flat_k[slot], want_k[row], rtol=tol, atol=tol)
        torch.testing.assert_close(flat_v[slot], want_v[row], rtol=0, atol=0)  # v is only copied
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (flat_k[untouched] == sentinel).all() and (flat_v[untouched] == sentinel).all()


@pytest.mark.parametrize("with_norm", [False, True])
def test_qkv_norm_rope_write_row_scale_is_the_projection_of_the_normalised_row(with_norm):
    """`row_scale=(x, eps)`: the rows of an unnormalised projection scaled by rsqrt(mean(x**2) + eps) of
    their input rows give what the scaled projection gives without it (q, k and v)."""
    g = torch.Generator().manual_seed(13)
    t, hq, hkv, d, hidden = 5, 4, 2, 16, 40
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    x = torch.randn(t, hidden, generator=g) * 3
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    angles = torch.randn(t, d // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    weights = torch.rand(2, d, generator=g) + 0.5
    qk_norm = (weights[0], weights[1], 1e-6) if with_norm else None
    slots = torch.tensor([3, 17, -1, 0, 9])
    caches = [torch.zeros(5, 4, hkv, d) for _ in range(4)]
    q = fused_layers.qkv_norm_rope_write(qkv, hq, hkv, cos, sin, caches[0], caches[1], slots, qk_norm,
                                         row_scale=(x, 1e-6))
    want = fused_layers.qkv_norm_rope_write(qkv * r, hq, hkv, cos, sin, caches[2], caches[3], slots, qk_norm)
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], caches[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1], caches[3], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="row_scale"):
        fused_layers.qkv_norm_rope_write(qkv, hq, hkv, cos, sin, caches[0], caches[1], slots, qk_norm,
                                         row_scale=(x[:2], 1e-6))
    wide = torch.zeros(t, fused_linear.ROWNORM_MAX_HIDDEN + 1)  # wider than a program holds
    with pytest.raises(ValueError, match="row_scale"):
        fused_layers.qkv_norm_rope_write(qkv, hq, hkv, cos, sin, caches[0], caches[1], slots, qk_norm,
                                         row_scale=(wide, 1e-6))


def test_qkv_norm_rope_write_rejects_bad_shapes():
    kc = torch.zeros(2, 4, 2, 16)
    cos = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="qkv must be"):
        fused_layers.qkv_norm_rope_write(torch.zeros(3, 100), 4, 2, cos, cos, kc, kc.clone(), torch.zeros(3))
    with pytest.raises(ValueError, match="cos/sin"):
        fused_layers.qkv_norm_rope_write(torch.zeros(3, 128), 4, 2, cos[:2], cos[:2], kc, kc.clone(),
                                         torch.zeros(3))


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_with_fused_layers_matches_hf(family, model_dirs, fused_on_cpu, kernel_calls):
    ref = load_hf_fp32(model_dirs[family])
    g = torch.Generator().manual_seed(23)
    prompts = [torch.randint(10, ref.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 30, 9)]
    max_tokens = 8
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):]
                    .tolist() for p in prompts]

    # A 32-token budget chunks the 30-token prompt and mixes prefill with decode rows.
    llm = LLM(model_dirs[family], dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=32,
              max_num_seqs=4)
    model = llm.runner.model
    assert fused_linear.fuse_linears(model) == (NUM_LAYERS, NUM_LAYERS)
    assert fused_layers.fuse_decoder_layers(model) == NUM_LAYERS
    assert fused_layers.fuse_decoder_layers(model) == 0  # idempotent
    llm.runner.capture_cuda_graphs(emulate=True)  # decode steps on fixed, padded buffers
    llm.decode_window = 3
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.runner.num_graph_replays > 0
    assert len(kernel_calls) >= NUM_LAYERS * llm.runner.num_forward_steps  # every layer, every step, fused
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_folded_into_the_projections_keep_the_model(family, model_dirs, fused_on_cpu, monkeypatch):
    """Both RMSNorms' weights folded into the merged projections after them (as on CUDA; the input norm
    only where q/k/v have no bias, so not qwen2's): the norms' weights are ones, the projections view the
    folded rows, HF's own forward gives the same logits within fp32 rounding, and the engine (every step
    through `silu_mul_rownorm` and the row-scaled q/k/v epilogue) still produces HF's greedy tokens."""
    monkeypatch.setattr(fused_layers, "FOLD_ON_CPU", True)
    ref = load_hf_fp32(model_dirs[family])
    g = torch.Generator().manual_seed(29)
    prompts = [torch.randint(10, ref.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 30)]
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]
    input_folded = family != "qwen2"

    model = load_hf_fp32(model_dirs[family])
    fused_linear.fuse_linears(model)
    assert fused_layers.fuse_decoder_layers(model) == NUM_LAYERS
    for layer, ref_layer in zip(model.model.layers, ref.model.layers):
        assert layer.bridge_post_norm_folded
        assert getattr(layer, "bridge_input_norm_folded", False) == input_folded
        pairs = [(layer.post_attention_layernorm, ref_layer.post_attention_layernorm, layer.mlp.gate_proj,
                  ref_layer.mlp.gate_proj)]
        if input_folded:
            pairs.append((layer.input_layernorm, ref_layer.input_layernorm, layer.self_attn.k_proj,
                          ref_layer.self_attn.k_proj))
        for norm, ref_norm, proj, ref_proj in pairs:
            assert torch.equal(norm.weight, torch.ones_like(norm.weight))
            torch.testing.assert_close(proj.weight, ref_proj.weight * ref_norm.weight)
        rows = layer.mlp.gate_proj.weight.shape[0]
        assert layer.mlp.up_proj.weight.data_ptr() == layer.mlp.bridge_gate_up_weight[rows:].data_ptr()
    ids = torch.randint(5, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)

    llm = LLM(model_dirs[family], dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=32,
              max_num_seqs=4)
    runner_model = llm.runner.model
    fused_linear.fuse_linears(runner_model)
    assert fused_layers.fuse_decoder_layers(runner_model) == NUM_LAYERS
    calls = {"silu": [], "qkv": []}
    silu, qkv = fused_layers.silu_mul_rownorm, fused_layers.qkv_norm_rope_write
    monkeypatch.setattr(fused_layers, "silu_mul_rownorm", lambda *a: calls["silu"].append(1) or silu(*a))
    monkeypatch.setattr(fused_layers, "qkv_norm_rope_write",
                        lambda *a, **k: calls["qkv"].append(k.get("row_scale") is not None) or qkv(*a, **k))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(calls["silu"]) >= NUM_LAYERS * llm.runner.num_forward_steps
    assert calls["qkv"] and all(scaled == input_folded for scaled in calls["qkv"])


def test_norms_stay_unfolded_off_cuda_and_with_the_switch_off(model_dirs, fused_on_cpu, monkeypatch):
    model = load_hf_fp32(model_dirs["qwen3"])
    fused_linear.fuse_linears(model)
    fused_layers.fuse_decoder_layers(model)  # CPU weights: no fold (FOLD_ON_CPU is off)
    folded = ("bridge_post_norm_folded", "bridge_input_norm_folded")
    assert not any(hasattr(layer, a) for layer in model.model.layers for a in folded)
    monkeypatch.setattr(fused_layers, "FOLD_ON_CPU", True)
    monkeypatch.setattr(fused_layers, "FOLD_NORMS", False)
    model = load_hf_fp32(model_dirs["qwen3"])
    fused_linear.fuse_linears(model)
    fused_layers.fuse_decoder_layers(model)
    assert not any(hasattr(layer, a) for layer in model.model.layers for a in folded)
    monkeypatch.setattr(fused_layers, "FOLD_NORMS", True)
    monkeypatch.setattr(fused_layers, "ROWNORM_MAX_HIDDEN", model.config.hidden_size - 1)  # rows too wide
    model = load_hf_fp32(model_dirs["qwen3"])
    fused_linear.fuse_linears(model)
    fused_layers.fuse_decoder_layers(model)
    assert not any(hasattr(layer, a) for layer in model.model.layers for a in folded)


@pytest.mark.parametrize("family", FAMILIES)
def test_outside_a_bridge_forward_layers_run_hf_forward(family, model_dirs, fused_on_cpu, kernel_calls):
    ref, model = load_hf_fp32(model_dirs[family]), load_hf_fp32(model_dirs[family])
    fused_linear.fuse_linears(model)
    assert fused_layers.fuse_decoder_layers(model) == NUM_LAYERS
    ids = torch.randint(5, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert kernel_calls == []


def test_layouts_the_fused_forward_does_not_cover_are_left_alone(model_dirs):
    model = load_hf_fp32(model_dirs["qwen3"])
    assert fused_layers.fuse_decoder_layers(model) == 0  # projections not merged yet
    fused_linear.fuse_linears(model)
    model.model.layers[0].self_attn.k_norm.variance_epsilon = 1e-3  # the kernel norms q and k with one eps
    assert fused_layers.fuse_decoder_layers(model) == NUM_LAYERS - 1
    assert not hasattr(model.model.layers[0], "bridge_original_forward")


@pytest.mark.parametrize("disabled", [False, True])
def test_model_runner_installs_fused_layers(model_dirs, disabled):
    path = model_dirs["qwen3"]
    runner = cpu_runner_with_fused_ops(path, **({"fused_layers": False} if disabled else {}))
    assert runner.num_fused_layers == (0 if disabled else NUM_LAYERS)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_on_cuda_bf16_match_unfused(family, model_dirs):
    """On the GPU: prompt logprobs (eager prefill) and greedy decode (CUDA graphs) with fused layers
    stay within bf16 noise of the engine without them."""
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + 3 * i))} for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0, logprobs=0)

    def run(fused: bool):
        llm = LLM(model_dirs[family], dtype="bfloat16", device="cuda", num_kv_blocks=64, max_num_seqs=8,
                  fused_layers=fused)
        assert llm.runner.num_fused_layers == (NUM_LAYERS if fused else 0)
        return llm.generate(prompts, params, use_tqdm=False)

    got, want = run(True), run(False)
    for a, b in zip(got, want):
        pa = [next(iter(d.values())) for d in a.prompt_logprobs[1:]]
        pb = [next(iter(d.values())) for d in b.prompt_logprobs[1:]]
        torch.testing.assert_close(torch.tensor(pa), torch.tensor(pb), rtol=0.05, atol=0.05)
        first_a = a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]]
        first_b = b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]]
        assert abs(first_a - first_b) < 0.05


@pytest.mark.parametrize("in_place", [True, False])
def test_each_layer_adds_o_proj_into_its_predecessors_output_never_into_the_embeddings(
        model_dirs, fused_on_cpu, monkeypatch, in_place):
    """A fused layer's o_proj accumulates in place into the hidden states the previous fused layer returned
    (no copy of the residual first), layer 0 copies (its input is the embeddings, which stay untouched),
    and the greedy tokens equal HF's either way (RESIDUAL_IN_PLACE off)."""
    path = model_dirs["qwen3"]
    ref = load_hf_fp32(path)
    embeds = [ref.get_input_embeddings()(torch.tensor(p)).detach().clone()
              for p in ([5, 6, 7, 8], list(range(20, 37)))]
    kept = [e.clone() for e in embeds]
    with torch.no_grad():
        expected = [ref.generate(inputs_embeds=e[None], max_new_tokens=5, do_sample=False)[0].tolist()
                    for e in embeds]
    o_proj_calls, o_projs = [], set()
    original = fused_layers._linear_plus_residual

    def spying(residual, x, linear, inplace=False):
        if id(linear) in o_projs:
            o_proj_calls.append(inplace)
        return original(residual, x, linear, inplace)

    monkeypatch.setattr(fused_layers, "_linear_plus_residual", spying)
    monkeypatch.setattr(fused_layers, "RESIDUAL_IN_PLACE", in_place)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4,
              enable_prompt_embeds=True)
    model = llm.runner.model
    fused_linear.fuse_linears(model)
    fused_layers.fuse_decoder_layers(model)
    o_projs.update(id(layer.self_attn.o_proj) for layer in model.model.layers)
    outs = llm.generate([{"prompt_embeds": e} for e in embeds],
                        SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(torch.equal(e, k) for e, k in zip(embeds, kept))
    steps = llm.runner.num_forward_steps
    assert len(o_proj_calls) == NUM_LAYERS * steps
    # per step: layer 0 copies, layer 1 (NUM_LAYERS = 2) writes its input in place when switched on
    assert o_proj_calls == [False, in_place] * steps


@pytest.mark.gpu
@pytest.mark.parametrize("requests", [8, 48])
def test_gpu_residual_in_place_is_bitwise_the_copying_engine(tiny_model_root, monkeypatch, requests):
    """On the GPU (CUDA graphs, decode windows; 8 requests take the PDL o_proj kernel where PDL runs, 48
    cuBLAS's addmm): adding o_proj into the previous layer's output in place gives bitwise the tokens and
    logprobs of the engine that copies it first (the same GEMM, only where its result goes differs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = build_tiny_model(tiny_model_root / "in_place_gpu_qwen3", "qwen3", seed=12, head_dim=64,
                            num_layers=3)
    prompts = [{"prompt_token_ids": [(5 * i + j) % 200 + 3 for j in range(4 + i % 30)]}
               for i in range(requests)]
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True)
    runs = {}
    for in_place in (True, False):
        monkeypatch.setattr(fused_layers, "RESIDUAL_IN_PLACE", in_place)
        runs[in_place] = gpu_tokens_and_logprobs(path, prompts, params)
    assert runs[True] == runs[False]
