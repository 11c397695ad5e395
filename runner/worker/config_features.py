"""What a model's config says about it: its family kind and the features the engine would need.

Read from config.json alone (a transformers config or the raw dict), so `LLM(...)` can decide what
a model is, and refuse what the engine lacks, before any weight loads. `runner.worker.model_states`
turns these facts into model-state classes and errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from runner.hf_config import text_config as _text_config

# -- config inspection -------------------------------------------------------------------------------------

ENCODER_ONLY_MODEL_TYPES = frozenset(
    {
        "bert", "roberta", "xlm-roberta", "xlm_roberta", "distilbert", "albert", "electra", "deberta",
        "deberta-v2", "camembert", "modernbert", "mpnet", "ernie", "nomic_bert", "xlm-roberta-xl",
        "roformer", "megatron-bert", "convbert", "squeezebert", "mobilebert", "funnel", "layoutlm",
    }
)  # fmt: skip
# Architectures suffixes of heads that sit on an encoder and never generate.
ENCODER_ONLY_ARCH_SUFFIXES = (
    "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
    "ForMultipleChoice", "ForPreTraining", "ForNextSentencePrediction",
)  # fmt: skip
GENERATIVE_ARCH_MARKERS = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
HYBRID_MODEL_TYPES = frozenset(
    {
        "bamba", "jamba", "qwen3_next", "falcon_h1", "granitemoehybrid", "lfm2", "lfm2_moe", "lfm2_vl",
        "nemotron_h", "zamba", "zamba2", "mamba", "mamba2", "falcon_mamba", "recurrent_gemma", "rwkv",
        "plamo2", "minimax", "kimi_linear", "qwen3_5", "qwen3_5_moe",
    }
)  # fmt: skip
# Layer types that carry recurrent / convolutional state instead of (only) a KV cache.
HYBRID_LAYER_TYPES = frozenset(
    {"linear_attention", "mamba", "mamba2", "conv", "short_conv", "hybrid", "recurrent", "ssm", "rwkv"}
)
MROPE_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"})


def _get(config: Any, name: str, default: Any = None) -> Any:
    """Attribute of a transformers config, or key of a config.json dict."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _model_type(config: Any) -> str:
    return str(_get(config, "model_type", None) or "<unknown model_type>")


def _hybrid_layer_evidence(text_config: Any) -> str | None:
    """Which config field says some layer is not plain attention, or None."""
    for field_name in ("layer_types", "layers_block_type", "block_types"):
        values = _get(text_config, field_name, None)
        if isinstance(values, (list, tuple)):
            kinds = sorted({str(v) for v in values} & HYBRID_LAYER_TYPES)
            if kinds:
                return f"{field_name} contains {kinds}"
    pattern = _get(text_config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and "M" in pattern:
        return f"hybrid_override_pattern {pattern!r} has mamba ('M') layers"
    return None


def _uses_mrope(text_config: Any) -> bool:
    for field_name in ("rope_parameters", "rope_scaling"):
        rope = _get(text_config, field_name, None)
        if isinstance(rope, Mapping) and (
            "mrope_section" in rope or rope.get("type") == "mrope" or rope.get("rope_type") == "mrope"
        ):
            return True
    return False


def _is_encoder_only(config: Any) -> bool:
    architectures = [str(a) for a in (_get(config, "architectures", None) or [])]
    if any(marker in a for a in architectures for marker in GENERATIVE_ARCH_MARKERS):
        return False
    if _get(config, "is_decoder", False) and architectures:
        return False
    if _model_type(config) in ENCODER_ONLY_MODEL_TYPES:
        return True
    return bool(architectures) and all(a.endswith(ENCODER_ONLY_ARCH_SUFFIXES) for a in architectures)


# -- model states -------------------------------------------------------------------------------------------


# -- features the engine lacks, read from the config --------------------------------------------------------

# Layer kinds the paged attention serves (hybrid kinds are `HybridModelState`'s business).
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Families whose attention needs something the config does not spell out.
_MODEL_TYPE_FEATURES: dict[str, tuple[str, str]] = {
    "gpt_oss": ("attention sinks", "learned per-head sink logits join every softmax; the paged kernels "
                "have no sink term"),
    "llama4": ("chunked local attention", "chunked-attention layers and no-rope layers are not "
               "implemented in the paged attention path"),
    "llama4_text": ("chunked local attention", "chunked-attention layers and no-rope layers are not "
                    "implemented in the paged attention path"),
}


def unsupported_config_feature(config: Any) -> tuple[str, str] | None:
    """(feature, why) for the first attention variant or layer type in `config` that the engine lacks.

    Read from the config alone, so `LLM(...)` refuses the model before any weight loads rather than
    failing inside a forward pass.
    """
    text = _text_config(config)
    for cfg in (config, text):
        found = _MODEL_TYPE_FEATURES.get(_model_type(cfg))
        if found is not None:
            return found
    layer_types = _get(text, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        unknown = sorted({str(t) for t in layer_types} - SUPPORTED_LAYER_TYPES - HYBRID_LAYER_TYPES)
        if unknown:
            return (f"layer type {unknown[0]!r}",
                    f"the paged attention path serves {sorted(SUPPORTED_LAYER_TYPES)}")
    if _get(text, "attention_chunk_size", None):
        return ("chunked local attention (attention_chunk_size)", "the paged attention path masks by "
                "sliding window or causally, not by chunk")
    if _get(text, "use_bidirectional_attention", False):
        return ("bidirectional attention (use_bidirectional_attention)", "the paged attention path is causal")
    if _get(text, "kv_lora_rank", None):
        return ("multi-head latent attention (kv_lora_rank)", "the paged KV cache holds per-head keys and "
                "values, not a compressed latent")
    head_dim = _get(text, "head_dim", None)
    v_head_dim = _get(text, "v_head_dim", None)
    if v_head_dim is not None and head_dim is not None and v_head_dim != head_dim:
        return (f"value head_dim {v_head_dim} != query/key head_dim {head_dim}", "the paged KV cache "
                "stores keys and values with one head_dim")
    if _get(text, "alibi", False) or _get(_get(text, "attn_config", None) or {}, "alibi", False):
        return ("ALiBi position biases", "the paged attention kernels add no position bias")
    if not isinstance(config, Mapping):
        uses_interface = _uses_attention_interface(config)
        if uses_interface is False:
            return ("the attention-function interface", "its attention layers do not call transformers' "
                    "AttentionInterface, so the paged attention ('bridge_paged') cannot run them")
    return None


def _uses_attention_interface(config: Any) -> bool | None:
    """Whether the config's causal-LM class dispatches attention through `AttentionInterface`; None if
    transformers maps no causal-LM class to it. Imports the modeling module, reads no weights."""
    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ImportError, ValueError, AttributeError):
        return None
    return bool(getattr(model_cls, "_supports_attention_backend", False))
