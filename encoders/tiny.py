"""Tiny encoder configs for demos and tests: train on a 2-core CPU in seconds, need no download.

Why here and not in the recipes: the demo recipes, the tests and users poking at the API all want
the same "smallest sensible" encoder per modality; one function keeps them in step.
"""

from __future__ import annotations

import copy

_TINY = {
    "image": {
        "modality": "image",
        # open_clip ViT built from an in-code config: 32x32 images, 8x8 patches -> 16 patch tokens.
        "tower": {"name": "open_clip", "arch": "bridge-tiny-vit"},
        "projector": {"name": "mlp", "num_layers": 2},
    },
    "audio": {
        "modality": "audio",
        # 16 kHz log-mel (40 bins, 10 ms hop), 2x conv subsampling, 2 conformer layers of width 64.
        "tower": {
            "name": "conformer",
            "n_mels": 40,
            "dim": 64,
            "num_heads": 4,
            "ffn_dim": 128,
            "num_layers": 2,
            "kernel_size": 15,
            "subsample": 2,
        },
        # stacking 4 frames: 20 ms rows -> 80 ms rows (12.5 rows per second of audio)
        "projector": {"name": "stack_swiglu", "stack": 4},
    },
    "graph": {
        "modality": "graph",
        # 3 GIN layers of width 64 over degree embeddings, read out as 4 tokens by attention pooling;
        # node counts up to 32 get their own embedding (demo captions state the graph's size).
        "tower": {"name": "gin", "dim": 64, "num_layers": 3, "readout_tokens": 4, "count_embedding": 32},
        "projector": {"name": "mlp", "num_layers": 2},
    },
}


def tiny_encoder_config(modality: str, llm_hidden_size: int, **overrides) -> dict:
    """A fresh copy of the tiny config for ``modality`` ("image", "audio", "graph").

    ``overrides`` replace top-level keys (e.g. ``streaming={"chunk_samples": 1600}``,
    ``projector={"name": "linear"}``).
    """
    if modality not in _TINY:
        raise ValueError(f"no tiny encoder config for modality {modality!r}; valid: {sorted(_TINY)}")
    cfg = copy.deepcopy(_TINY[modality])
    cfg["llm_hidden_size"] = int(llm_hidden_size)
    cfg.update(copy.deepcopy(overrides))
    return cfg
