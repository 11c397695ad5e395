"""Raw image items -> PIL images, and their content-hash bytes.

Accepted items: a ``PIL.Image``, a path (str / Path) to an image file, encoded image ``bytes``, a
``numpy`` uint8 array (H, W) or (H, W, 3|4), or a torch tensor (3, H, W) (float in [0, 1] or uint8).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


def load_image(item: Any) -> Image.Image:
    """Any accepted image item -> an RGB ``PIL.Image``."""
    if isinstance(item, Image.Image):
        image = item
    elif isinstance(item, (str, Path)):
        path = Path(item)
        if not path.is_file():
            raise ValueError(f"image file {path} does not exist")
        with Image.open(path) as f:
            image = f.copy()
    elif isinstance(item, (bytes, bytearray)):
        image = Image.open(io.BytesIO(item))
    elif isinstance(item, np.ndarray):
        image = Image.fromarray(_to_uint8(item))
    elif isinstance(item, torch.Tensor):
        if item.dim() != 3 or item.shape[0] not in (1, 3):
            raise ValueError(f"image tensor must be (3, H, W) or (1, H, W), got {tuple(item.shape)}")
        array = item.detach().cpu()
        if array.is_floating_point():
            array = (array.clamp(0, 1) * 255).round().to(torch.uint8)
        image = Image.fromarray(array.permute(1, 2, 0).squeeze(-1).numpy())
    else:
        raise ValueError(
            f"unsupported image item of type {type(item).__name__}; expected PIL.Image, a path, "
            "bytes, a numpy array or a (3, H, W) tensor"
        )
    return image.convert("RGB") if image.mode != "RGB" else image


def image_size(item: Any) -> tuple[int, int]:
    """(width, height) of any accepted image item, without decoding pixels: a file or encoded bytes
    are opened lazily (PIL reads the header only), arrays and tensors give their shape."""
    if isinstance(item, Image.Image):
        return item.size
    if isinstance(item, np.ndarray):
        if item.ndim not in (2, 3):
            raise ValueError(f"image array must be (H, W) or (H, W, 1|3|4), got shape {item.shape}")
        return int(item.shape[1]), int(item.shape[0])
    if isinstance(item, torch.Tensor):
        if item.dim() != 3:
            raise ValueError(f"image tensor must be (3, H, W) or (1, H, W), got {tuple(item.shape)}")
        return int(item.shape[2]), int(item.shape[1])
    if isinstance(item, (str, Path)):
        if not Path(item).is_file():
            raise ValueError(f"image file {item} does not exist")
        source: Any = str(item)
    elif isinstance(item, (bytes, bytearray)):
        source = io.BytesIO(item)
    else:
        return load_image(item).size  # refuses the type with load_image's own message
    try:
        with Image.open(source) as img:
            return img.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"not a readable image ({type(err).__name__}: {str(err)[:100]})") from None


def _to_uint8(array: np.ndarray) -> np.ndarray:
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
        raise ValueError(f"image array must be (H, W) or (H, W, 1|3|4), got shape {array.shape}")
    if array.dtype != np.uint8:
        if np.issubdtype(array.dtype, np.floating):
            array = (np.clip(array, 0, 1) * 255).round()
        array = array.astype(np.uint8)
    return array.squeeze(-1) if array.ndim == 3 and array.shape[2] == 1 else array


def image_hash_parts(item: Any) -> list[bytes]:
    """Arrays and tensors hash their exact values (dtype, shape, bytes): converting them to 8-bit
    pixels first would give two slightly different float images the same key. Everything else
    hashes its decoded RGB pixels, so a path and the PIL image it holds share a key."""
    if isinstance(item, (np.ndarray, torch.Tensor)):
        if isinstance(item, torch.Tensor):
            flat = item.detach().cpu().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes()
        else:
            raw = np.ascontiguousarray(item).tobytes()
        return [f"array|{item.dtype}|{tuple(item.shape)}".encode(), raw]
    image = load_image(item)
    return [b"%dx%d" % image.size, image.tobytes()]
