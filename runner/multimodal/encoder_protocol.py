"""The structural protocol through which the runner runs encoders it knows nothing about.

The runner never imports `encoders/` (docs/ARCHITECTURE.md, "Import rules"). Anything that has these five
members can be handed to the runner: a real vision/audio/graph encoder, a streaming encoder for
realtime models, or a tiny test double. `"prompt_embeds"` is the built-in passthrough modality:
its item is already an `(n, hidden)` tensor, so it needs no encoder and is never given one.

Also here: the content hash of a tensor, which is the identifier of a passthrough item in the
encoder cache (and a convenient `content_hash` for encoders whose items are tensors).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

PROMPT_EMBEDS_MODALITY = "prompt_embeds"
"""The passthrough modality: the item is an `(n, hidden)` tensor that goes straight into the cache."""


@runtime_checkable
class EncoderProtocol(Protocol):
    """What the runner needs from an encoder.

    - `modality`: the name placeholders and `multi_modal_data` use ("image", "audio", "graph", ...).
    - `is_realtime`: the encoder feeds a live request while it decodes (streaming audio); the
      runner then gathers encoder rows for decode steps too.
    - `num_rows(item)`: rows `encode` will produce for the item. Asked before anything runs, so
      that placeholders expand to their final length when the prompt is processed.
    - `content_hash(item)`: a stable identifier of the item's content; equal content -> equal
      hash, so a repeated item is encoded once and served from the encoder cache.
    - `encode(items)`: one batched call; returns one `(num_rows(item), hidden)` tensor per item,
      on the model device (no serialization, no host round trip).
    """

    modality: str
    is_realtime: bool

    def num_rows(self, item: Any) -> int: ...

    def content_hash(self, item: Any) -> str: ...

    def encode(self, items: list[Any]) -> list[torch.Tensor]: ...


def tensor_content_hash(tensor: torch.Tensor) -> str:
    """sha256 (hex) over a tensor's dtype, shape and raw bytes: the identity of a passthrough item.

    dtype and shape are part of the hash, so the same bytes reinterpreted (fp16 vs bf16, or
    (4, 8) vs (8, 4)) never collide. Cost: about 1 GB/s of hashing on one CPU core (a 512 x 4096
    bf16 tensor, 4 MiB, takes ~3-4 ms). A tensor on the host is hashed in place without a copy
    (a non-contiguous one is first made contiguous). A tensor on an accelerator is first copied
    to the host, which is a device synchronisation plus a device-to-host copy of its bytes: hash
    where the tensor is still on the host (e.g. right after the wire format decoded it) when
    you can; an in-process encoder should hash its raw input, not its output.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor_content_hash expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor_content_hash expects a dense tensor, got layout {tensor.layout}")
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.to("cpu")
    flat = flat.contiguous().reshape(-1)
    digest = hashlib.sha256()
    digest.update(f"{flat.dtype}|{tuple(tensor.shape)}|".encode())
    if flat.numel():
        # uint8 view: numpy has no bfloat16, and a byte view hashes every dtype the same way.
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def check_encoders(encoders: Mapping[str, Any] | None) -> dict[str, EncoderProtocol]:
    """Validate an `encoders={modality: encoder}` mapping once, when the engine is built.

    Raises ValueError naming the offending entry: an object missing protocol members, a key
    that disagrees with the encoder's own `modality`, or an encoder registered for the
    passthrough modality (which never runs an encoder).
    """
    checked: dict[str, EncoderProtocol] = {}
    for modality, encoder in (encoders or {}).items():
        if modality == PROMPT_EMBEDS_MODALITY:
            raise ValueError(
                f"modality {PROMPT_EMBEDS_MODALITY!r} is the built-in passthrough and takes no encoder"
            )
        if not isinstance(encoder, EncoderProtocol):
            missing = [
                name
                for name in ("modality", "is_realtime", "num_rows", "content_hash", "encode")
                if not hasattr(encoder, name)
            ]
            raise ValueError(
                f"encoder for {modality!r} ({type(encoder).__name__}) does not meet the encoder "
                f"protocol; missing: {', '.join(missing)}"
            )
        if encoder.modality != modality:
            raise ValueError(f"encoder registered as {modality!r} declares modality {encoder.modality!r}")
        checked[modality] = encoder
    return checked
