"""The dtype names a recipe or a checkpoint may give, and the torch dtypes they stand for.

Its own module so that the inference API (bridge/api.py) and training share it without the
inference side loading the training package."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
