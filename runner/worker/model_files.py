"""Check a model directory's files before anything loads them, so a damaged one is one clear error.

A truncated `model.safetensors`, a `config.json` that is a list, or half a `tokenizer.json` would
otherwise surface as an error from deep inside transformers or safetensors that names neither the
file nor the problem. `check_model_files` reads only metadata: JSON files are parsed, and each
safetensors file's header is parsed and checked against the file's size (8-byte little-endian
header length, a JSON header whose tensors' byte ranges tile the data that follows); no tensor
is read.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

#: safetensors' own limit on a header's size
MAX_HEADER_BYTES = 100 * 2**20
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "C64": 8,
    "U64": 8, "I64": 8, "F64": 8,
}
_JSON_OBJECT_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
_JSON_FILES = ("tokenizer.json",)


def check_model_files(model_dir: str) -> None:
    """Raise ValueError naming the file and what is wrong when `model_dir`'s config.json is
    missing or not a JSON object, a tokenizer/generation JSON file present is not valid JSON,
    or a `*.safetensors` file's header is damaged or disagrees with the file's size."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ValueError(f"model directory {model_dir!s:.200} does not exist")
    if not (root / "config.json").is_file():
        raise ValueError(f"{root / 'config.json'}: missing (not a model directory?)")
    for name in _JSON_OBJECT_FILES:
        if (root / name).is_file():
            _read_json(root / name, want_object=True)
    for name in _JSON_FILES:
        if (root / name).is_file():
            _read_json(root / name, want_object=False)
    for path in sorted(root.glob("*.safetensors")):
        check_safetensors_file(path)


def _read_json(path: Path, *, want_object: bool) -> object:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text (damaged?)") from None
    except json.JSONDecodeError as err:
        where = f"{err.msg} at line {err.lineno} column {err.colno}"
        raise ValueError(f"{path}: not valid JSON ({where}); truncated or damaged?") from None
    if want_object and not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def check_safetensors_file(path: str | Path) -> None:
    """Parse a safetensors header and check it against the file: ValueError naming the file."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path}: {size} bytes, too short for a safetensors header (empty or truncated)")
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise ValueError(
                f"{path}: header length {header_len} does not fit the {size}-byte file (truncated or not "
                "a safetensors file)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path}: header is not valid JSON (damaged or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data_bytes = size - 8 - header_len
    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ranges.append(_tensor_range(path, str(name)[:100], entry))
    ranges.sort()
    expected_start = 0
    for begin, end, name in ranges:
        if begin != expected_start:
            raise ValueError(f"{path}: tensor {name!r} starts at byte {begin}, expected {expected_start}")
        expected_start = end
    if expected_start != data_bytes:
        raise ValueError(
            f"{path}: the header describes {expected_start} bytes of tensor data but the file holds "
            f"{data_bytes} (truncated or damaged)"
        )


def _tensor_range(path: Path, name: str, entry: object) -> tuple[int, int, str]:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{path}: tensor {name!r} has unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise ValueError(f"{path}: tensor {name!r} has a malformed shape")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"{path}: tensor {name!r} has malformed data_offsets")
    begin, end = offsets
    needed = math.prod(shape) * _DTYPE_BYTES[dtype]
    if end - begin != needed:
        raise ValueError(
            f"{path}: tensor {name!r} ({dtype}, shape {str(shape)[:80]}) needs {needed} bytes but its "
            f"data_offsets span {end - begin}"
        )
    return begin, end, name
