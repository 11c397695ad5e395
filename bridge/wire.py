"""The prompt-embeds wire format: base64 of `torch.save(tensor)`, exactly what vLLM accepts.

Only used at process boundaries (the server, the remote vLLM backend); in-process encoders hand
device tensors to the runner directly. Loading is hostile-input parsing, so every check that can
be made on metadata is made before any bytes are materialised:

1. the base64 text length, then the decoded payload size, against the byte cap;
2. the archive itself, before torch opens it (wire_archive.py): stored (never compressed)
   entries that fit in the payload, and a pickle walked opcode by opcode, never executed, whose
   globals are a saved tensor's and whose declared storages match their records and the cap;
   a zip bomb or a pickle declaring a huge storage is refused here, before torch inflates it;
3. the tensor: a plain dense tensor in a little-endian archive (what `torch.save` writes for one,
   so what every client sends) is rebuilt from the walked pickle's own arguments (storage dtype,
   offset, size, stride, all checked to stay inside the storage) over a copy of its record, with no
   unpickler at all; anything else goes through `torch.load(weights_only=True)` (no arbitrary
   pickle globals, so no code runs) with sparse invariant checks on (out-of-range sparse indices
   are refused, not dereferenced). The direct read skips what makes torch.load slow here: it
   re-reads the archive and runs its unpickler in Python;
4. type, layout (no nested tensors), dtype, rank, declared dense byte size, rows and hidden
   size, from the tensor's shape and dtype: a sparse tensor (or a dense one with zero strides)
   declaring a huge dense size is refused before `.to_dense()` / `.contiguous()` could allocate it;
5. only then densify, cast, and check for NaN/Inf (after the cast: a large fp32 value becomes
   Inf in fp16); the result owns exactly its own bytes (a view is cloned, so no larger storage
   stays alive behind it).

Every rejection is a `ValueError` whose message says what was wrong, bounded in length (it may
quote caller data): a 4xx at the server.

base64 goes through pybase64 (SIMD; what vLLM decodes the same payloads with): the standard
library's `b64decode(validate=True)` was most of a request's decode on a server. Its validation is
the same alphabet, and stricter about padding (excess `=` is refused).
"""

from __future__ import annotations

import binascii
import io
import math

import pybase64
import torch

from bridge.wire_archive import inspect_torch_archive, read_dense_record, shown, shown_message

DEFAULT_MAX_PROMPT_EMBEDS_BYTES = 256 * 2**20
"""Default cap on a prompt-embeds tensor's dense size (and, plus a small slack, on its payload)."""

