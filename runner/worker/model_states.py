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
- `MRopeModelState`: Qwen2-VL-family text models; positions are 3-D (`runner.multimodal.mrope`).
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from runner.hf_config import text_config as _text_config
from runner.multimodal.mrope import MRopeItem, compute_mrope_positions
from runner.worker.config_features import (
    HYBRID_MODEL_TYPES,
    MROPE_MODEL_TYPES,
    _get,
    _hybrid_layer_evidence,
    _is_encoder_only,
    _model_type,
    _uses_mrope,
    unsupported_config_feature,
)


class ModelState:
    """Capabilities of a model family (class-level flags) plus the config of one loaded model.

    Flags, all class-level so that they can be checked before anything is built:
    `supports_generation` (the runner can run this family at all), `supports_prompt_embeds`,
    `supports_mm_inputs` (media items and passthrough "prompt_embeds" items), `supports_realtime`
    (decode-step embeddings streamed into a live request), `supports_async_scheduling_with_mm`,
    `supports_prompt_logprobs_with_embeds`, `uses_mrope`, and the family markers `is_encoder_decoder`,
    `is_hybrid`, `is_encoder_only`. `family` and `unsupported_reason` feed the error messages.
    Engine paths, for the capability table: `supports_cuda_graphs` (decode steps replay captured graphs),
    `supports_fused_layers` (`runner.layers.fused_layers` runs its decoder layers on the GPU),
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
