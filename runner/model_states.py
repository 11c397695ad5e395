"""Model states: what the runner can do with a model family, decided from its config alone.

Shaped like vLLM's `v1/worker/gpu/model_states/`: one class per family, with class-level capability
flags. `resolve_model_state_cls(config)` picks the class before anything is built, and
`ModelState.check_supported(...)` turns an unsupported combination into a `ValueError` that names the
model type, the feature and why, at `LLM(...)` construction, before a single weight is read
(`load_hf_config` reads config.json only). Failing there, rather than deep inside a forward pass,
is the point: a user with a T5, a Mamba hybrid or a BERT directory learns in milliseconds that prompt
embeddings cannot work with it, and why.

Families:

- `DefaultModelState`: decoder-only causal LMs. The families Bridge tests against Hugging Face each have
  a subclass (`LlamaModelState`, `Gemma2ModelState`, ...; `FAMILY_MODEL_STATES`) whose flags make the
  README's capability table (`capability_table_markdown`); a decoder-only family without one runs with a
  one-time warning that it is untested.
- `MRopeModelState`: Qwen2-VL-family text models; positions are 3-D (`compute_mrope_positions`).
- `EncoderDecoderModelState`: `config.is_encoder_decoder` (t5, bart, whisper) or a text config with
  cross-attention layers (mllama).
- `HybridModelState`: any linear-attention / mamba / conv / hybrid layer (bamba, jamba, qwen3_next, ...).
- `EncoderOnlyModelState`: bert, roberta, ... (no causal LM head).
"""

from __future__ import annotations

import json
import pathlib
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

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


def _text_config(config: Any) -> Any:
    """The decoder's text config of a composite (VLM) config, else the config itself."""
    if isinstance(config, Mapping):
        sub = config.get("text_config")
        return sub if isinstance(sub, Mapping) else config
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return config


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


