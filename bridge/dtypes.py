"""The dtype names a recipe or a checkpoint may give, and the torch dtypes they stand for.

Its own module so that the inference API (bridge/api.py) and training share it without the
inference side loading the training package."""

from __future__ import annotations

import torch

from runner.config import DTYPES as _ALL_DTYPES

#: the canonical names of the runner's one dtype table (which also takes aliases such as "bf16")
DTYPES: dict[str, torch.dtype] = {name: _ALL_DTYPES[name] for name in ("float32", "bfloat16", "float16")}
