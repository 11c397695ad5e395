"""runner: the inference engine. Prompt embeddings stand in for tokens; media items reach it through
a small encoder protocol. Knows nothing of `encoders/` or `bridge/`.

The public surface is vLLM-shaped: `LLM`, `SamplingParams`, `RequestOutput`. Every export is imported
on first use, so that importing one small module of the package (`runner.hf_config`, say) does not
load the engine, torch and transformers with it.
"""

from __future__ import annotations

import importlib

#: export -> the module that defines it
_EXPORTS = {
    "EngineConfig": "runner.config",
    "EngineCore": "runner.engine.core",
    "Sampler": "runner.layers.sampler",
    "SamplerOutput": "runner.layers.sampler",
    "SamplingBatch": "runner.layers.sampler",
    "LLM": "runner.llm",
    "EncoderCache": "runner.multimodal.encoder_cache",
    "GatheredEmbeds": "runner.multimodal.encoder_cache",
    "MultiModalFeature": "runner.multimodal.encoder_cache",
    "PlaceholderRange": "runner.multimodal.encoder_cache",
    "RequestWindow": "runner.multimodal.encoder_cache",
    "make_feature": "runner.multimodal.encoder_cache",
    "sort_features": "runner.multimodal.encoder_cache",
    "PROMPT_EMBEDS_MODALITY": "runner.multimodal.encoder_protocol",
    "EncoderProtocol": "runner.multimodal.encoder_protocol",
    "check_encoders": "runner.multimodal.encoder_protocol",
    "tensor_content_hash": "runner.multimodal.encoder_protocol",
    "CompletionOutput": "runner.outputs",
    "EngineStats": "runner.outputs",
    "GenerationError": "runner.outputs",
    "RequestDelta": "runner.outputs",
    "RequestOutput": "runner.outputs",
    "SamplingParams": "runner.sampling_params",
    "StructuredOutputsParams": "runner.sampling_params",
    "InputsEmbedsBuilder": "runner.worker.inputs_embeds",
    "assemble_inputs_embeds": "runner.worker.inputs_embeds",
    "ModelState": "runner.worker.model_states",
    "check_model_dir": "runner.worker.model_states",
    "load_hf_config": "runner.worker.model_states",
    "resolve_model_state_cls": "runner.worker.model_states",
    "PromptEmbedsState": "runner.worker.prompt_embeds",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