class ModelState:
    """Capabilities of a model family (class-level flags) plus the config of one loaded model.

    Flags, all class-level so that they can be checked before anything is built:
    `supports_generation` (the runner can run this family at all), `supports_prompt_embeds`,
    `supports_mm_inputs` (media items and passthrough "prompt_embeds" items), `supports_realtime`
    (decode-step embeddings streamed into a live request), `supports_async_scheduling_with_mm`,
    `supports_prompt_logprobs_with_embeds`, `uses_mrope`, and the family markers `is_encoder_decoder`,
    `is_hybrid`, `is_encoder_only`. `family` and `unsupported_reason` feed the error messages.
    Engine paths, for the capability table: `supports_cuda_graphs` (decode steps replay captured graphs),
    `supports_fused_layers` (`runner.fused_layers` runs its decoder layers on the GPU),
    `supports_prefix_caching`; `tested` (the family's greedy tokens are checked against Hugging Face in
    the test suite) and `attention` (its attention variant, in words).
    """

    family: ClassVar[str] = "decoder-only"
    unsupported_reason: ClassVar[str] = ""
    supports_generation: ClassVar[bool] = True
    supports_prompt_embeds: ClassVar[bool] = True
    supports_mm_inputs: ClassVar[bool] = True
    supports_realtime: ClassVar[bool] = True
    supports_async_scheduling_with_mm: ClassVar[bool] = False
    supports_prompt_logprobs_with_embeds: ClassVar[bool] = False
    uses_mrope: ClassVar[bool] = False
    is_encoder_decoder: ClassVar[bool] = False
    is_hybrid: ClassVar[bool] = False
    is_encoder_only: ClassVar[bool] = False
    supports_cuda_graphs: ClassVar[bool] = True
    supports_fused_layers: ClassVar[bool] = False
    supports_prefix_caching: ClassVar[bool] = True
    tested: ClassVar[bool] = False
    attention: ClassVar[str] = "causal"

    def __init__(self, config: Any) -> None:
        self.config = config
        self.text_config = _text_config(config)
        self.model_type = _model_type(config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_type={self.model_type!r})"

    @classmethod
    def _fail(cls, config: Any, feature: str, why: str) -> ValueError:
        return ValueError(
            f"model type {_model_type(config)!r} ({cls.family} model) does not support {feature}: {why}"
        )

    @classmethod
    def check_supported(
        cls,
        config: Any,
        *,
        enable_prompt_embeds: bool,
        prompt_logprobs: bool = False,
        async_scheduling: bool | None = None,
        has_mm: bool = False,
        realtime: bool = False,
    ) -> bool:
        """Raise `ValueError` (model type, feature, reason) for a combination the runner cannot serve.

        Call it at `LLM(...)` construction with the engine's settings, and again per request with
        `enable_prompt_embeds` = "this prompt carries embeddings" and `prompt_logprobs` = "it asks for
        prompt logprobs". `has_mm`: prompts may carry `multi_modal_data` (media or passthrough
        "prompt_embeds" items). `realtime`: a realtime (streaming) encoder is registered.

        Returns whether async scheduling should be on: `async_scheduling` when given and allowed;
        when left at None, True unless the combination is unsupported, in which case it is turned off
        with a warning. Explicitly asking for an unsupported combination is a `ValueError`.
        """
        if enable_prompt_embeds and not cls.supports_prompt_embeds:
            raise cls._fail(config, "prompt embeddings (enable_prompt_embeds=True)", cls.unsupported_reason)
        if not cls.supports_generation:
            raise cls._fail(config, "generation in Bridge's runner", cls.unsupported_reason)
        missing = unsupported_config_feature(config)
        if missing is not None:
            feature, why = missing
            raise cls._fail(config, feature, why)
        if not cls.tested:
            _warn_untested_once(config)
        if has_mm and not cls.supports_mm_inputs:
            raise cls._fail(config, "multimodal inputs", cls.unsupported_reason)
        if realtime and not cls.supports_realtime:
            raise cls._fail(
                config,
                "realtime (streamed, decode-step) embeddings",
                "rows streamed into a live request would need positions this model state cannot assign "
                "after the prompt (3-D M-RoPE grids are fixed when the prompt is built)"
                if cls.uses_mrope
                else cls.unsupported_reason or "the model state does not gather embeddings in decode steps",
            )
        if prompt_logprobs and enable_prompt_embeds and not cls.supports_prompt_logprobs_with_embeds:
            raise cls._fail(
                config,
                "prompt_logprobs for a prompt-embeds prompt",
                "positions that carry embeddings have no token id, so there is no prompt token whose "
                "log-probability could be reported; ask for prompt_logprobs on token prompts only",
            )
        if has_mm and not cls.supports_async_scheduling_with_mm:
            why = (
                "scheduling step n+1 while step n runs needs the encoder-cache gather and the "
                "prompt-embeds overlay of step n+1 to be known before step n's sampled tokens are; "
                "Bridge's runner does not overlap them yet"
            )
            if async_scheduling:
                raise cls._fail(config, "async scheduling with multimodal prompt embeddings", why)
            if async_scheduling is None:
                warnings.warn(
                    f"async scheduling turned off for model type {_model_type(config)!r}: multimodal "
                    f"prompt embeddings are enabled and {why}",
                    stacklevel=2,
                )
            return False
        return True if async_scheduling is None else bool(async_scheduling)


class DefaultModelState(ModelState):
    """Decoder-only causal LMs: everything Bridge offers. Used as is for a family not in the table."""


# -- tested families: one class each; their flags are the README's capability table ---------------------


class FamilyModelState(DefaultModelState):
    """A decoder-only family whose greedy tokens tests/test_families.py checks against Hugging Face.

    `model_types`: the config `model_type`s it covers; `hf_class`: the causal-LM class that loads it.
    """

    tested = True
    model_types: ClassVar[tuple[str, ...]] = ()
    hf_class: ClassVar[str] = ""


class LlamaModelState(FamilyModelState):
    model_types = ("llama",)
    hf_class = "LlamaForCausalLM"
    supports_fused_layers = True


class MistralModelState(FamilyModelState):
    model_types = ("mistral",)
    hf_class = "MistralForCausalLM"
    supports_fused_layers = True
    attention = "sliding window (every layer)"


class Qwen2ModelState(FamilyModelState):
    model_types = ("qwen2",)
    hf_class = "Qwen2ForCausalLM"
    supports_fused_layers = True
    attention = "causal; sliding window above `max_window_layers` (`use_sliding_window`)"


class Qwen3ModelState(FamilyModelState):
    model_types = ("qwen3",)
    hf_class = "Qwen3ForCausalLM"
    supports_fused_layers = True
    attention = "causal, q/k norm"


