"""runner: the inference engine. Prompt embeddings stand in for tokens; media items reach it through
a small encoder protocol. Knows nothing of `encoders/` or `bridge/`.

The public surface is vLLM-shaped: `LLM`, `SamplingParams`, `RequestOutput`.
"""

from runner.config import EngineConfig
from runner.engine.core import EngineCore
from runner.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from runner.llm import LLM
from runner.multimodal.encoder_cache import (
    EncoderCache,
    GatheredEmbeds,
    MultiModalFeature,
    PlaceholderRange,
    RequestWindow,
    make_feature,
    sort_features,
)
from runner.multimodal.encoder_protocol import (
    PROMPT_EMBEDS_MODALITY,
    EncoderProtocol,
    check_encoders,
    tensor_content_hash,
)
from runner.outputs import CompletionOutput, EngineStats, GenerationError, RequestDelta, RequestOutput
from runner.sampling_params import SamplingParams
from runner.worker.inputs_embeds import InputsEmbedsBuilder, assemble_inputs_embeds
from runner.worker.model_states import (
    ModelState,
    check_model_dir,
    load_hf_config,
    resolve_model_state_cls,
)
from runner.worker.prompt_embeds import PromptEmbedsState

__all__ = [
    "LLM",
    "PROMPT_EMBEDS_MODALITY",
    "CompletionOutput",
    "EncoderCache",
    "EncoderProtocol",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "GatheredEmbeds",
    "GenerationError",
    "InputsEmbedsBuilder",
    "ModelState",
    "MultiModalFeature",
    "PlaceholderRange",
    "PromptEmbedsState",
    "RequestDelta",
    "RequestOutput",
    "RequestWindow",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "assemble_inputs_embeds",
    "check_encoders",
    "check_model_dir",
    "load_hf_config",
    "make_feature",
    "resolve_model_state_cls",
    "sort_features",
    "tensor_content_hash",
]
