"""Every family in the capability table generates Hugging Face's greedy tokens through the engine.

Per family (tiny fp32 models built from the family's own config, sliding windows of 8 tokens): 8
prompts of 3..37 tokens, so most cross the window and decode runs far past it, with a 16-token step
budget (chunked prefill across the window edge) and a 20-block KV cache of 4-token blocks (preemption
and recompute). The same prompts go through token ids, `prompt_embeds` and a mixed batch of both,
each against HF `generate` (eager attention: the only HF path with Gemma 2's soft-capping). Also: the
README's capability table is the generated one, final-logit post-processing reaches logprobs, configs
with features the engine lacks are refused at `LLM(...)` before any weight loads, and an untested
decoder-only family warns once.
"""

from __future__ import annotations

import pathlib
import warnings

import pytest
import torch

from bridge.tiny_families import TINY_FAMILIES, build_family_model, family_config
from bridge.tiny_models import build_tokenizer
from runner.llm import LLM
from runner.sampling_params import SamplingParams
from runner.worker import model_states
from runner.worker.model_states import (
    FAMILY_MODEL_STATES,
    DefaultModelState,
    capability_table_markdown,
    resolve_model_state_cls,
)

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
PROMPT_LENS = (3, 5, 9, 12, 17, 23, 30, 37)
MAX_TOKENS = 10
WINDOW = 8
SLIDING_FAMILIES = ("mistral", "qwen2", "gemma2", "gemma3_text")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_models")
    return {f: build_family_model(root / f, f, seed=11, init_std=0.1) for f in TINY_FAMILIES}


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _prompts(vocab: int, hidden: int, embed_std: float):
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(12, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    embeds = [torch.randn(n, hidden, generator=g) * embed_std for n in PROMPT_LENS]
    return ids, embeds


@torch.no_grad()
def _hf_greedy(model, ids=None, embeds=None) -> list[int]:
    if ids is not None:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, len(ids):].tolist()
    mask = torch.ones(1, embeds.shape[0], dtype=torch.long)
    out = model.generate(inputs_embeds=embeds[None], attention_mask=mask, max_new_tokens=MAX_TOKENS,
                         do_sample=False)
    return out[0].tolist()


def _engine(path) -> LLM:
    return LLM(path, dtype="float32", device="cpu", enable_prompt_embeds=True, block_size=4, num_kv_blocks=20,
               max_num_batched_tokens=16, max_num_seqs=8)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_tokens_equal_hf_generate(family, family_dirs):
    path = family_dirs[family]
    ref = _hf(path)
    embed_std = float(ref.get_input_embeddings().weight.detach().std())
    ids, embeds = _prompts(ref.config.vocab_size, ref.config.hidden_size, embed_std)
    want_ids = [_hf_greedy(ref, ids=p) for p in ids]
    want_embeds = [_hf_greedy(ref, embeds=e) for e in embeds]

    llm = _engine(path)
    assert resolve_model_state_cls(llm.config) is FAMILY_MODEL_STATES[family]
    assert _tokens(llm, [{"prompt_token_ids": p} for p in ids]) == want_ids
    preempted = llm.stats().num_preemptions
    assert _tokens(llm, [{"prompt_embeds": e} for e in embeds]) == want_embeds
    mixed = [{"prompt_token_ids": ids[i]} if i % 2 else {"prompt_embeds": embeds[i]} for i in range(8)]
    want_mixed = [want_ids[i] if i % 2 else want_embeds[i] for i in range(8)]
    assert _tokens(llm, mixed) == want_mixed
    assert preempted > 0  # the 20-block cache cannot hold all eight requests at once
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_the_window_changes_hf_outputs(family, family_dirs):
    """The tiny models are sensitive to the window, so the greedy test above would catch a wrong one."""
    ref, full = _hf(family_dirs[family]), _hf(family_dirs[family])
    assert ref.config.sliding_window == WINDOW
    full.config.sliding_window = 10_000  # wider than any prompt: the same model without a window
    for layer in full.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 10_000
    ids = torch.randint(12, ref.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ref(ids).logits[0, WINDOW:] - full(ids).logits[0, WINDOW:]).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_logprobs_include_final_logit_post_processing(family, family_dirs):
    """Gemma 2 soft-caps its final logits and Granite divides them; the engine's logprobs are HF's."""
    ref = _hf(family_dirs[family])
    ids = list(range(20, 33))
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0, -1].float(), -1)
    llm = _engine(family_dirs[family])
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    for token, logprob in out.logprobs[0].items():
        assert abs(logprob - float(want[token])) < 1e-4


# -- capability table, refusals, untested families ----------------------------------------------------------


def test_readme_capability_table_is_the_generated_one():
    text = README.read_text()
    begin, end = "<!-- capability-table:begin -->\n", "<!-- capability-table:end -->"
    assert begin in text and end in text, "README lacks the capability-table markers"
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == capability_table_markdown(), (
        "regenerate: runner.worker.model_states.capability_table_markdown()")