class Qwen3MoeModelState(FamilyModelState):
    model_types = ("qwen3_moe",)
    hf_class = "Qwen3MoeForCausalLM"
    attention = "causal, q/k norm; mixture of experts"


class MixtralModelState(FamilyModelState):
    model_types = ("mixtral",)
    hf_class = "MixtralForCausalLM"
    attention = "causal (sliding window if set); mixture of experts"


class OlmoeModelState(FamilyModelState):
    model_types = ("olmoe",)
    hf_class = "OlmoeForCausalLM"
    attention = "causal, q/k norm; mixture of experts"


class GemmaModelState(FamilyModelState):
    model_types = ("gemma",)
    hf_class = "GemmaForCausalLM"
    attention = "causal; scaled embeddings"


class Gemma2ModelState(FamilyModelState):
    model_types = ("gemma2",)
    hf_class = "Gemma2ForCausalLM"
    attention = ("interleaved sliding/full layers, logit soft-capping, `query_pre_attn_scalar`; "
                 "final logit soft-capping")


class Gemma3TextModelState(FamilyModelState):
    model_types = ("gemma3_text",)
    hf_class = "Gemma3ForCausalLM"
    attention = "interleaved sliding/full layers (`layer_types`), q/k norm, local rotary base"


class Phi3ModelState(FamilyModelState):
    model_types = ("phi3",)
    hf_class = "Phi3ForCausalLM"
    attention = "causal (sliding window if set), fused qkv"


class Olmo2ModelState(FamilyModelState):
    model_types = ("olmo2",)
    hf_class = "Olmo2ForCausalLM"
    attention = "causal, q/k norm"


class GraniteModelState(FamilyModelState):
    model_types = ("granite",)
    hf_class = "GraniteForCausalLM"
    attention = "causal; embedding/residual/attention multipliers, logits scaling"


class MRopeModelState(ModelState):
    """Qwen2-VL-family text models: 3-D rotary positions (temporal, height, width).

    Media items with a grid get 3-D positions; text and passthrough "prompt_embeds" items (which have
    no grid) are positioned as text; decode positions continue as `index + delta`. See
    `compute_mrope_positions`.
    """

    family = "M-RoPE decoder-only"
    uses_mrope = True
    supports_realtime = False
    tested = True
    attention = "causal, 3-D M-RoPE positions"

    def compute_positions(self, num_tokens: int, items: Sequence[MRopeItem]) -> tuple[torch.Tensor, int]:
        """(3, num_tokens) int64 prompt positions and the decode delta; grids are in LLM tokens."""
        return compute_mrope_positions(num_tokens, items)


class EncoderDecoderModelState(ModelState):
    family = "encoder-decoder"
    unsupported_reason = (
        "Bridge's runner runs decoder-only models; an encoder-decoder model's decoder attends to encoder "
        "outputs through cross-attention, which the runner's paged KV cache does not hold, and prompt "
        "embeddings have no defined place between its encoder and decoder"
    )
    supports_generation = False
    supports_prompt_embeds = False
    supports_mm_inputs = False
    supports_realtime = False
    is_encoder_decoder = True


class HybridModelState(ModelState):
    family = "hybrid (linear-attention / mamba / conv)"
    unsupported_reason = (
        "its linear-attention / mamba / conv layers keep a recurrent state per request that Bridge's "
        "paged KV cache does not hold (nor snapshot for chunked prefill and prefix caching)"
    )
    supports_generation = False
    supports_prompt_embeds = False
    supports_mm_inputs = False
    supports_realtime = False
    is_hybrid = True


class EncoderOnlyModelState(ModelState):
    family = "encoder-only"
    unsupported_reason = (
        "an encoder-only model has no causal language-model head, so there is nothing to generate tokens from"
    )
    supports_generation = False
    supports_prompt_embeds = False
    supports_mm_inputs = False
    supports_realtime = False
    is_encoder_only = True


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
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ImportError, ValueError, AttributeError):
        return None
    return bool(getattr(model_cls, "_supports_attention_backend", False))


_WARNED_UNTESTED: set[str] = set()
_WARN_LOCK = threading.Lock()


