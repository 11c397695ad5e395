"""Tiny model directories of every family in Bridge's capability table, built from a config in code.

`bridge.tiny_models` builds the families the rest of the test suite leans on (llama, qwen2, qwen3,
qwen2_vl) with their full option set. This module covers the wider set the family tests and the
family benchmark need: each family's own transformers config class with the features that make it
different switched on (Mistral's sliding window on every layer, Qwen2's sliding window above
`max_window_layers`, Gemma 2's interleaved local/global layers with logit soft-capping and
`query_pre_attn_scalar`, Granite's multipliers, a few experts for the MoE families). Shapes come
from the caller, so the same builder writes a hidden-64 test model and a 7B-shaped benchmark model.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from bridge.tiny_models import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, build_tokenizer

# Family -> (config class name, causal-LM class name, family-specific config fields).
# The window is small (8) so prompts of a few dozen tokens cross it and decode runs far past it.
FAMILY_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "decoder_sparse_step": 1, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 3.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    {"sliding_window": 8, "layer_types": None, "sliding_window_pattern": 2,
                     "query_pre_attn_scalar": 24, "final_logit_softcapping": 3.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {"embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.7,
                 "attention_multiplier": 0.2}),
}
TINY_FAMILIES: tuple[str, ...] = tuple(FAMILY_SPECS)
# Families whose config takes `head_dim` (the others derive it as hidden_size / num_attention_heads).
_HAS_HEAD_DIM_FIELD = frozenset({"llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma2",
                                 "gemma3_text", "granite"})


def family_config(family: str, *, vocab_size: int, hidden_size: int = 64, num_layers: int = 2,
                  num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                  intermediate_size: int = 128, max_position_embeddings: int = 1024,
                  token_ids: dict[str, int] | None = None, **overrides: Any):
    """The family's transformers config with its distinguishing features on; `overrides` win."""
    import transformers

    if family not in FAMILY_SPECS:
        raise ValueError(f"unknown family {family!r}; choose one of {TINY_FAMILIES}")
    config_name, _, extra = FAMILY_SPECS[family]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False, **(token_ids or {}),
    )
    if family in _HAS_HEAD_DIM_FIELD:
        kwargs["head_dim"] = head_dim
    kwargs.update(extra)
    kwargs.update(overrides)
    if kwargs.get("layer_types", 0) is None:
        kwargs.pop("layer_types")
    config = getattr(transformers, config_name)(**kwargs)
    return config


def build_family_model(path: str | pathlib.Path, family: str, *, seed: int = 0,
                       dtype: torch.dtype = torch.float32, init_std: float | None = None,
                       device: str | torch.device = "cpu", **config_kwargs: Any) -> pathlib.Path:
    """Write a loadable directory (config, random weights, tokenizer) of `family`; returns its path.

    `init_std` widens the weights' normal init (transformers' default 0.02 makes every logit nearly
    equal, so greedy tokens of a tiny model would hinge on rounding). Weights are drawn in a forked
    RNG seeded by `seed`: the same arguments give the same weights. `vocab_size` may be given to model a
    real checkpoint's LM head (default: the tokenizer's size); `device` and `dtype` are where and in what
    the weights are drawn (a 7B-shaped benchmark model is initialised on the GPU in bf16).
    """
    import transformers

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    token_ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    }
    if init_std is not None:
        config_kwargs["initializer_range"] = init_std
    vocab_size = config_kwargs.pop("vocab_size", len(tokenizer))
    config = family_config(family, vocab_size=vocab_size, token_ids=token_ids, **config_kwargs)
    model_cls = getattr(transformers, FAMILY_SPECS[family][1])
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            model = model_cls(config)
        finally:
            torch.set_default_dtype(default_dtype)
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    model.generation_config = transformers.GenerationConfig(**token_ids)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