def test_every_tested_family_has_a_model_state_and_the_fused_flag_matches_fused_layers(family_dirs):
    from runner.layers.fused_layers import FUSABLE_LAYER_CLASSES

    assert set(TINY_FAMILIES) == set(FAMILY_MODEL_STATES)
    for model_type, cls in FAMILY_MODEL_STATES.items():
        layer_cls = cls.hf_class.replace("ForCausalLM", "DecoderLayer")
        assert cls.supports_fused_layers == (layer_cls in FUSABLE_LAYER_CLASSES), model_type


def _config_only_dir(root: pathlib.Path, config) -> pathlib.Path:
    root.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(root)
    build_tokenizer().save_pretrained(root)
    return root  # no weights: a refusal that read them would fail on the missing file instead


@pytest.mark.parametrize(
    ("model_type", "overrides", "feature"),
    [
        ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional attention"),
        ("llama4_text", {}, "chunked local attention"),
        ("gpt_oss", {}, "attention sinks"),
        ("deepseek_v3", {}, "multi-head latent attention"),
        ("qwen3", {"num_hidden_layers": 2, "layer_types": ["full_attention", "chunked_attention"]},
         "layer type 'chunked_attention'"),
        ("falcon", {}, "attention-function interface"),
    ],
)
def test_configs_with_features_the_engine_lacks_are_refused_before_weights_load(
    tmp_path, model_type, overrides, feature
):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **overrides)
    path = _config_only_dir(tmp_path / model_type, config)
    with pytest.raises(ValueError) as info:
        LLM(path, device="cpu")
    message = str(info.value)
    assert repr(model_type) in message and feature in message


def test_untested_decoder_only_family_runs_with_a_one_time_warning(tmp_path):
    import transformers

    tok = build_tokenizer()
    config = transformers.Starcoder2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2, sliding_window=None, bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Starcoder2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model_states._WARNED_UNTESTED.discard("starcoder2")
    assert resolve_model_state_cls(config) is DefaultModelState
    with pytest.warns(UserWarning, match="'starcoder2' is not in Bridge's tested families"):
        llm = LLM(tmp_path, dtype="float32", device="cpu", num_kv_blocks=16)
    ids = [5, 17, 40, 41, 99]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, 5:].tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model type
        LLM(tmp_path, dtype="float32", device="cpu", num_kv_blocks=16)
    assert _tokens(llm, [{"prompt_token_ids": ids}])[0][:4] == want


def test_family_config_rejects_unknown_family():
    with pytest.raises(ValueError, match="unknown family"):
        family_config("nope", vocab_size=10)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_fused_decoder_layers_cover_sliding_window_layers(family, family_dirs, monkeypatch):
    """runner.layers.fused_layers runs Mistral's and Qwen2's window-8 layers (the kernel under
    TRITON_INTERPRET=1) and passes each layer's window to the paged attention: greedy tokens stay HF's."""
    from runner.layers import fused_layers, fused_linear

    monkeypatch.setattr(fused_layers, "FUSED_LAYERS_ON_CPU", True)
    monkeypatch.setattr(fused_linear, "SILU_MUL_ON_CPU", True)
    calls = []
    kernel = fused_layers.qkv_norm_rope_write
    monkeypatch.setattr(fused_layers, "qkv_norm_rope_write",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    path = family_dirs[family]
    ref = _hf(path)
    ids, _ = _prompts(ref.config.vocab_size, ref.config.hidden_size, 1.0)
    ids = ids[4:6]  # 17 and 23 tokens: both cross the window; a 32-token budget chunks the second
    want = [_hf_greedy(ref, ids=p)[:4] for p in ids]
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
    fused_linear.fuse_linears(llm.runner.model)
    assert fused_layers.fuse_decoder_layers(llm.runner.model) == 2
    windows = [fused_layers.layer_sliding_window(layer.self_attn) for layer in llm.runner.model.model.layers]
    assert windows == ([WINDOW, WINDOW] if family == "mistral" else [None, WINDOW])
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=4, temperature=0.0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len(calls) == 2 * llm.runner.num_forward_steps  # every layer of every step took the fused path


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_prefix_caching_with_sliding_windows_keeps_hf_tokens(family, family_dirs):
    """The cache keeps every key, so a cached prefix serves windowed layers as it serves full ones."""
    ref = _hf(family_dirs[family])
    ids, _ = _prompts(ref.config.vocab_size, ref.config.hidden_size, 1.0)
    first, second = ids[7], ids[7][:28] + ids[3]  # 37 tokens, then 28 of them + 12 new
    want = [_hf_greedy(ref, ids=p) for p in (first, second)]
    llm = LLM(family_dirs[family], dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    assert _tokens(llm, [{"prompt_token_ids": first}]) == want[:1]
    assert _tokens(llm, [{"prompt_token_ids": second}]) == want[1:]
    assert llm.block_manager.num_hit_blocks == 7  # the 28 shared tokens