def _warn_untested_once(config: Any) -> None:
    model_type = _model_type(config)
    with _WARN_LOCK:
        if model_type in _WARNED_UNTESTED:
            return
        _WARNED_UNTESTED.add(model_type)
    warnings.warn(
        f"model type {model_type!r} is not in Bridge's tested families "
        f"({', '.join(sorted(FAMILY_MODEL_STATES))}); "
        "it runs through Hugging Face's own modules with paged attention, but its outputs are not checked "
        "against Hugging Face in the test suite",
        stacklevel=3,
    )


FAMILY_MODEL_STATES: dict[str, type[ModelState]] = {
    model_type: cls for cls in FamilyModelState.__subclasses__() for model_type in cls.model_types
}


def capability_rows() -> list[tuple[str, type[ModelState]]]:
    """(model type, model-state class) of every tested generative family, in table order."""
    rows = sorted(FAMILY_MODEL_STATES.items())
    rows.append(("qwen2_vl", MRopeModelState))
    return rows


def capability_table_markdown() -> str:
    """The README's capability table, generated from the model-state classes' flags."""

    def mark(flag: bool) -> str:
        return "yes" if flag else "no"

    lines = [
        "| model type | attention | prompt embeds | multimodal items | CUDA graphs | fused layers | "
        "prefix caching |",
        "|---|---|---|---|---|---|---|",
    ]
    for model_type, cls in capability_rows():
        lines.append(
            f"| `{model_type}` | {cls.attention} | {mark(cls.supports_prompt_embeds)} | "
            f"{mark(cls.supports_mm_inputs)} | {mark(cls.supports_cuda_graphs)} | "
            f"{mark(cls.supports_fused_layers)} | {mark(cls.supports_prefix_caching)} |"
        )
    return "\n".join(lines) + "\n"


def resolve_model_state_cls(config: Any) -> type[ModelState]:
    """Pick the model-state class from a config (a transformers config or a config.json dict) alone."""
    text_config = _text_config(config)
    if _is_encoder_only(config):
        return EncoderOnlyModelState
    if _get(config, "is_encoder_decoder", False) or _get(text_config, "is_encoder_decoder", False):
        return EncoderDecoderModelState
    if _get(text_config, "cross_attention_layers", None) or _get(config, "cross_attention_layers", None):
        return EncoderDecoderModelState
    if (
        _model_type(config) in HYBRID_MODEL_TYPES
        or _model_type(text_config) in HYBRID_MODEL_TYPES
        or _hybrid_layer_evidence(text_config) is not None
    ):
        return HybridModelState
    if _model_type(config) in MROPE_MODEL_TYPES or _uses_mrope(text_config):
        return MRopeModelState
    return FAMILY_MODEL_STATES.get(_model_type(config), DefaultModelState)


# -- loading -----------------------------------------------------------------------------------------------


def load_hf_config(model_dir: str | pathlib.Path) -> Any:
    """Read a local model directory's config.json through `AutoConfig` (no weights, no network).

    A missing directory or config.json, or a model type transformers does not know, is a `ValueError`
    that names the directory.
    """
    path = pathlib.Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist (models are local directories)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        try:
            model_type = json.loads(config_file.read_text()).get("model_type")
        except (OSError, ValueError):
            model_type = None
        raise ValueError(
            f"cannot read the config of {str(path)!r} (model_type {model_type!r}) with transformers: {exc}"
        ) from exc


@dataclass(frozen=True)
class CheckedModel:
    """What `check_model_dir` found: the config, its model-state class, and the async-scheduling setting."""

    config: Any
    model_state_cls: type[ModelState]
    async_scheduling: bool


def check_model_dir(
    model_dir: str | pathlib.Path,
    *,
    enable_prompt_embeds: bool = False,
    async_scheduling: bool | None = None,
    has_mm: bool = False,
    realtime: bool = False,
) -> CheckedModel:
    """Fail fast for `LLM(model_dir, ...)`: read config.json, resolve the class, check the features."""
    config = load_hf_config(model_dir)
    cls = resolve_model_state_cls(config)
    resolved = cls.check_supported(
        config,
        enable_prompt_embeds=enable_prompt_embeds,
        async_scheduling=async_scheduling,
        has_mm=has_mm,
        realtime=realtime,
    )
    return CheckedModel(config=config, model_state_cls=cls, async_scheduling=resolved)


