"""Public API of ``encoders`` (the lead re-exports it: ``from encoders.api import *``).

Build by name from a recipe's ``encoder:`` section::

    from encoders.api import build_encoder, tiny_encoder_config, load_encoder
    enc = build_encoder({"modality": "image",
                         "tower": {"name": "open_clip", "arch": "ViT-B-32", "pretrained": "/w/clip.bin"},
                         "projector": {"name": "mlp", "num_layers": 2},
                         "llm_hidden_size": 1024, "freeze_tower": True})
    rows = enc.encode([pil_image])            # [(enc.num_rows(pil_image), 1024)] on enc.device
    enc.save("ckpt/encoder"); enc2 = load_encoder("ckpt/encoder")

Training::

    batch = enc.collate([enc.preprocess(x) for x in items])   # CPU, data-loader friendly
    outs = enc(batch)                                          # list of (n_i, hidden), differentiable

Registered towers (``TOWERS``): image: "open_clip", "hf_vision", "conv"; audio: "conformer", "wav2vec2",
"whisper_hf"; graph: "gcn", "gin", "gat". Projectors (``PROJECTORS``): "identity", "linear", "mlp",
"stack_swiglu", "perceiver". Preprocessors (``PREPROCESSORS``): "log_mel". See each class docstring for
its config keys.
"""

from encoders import builtins  # noqa: F401  (registers the built-in parts, once)
from encoders.audio_inputs import load_audio, load_wav, save_wav
from encoders.checkpoint import describe_mismatch, load_state_dict_checked, save_encoder
from encoders.encoder import (
    Encoder,
    build_encoder,
    build_preprocessor,
    build_projector,
    build_tower,
    check_tower_class,
    encoder_config_problems,
    load_encoder,
)
from encoders.graph_format import Graph, graph_from_dict, graph_to_dict, load_graph_json, save_graph_json
from encoders.hashing import content_hash
from encoders.media_budget import MediaBudget, MediaLimits
from encoders.parts import Projector, Tower
from encoders.projectors import stack_frames
from encoders.registry import (
    PREPROCESSORS,
    PROJECTORS,
    TOWERS,
    register_preprocessor,
    register_projector,
    register_tower,
)
from encoders.tiny import tiny_encoder_config
from encoders.user_modules import import_modules
from encoders.vision_inputs import load_image

__all__ = [
    "PREPROCESSORS",
    "PROJECTORS",
    "TOWERS",
    "Encoder",
    "Graph",
    "MediaBudget",
    "MediaLimits",
    "Projector",
    "Tower",
    "build_encoder",
    "build_preprocessor",
    "build_projector",
    "build_tower",
    "check_tower_class",
    "content_hash",
    "describe_mismatch",
    "encoder_config_problems",
    "graph_from_dict",
    "graph_to_dict",
    "import_modules",
    "load_audio",
    "load_encoder",
    "load_graph_json",
    "load_image",
    "load_state_dict_checked",
    "load_wav",
    "register_preprocessor",
    "register_projector",
    "register_tower",
    "save_encoder",
    "save_graph_json",
    "save_wav",
    "stack_frames",
    "tiny_encoder_config",
]