_PAYLOAD_SLACK_BYTES = 64 * 2**10  # torch.save's zip and pickle framing around the raw bytes
_ACCEPTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def encode_prompt_embeds(tensor: torch.Tensor) -> str:
    """base64 (ASCII str) of `torch.save` of the tensor on the CPU, the vLLM wire format.

    The tensor is copied into its own storage first: `torch.save` writes a view's whole
    underlying storage, so a slice of a large tensor would otherwise ship all of it.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"encode_prompt_embeds expects a torch.Tensor, got {type(tensor).__name__}")
    dense = tensor.detach().to("cpu")
    if dense.layout != torch.strided:
        dense = dense.to_dense()
    dense = dense.clone(memory_format=torch.contiguous_format)
    buffer = io.BytesIO()
    torch.save(dense, buffer)
    return pybase64.b64encode(buffer.getvalue()).decode("ascii")


class Base64Text(str):
    """A base64 string with its decoded bytes (`decoded`), from a parser that decoded it to learn that it
    is base64 (`bridge.serve.json_body`): `load_prompt_embeds` takes the bytes instead of decoding a W1
    payload a second time. It is the string in every other respect, and pickles as a plain `str` (the
    bytes do not cross a process boundary twice)."""

    decoded: bytes

    @classmethod
    def carrying(cls, text: str, decoded: bytes) -> Base64Text:
        out = cls(text)
        out.decoded = decoded
        return out

    def __reduce__(self) -> tuple:
        return (str, (str(self),))


def _decode_base64(data: str | bytes | bytearray, max_payload: int) -> bytes:
    if not isinstance(data, (str, bytes, bytearray)):
        raise ValueError(f"prompt_embeds must be a base64 string, got {shown(type(data).__name__)}")
    if len(data) == 0:
        raise ValueError("prompt_embeds is empty")
    if (len(data) // 4) * 3 > max_payload + 3:
        raise ValueError(
            f"prompt_embeds payload of about {(len(data) // 4) * 3} bytes exceeds the cap of "
            f"{max_payload} bytes"
        )
    if type(data) is Base64Text:  # decoded (strictly) by the body parser already
        raw = data.decoded
    else:
        try:
            raw = pybase64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(shown_message(f"prompt_embeds is not valid base64: {err}")) from None
    if len(raw) > max_payload:
        raise ValueError(f"prompt_embeds payload of {len(raw)} bytes exceeds the cap of {max_payload} bytes")
    return raw


def _torch_load_safely(raw: bytes) -> object:
    try:
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  any failure of hostile input is a client error
        raise ValueError(
            shown_message(
                "prompt_embeds could not be loaded as a tensor saved with torch.save "
                f"(weights_only loading refuses anything else): {type(err).__name__}: {err}"
            )
        ) from None


def load_prompt_embeds(
    data: str | bytes | bytearray,
    *,
    hidden_size: int,
    max_bytes: int = DEFAULT_MAX_PROMPT_EMBEDS_BYTES,
    max_rows: int | None = None,
    dtype: torch.dtype | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """Decode and validate wire prompt embeds into a dense `(n, hidden_size)` CPU tensor.

    `max_bytes` caps the tensor's declared dense size (its payload may exceed it only by
    torch.save's framing); `max_rows` is the model's context length; `dtype` casts the result
    (default: keep the sent floating dtype). A 3-D tensor with batch 1 is squeezed; any other
    rank is refused. Raises ValueError on anything else. `check_finite=False` leaves the NaN/Inf
    check to the caller: the engine checks every prompt's rows itself (on the GPU when it runs
    there), and on the CPU the check costs more than the rest of the decode.
    """
    if dtype is not None and dtype not in _ACCEPTED_DTYPES:
        raise ValueError(f"dtype must be one of {_ACCEPTED_DTYPES}, got {dtype}")
    raw = _decode_base64(data, max_bytes + _PAYLOAD_SLACK_BYTES)
    dense = inspect_torch_archive(raw, max_bytes)
    tensor = read_dense_record(dense) if dense is not None else _torch_load_safely(raw)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds must hold a single tensor, got {shown(type(tensor).__name__)}")
    if tensor.is_nested:
        raise ValueError("prompt_embeds must be a plain tensor; nested tensors are not accepted")
    if isinstance(tensor, torch.nn.Parameter):
        tensor = tensor.data
    if type(tensor) is not torch.Tensor:
        raise ValueError(f"prompt_embeds must be a plain tensor, got {shown(type(tensor).__name__)}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        raise ValueError(f"prompt_embeds tensor loaded on {tensor.device.type}, expected cpu")

    # Everything below until densifying reads only shape and dtype (declared, not materialised).
    if tensor.dtype not in _ACCEPTED_DTYPES:
        raise ValueError(
            f"prompt_embeds must be a floating tensor ({', '.join(str(d) for d in _ACCEPTED_DTYPES)}), "
            f"got {tensor.dtype}"
        )
    shape = tuple(tensor.shape)
    if len(shape) == 3:
        if shape[0] != 1:
            raise ValueError(f"prompt_embeds 3-D tensors must have batch size 1, got shape {shape}")
    elif len(shape) != 2:
        raise ValueError(f"prompt_embeds must be 2-D (n, hidden) or (1, n, hidden), got shape {shape}")
    dense_bytes = math.prod(shape) * tensor.dtype.itemsize
    if dense_bytes > max_bytes:
        raise ValueError(
            f"prompt_embeds declares {dense_bytes} bytes (shape {shape}, {tensor.dtype}), over the cap "
            f"of {max_bytes} bytes"
        )
    rows, hidden = shape[-2], shape[-1]
    if rows == 0:
        raise ValueError(f"prompt_embeds is empty (shape {shape})")
    if hidden != hidden_size:
        raise ValueError(f"prompt_embeds hidden size {hidden} does not match the model's {hidden_size}")
    if max_rows is not None and rows > max_rows:
        raise ValueError(f"prompt_embeds has {rows} rows, longer than the model's context of {max_rows}")

    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    if tensor.dim() == 3:
        tensor = tensor[0]
    if dtype is not None:
        tensor = tensor.to(dtype)
    if check_finite and not bool(torch.isfinite(tensor).all()):
        raise ValueError(
            "prompt_embeds holds NaN or Inf values" + (f" (after casting to {dtype})" if dtype else "")
        )
    return _owning(tensor)


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous in a storage of exactly its own size: a view of a larger storage
    (an offset, a slice, the squeezed batch) would keep the whole of it alive."""
    own_bytes = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == own_bytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