# -- M-RoPE positions ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MRopeItem:
    """One embedding item of a prompt, for M-RoPE positions.

    `offset`/`length`: the item's contiguous rows in the prompt. `grid_thw`: (t, h, w) of a media
    item, or None for a passthrough "prompt_embeds" item, which is positioned as text. The grid is in
    LLM tokens (`t * h * w == length`) unless `compute_mrope_positions` is given the vision tower's
    `spatial_merge_size`, in which case it is the raw patch grid (transformers' `image_grid_thw`).
    `time_interval`: temporal spacing (Qwen2.5-VL videos: tokens_per_second * seconds per grid step).
    """

    offset: int
    length: int
    grid_thw: tuple[int, int, int] | None = None
    time_interval: float = 1.0


def compute_mrope_positions(
    num_tokens: int, items: Sequence[MRopeItem], *, spatial_merge_size: int = 1
) -> tuple[torch.Tensor, int]:
    """(3, num_tokens) int64 positions of a prompt and the decode delta, as transformers' Qwen2-VL
    `get_rope_index` computes them.

    Text runs (and gridless items) get `p, p+1, ...` in all three rows. A media item starting at
    position `s` with LLM grid (t, h, w) gets temporal `s + floor(i_t * time_interval)`, height
    `s + i_h`, width `s + i_w` (row-major over t, h, w), and the text after it resumes at
    `s + max(h, w)`. The decode position of sequence index `i >= num_tokens` is `i + delta` in all
    three rows, `delta = max(positions) + 1 - num_tokens`.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    rows: list[torch.Tensor] = []
    pos = 0  # next position to hand out
    cursor = 0  # next prompt index not yet positioned

    def text(count: int) -> None:
        nonlocal pos
        if count > 0:
            rows.append(torch.arange(pos, pos + count, dtype=torch.int64).expand(3, count))
            pos += count

    for item in sorted(items, key=lambda it: it.offset):
        if item.offset < cursor or item.length < 0 or item.offset + item.length > num_tokens:
            raise ValueError(
                f"M-RoPE item at offset {item.offset} with length {item.length} overlaps another item or "
                f"lies outside a prompt of {num_tokens} tokens"
            )
        text(item.offset - cursor)
        cursor = item.offset + item.length
        if item.grid_thw is None:
            text(item.length)
            continue
        t, h, w = (int(v) for v in item.grid_thw)
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(
                f"grid {item.grid_thw} is not divisible by spatial_merge_size {spatial_merge_size}"
            )
        h, w = h // spatial_merge_size, w // spatial_merge_size
        if t * h * w != item.length:
            raise ValueError(
                f"M-RoPE item at offset {item.offset}: grid (t={t}, h={h}, w={w}) in LLM tokens has "
                f"{t * h * w} rows but the item has {item.length}"
            )
        temporal = (torch.arange(t, dtype=torch.float64) * item.time_interval).long() + pos
        height = torch.arange(h, dtype=torch.int64) + pos
        width = torch.arange(w, dtype=torch.int64) + pos
        grid = torch.meshgrid(temporal, height, width, indexing="ij")
        rows.append(torch.stack(grid).reshape(3, -1))
        pos += max(h, w)
    text(num_tokens - cursor)

    if not rows:
        return torch.zeros(3, 0, dtype=torch.int64), 0
    positions = torch.cat(rows, dim=1)
    delta = int(positions.max()) + 1 - num_tokens
    return positions, delta


def mrope_positions_window(
    prompt_positions: torch.Tensor, delta: int, start: int, count: int
) -> torch.Tensor:
    """(3, count) positions of sequence indices `[start, start + count)`: prompt indices from
    `prompt_positions`, later ones (generated tokens) as `index + delta`. This is what one scheduled
    window of a request (a prefill chunk, possibly carrying the first sampled token, or a decode step)
    needs."""
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be >= 0, got {start}, {count}")
    num_prompt = prompt_positions.shape[1]
    end = start + count
    head = prompt_positions[:, min(start, num_prompt) : min(end, num_prompt)]
    tail_start = max(start, num_prompt)
    if end <= tail_start:
        return head
    tail = torch.arange(tail_start + delta, end + delta, dtype=torch.int64, device=prompt_positions.device)
    return torch.cat([head, tail.expand(3, -1)], dim=1)
