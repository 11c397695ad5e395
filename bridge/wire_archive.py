"""Inspect a `torch.save` archive before torch reads it: the zip bomb and pickle checks of the wire format.

torch's zip reader inflates every entry to the size its header declares before anything in
`torch.load` looks at the tensor, and a pickle may declare storages of any size. So the archive
is checked here first, from its metadata alone, without inflating or executing anything:

- the zip directory: a bounded number of entries, unique names, every entry *stored* (torch.save
  never compresses; a compressed entry is how a small payload declares a huge one), and stored
  sizes that fit in the payload;
- the pickle (`data.pkl`, small) walked opcode by opcode with `pickletools.genops`, never
  unpickled: only the globals a saved tensor uses (bounded names in errors), no nested tensors,
  no containers, and every storage it declares (`("storage", type, key, location, numel)`)
  matched against its record's size, with the total under the cap.
"""

from __future__ import annotations

import io
import math
import pickletools
import struct
import sys
import zipfile
from dataclasses import dataclass

import torch

MAX_ENTRIES = 32
MAX_PICKLE_BYTES = 64 * 2**10  # one tensor's pickle is a few hundred bytes
MAX_STORAGES = 4  # a dense tensor has one storage; a sparse one two or three
_MAX_SHOWN = 200

_STORAGE_ITEMSIZE: dict[str, int] = {
    name: dtype.itemsize for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}
_STORAGE_ITEMSIZE["UntypedStorage"] = 1  # torch.save's storage type for dtypes without a legacy class
_STORAGE_DTYPE: dict[str, torch.dtype] = {  # the prompt-embeds dtypes read without torch.load
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
    if dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch.serialization", "_get_layout"),
    ("torch.storage", "UntypedStorage"),
}
_REFUSED_GLOBALS = {
    ("torch._utils", "_rebuild_nested_tensor"): "nested tensors are not accepted",
    ("torch._utils", "_rebuild_wrapper_subclass"): "tensor subclasses are not accepted",
}
_CONTAINER_OPS = {"EMPTY_LIST", "LIST", "EMPTY_DICT", "DICT", "EMPTY_SET", "FROZENSET", "APPEND",
                  "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"}
_LITERAL_OPS = {
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
    "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
}
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
_MARK = object()


def shown(value: object) -> str:
    """repr of caller data cut to a bounded length, for error messages."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + f"... ({len(text)} chars)"


class _Global(tuple):
    """A global named by the pickle: (module, name). Only a name; nothing is imported."""


class _Storage(tuple):
    """A storage reference the pickle declares: (type name, key, numel)."""


def inspect_torch_archive(raw: bytes, max_bytes: int) -> DenseRecord | None:
    """Raise ValueError unless `raw` is a plain torch.save archive of one tensor whose storages
    together declare at most `max_bytes` and whose entries cannot inflate past the payload.

    Returns the tensor's `DenseRecord` when the pickle is exactly torch.save's dense-tensor call in
    a little-endian archive (what every client sends), else None (torch.load then reads it)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        infos = archive.infolist()
    except Exception as err:  # noqa: BLE001  zipfile raises several types on garbage
        raise ValueError(f"prompt_embeds is not a torch.save archive (zip): {shown(str(err))}") from None
    records = _check_entries(infos, len(raw))
    prefix, pickle_info = _find_pickle(records)
    try:
        pickle_bytes = archive.read(pickle_info)
    except Exception as err:  # noqa: BLE001  a damaged local header or CRC
        raise ValueError(f"prompt_embeds archive is damaged: {shown(str(err))}") from None
    storages, call = _walk_pickle(pickle_bytes)
    total = 0
    for type_name, key, numel in storages:
        record = records.get(f"{prefix}/data/{key}")
        if record is None:
            raise ValueError(f"prompt_embeds pickle refers to storage {shown(key)}, missing from the archive")
        declared = numel * _STORAGE_ITEMSIZE[type_name]
        if declared != record.file_size:
            raise ValueError(
                f"prompt_embeds storage {shown(key)} declares {declared} bytes but its record holds "
                f"{record.file_size}"
            )
        total += declared
    if total > max_bytes:
        raise ValueError(f"prompt_embeds storages declare {total} bytes, over the cap of {max_bytes} bytes")
    return _dense_record(raw, archive, records, prefix, call)


@dataclass(frozen=True)
class DenseRecord:
    """Where a dense tensor's bytes are in a checked payload and how they are laid out: everything
    `torch._utils._rebuild_tensor_v2` would be called with, read from the walked opcodes."""

    raw: bytes
    record: zipfile.ZipInfo
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _dense_record(raw: bytes, archive: zipfile.ZipFile, records: dict[str, zipfile.ZipInfo], prefix: str,
                  call: tuple) -> DenseRecord | None:
    """The record of torch.save's dense-tensor pickle, `_rebuild_tensor_v2(storage, offset, size,
    stride, requires_grad, OrderedDict())`, with every element inside the storage; None for anything
    else (a parameter, a sparse tensor, metadata, a big-endian archive), which torch.load reads."""
    _, func, args = call
    if func != ("torch._utils", "_rebuild_tensor_v2") or len(args) != 6:
        return None
    storage, offset, size, stride, _requires_grad, hooks = args
    if hooks != ("call", ("collections", "OrderedDict"), ()) or not isinstance(storage, _Storage):
        return None
    dtype = _STORAGE_DTYPE.get(storage[0])
    byteorder = records.get(f"{prefix}/byteorder")
    if dtype is None or sys.byteorder != "little" or byteorder is None or byteorder.file_size != 6:
        return None
    try:
        little = archive.read(byteorder) == b"little"
    except Exception as err:  # noqa: BLE001  a damaged local header or CRC
        raise ValueError(f"prompt_embeds archive is damaged: {shown(str(err))}") from None
    if not little:
        return None
    if not (_is_count(offset) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(map(_is_count, size + stride))):
        return None
    numel = storage[2]
    if math.prod(size) and offset + sum((n - 1) * st for n, st in zip(size, stride)) >= numel:
        raise ValueError(f"prompt_embeds tensor of shape {shown(size)} and strides {shown(stride)} reaches "
                         f"past its storage of {numel} elements")
    return DenseRecord(raw, records[f"{prefix}/data/{storage[1]}"], dtype, offset, size, stride)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader: name and extra lengths last


def read_dense_record(dense: DenseRecord) -> torch.Tensor:
    """The tensor a `DenseRecord` describes, in memory of its own (its record's bytes copied out of
    the payload); no unpickling. The record is found through its local zip header, as zipfile
    does, but not CRC-checked: torch.load does not check it either, and a crc32 over the payload
    would be a large share of its decode."""
    raw, info = dense.raw, dense.record
    header = raw[info.header_offset:info.header_offset + _LOCAL_HEADER.size]
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise ValueError("prompt_embeds archive is damaged: a record's local header is missing")
    name_len, extra_len = _LOCAL_HEADER.unpack(header)[-2:]
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > len(raw):
        raise ValueError("prompt_embeds archive is damaged: a record runs past the payload")
    data = bytearray(memoryview(raw)[start:start + info.file_size])
    storage = torch.frombuffer(data, dtype=dense.dtype) if data else torch.empty(0, dtype=dense.dtype)
    try:
        return storage.as_strided(dense.size, dense.stride, dense.offset)
    except (RuntimeError, TypeError, OverflowError):  # a shape whose element count overflows int64
        raise ValueError(f"prompt_embeds declares an impossible shape {shown(dense.size)}") from None


def _check_entries(infos: list[zipfile.ZipInfo], payload_bytes: int) -> dict[str, zipfile.ZipInfo]:
    if not infos or len(infos) > MAX_ENTRIES:
        raise ValueError(
            f"prompt_embeds archive has {len(infos)} entries; a saved tensor has 1 to {MAX_ENTRIES}"
        )
    records: dict[str, zipfile.ZipInfo] = {}
    stored = 0
    for info in infos:
        if info.filename in records:
            raise ValueError(f"prompt_embeds archive repeats the entry {shown(info.filename)}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(
                f"prompt_embeds archive entry {shown(info.filename)} is compressed (method "
                f"{info.compress_type}); torch.save stores entries uncompressed, and a compressed entry "
                "could inflate past the size cap"
            )
        if info.file_size != info.compress_size:
            raise ValueError(
                f"prompt_embeds archive entry {shown(info.filename)} declares {info.file_size} bytes but "
                f"stores {info.compress_size}"
            )
        stored += info.file_size
        records[info.filename] = info
    if stored > payload_bytes:
        raise ValueError(
            f"prompt_embeds archive entries declare {stored} bytes, more than the payload's {payload_bytes}"
        )
    return records


def _find_pickle(records: dict[str, zipfile.ZipInfo]) -> tuple[str, zipfile.ZipInfo]:
    """The archive's folder name (torch reads the first entry's) and its data.pkl entry."""
    first = next(iter(records))
    prefix = first.split("/", 1)[0]
    info = records.get(f"{prefix}/data.pkl")
    if "/" not in first or info is None:
        raise ValueError("prompt_embeds archive has no data.pkl: not written by torch.save")
    if info.file_size > MAX_PICKLE_BYTES:
        raise ValueError(
            f"prompt_embeds pickle is {info.file_size} bytes; one tensor's is under {MAX_PICKLE_BYTES}"
        )
    return prefix, info


def _walk_pickle(data: bytes) -> tuple[list[_Storage], tuple]:
    """The storages a tensor pickle declares, found by walking its opcodes (nothing is executed).

    A small stack machine follows the opcodes torch.save emits for a tensor (literals, tuples,
    memo, globals, persistent ids, calls); anything else is refused, so what torch.load later
    sees has been fully accounted for here."""
    stack: list[object] = []
    memo: dict[int, object] = {}
    storages: list[_Storage] = []
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in ("PROTO", "FRAME", "STOP"):
                continue
            if name in _LITERAL_OPS:
                stack.append(arg)
            elif name in _CONSTANTS:
                stack.append(_CONSTANTS[name])
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
                stack.append(_check_global(module, attr))
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                if not isinstance(module, str) or not isinstance(attr, str):
                    raise ValueError("prompt_embeds pickle: STACK_GLOBAL needs two strings")
                stack.append(_check_global(module, attr))
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[len(memo) if name == "MEMOIZE" else int(arg)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if int(arg) not in memo:
                    raise ValueError(f"prompt_embeds pickle reads memo slot {shown(arg)}, never written")
                stack.append(memo[int(arg)])
            elif name == "TUPLE":
                stack.append(_pop_to_mark(stack))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                if len(stack) < n or any(x is _MARK for x in stack[-n:]):
                    raise ValueError(f"prompt_embeds pickle: {name} on a short stack")
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif name in ("POP", "POP_MARK", "DUP"):
                if name == "POP":
                    stack.pop()
                elif name == "POP_MARK":
                    _pop_to_mark(stack)
                else:
                    stack.append(stack[-1])
            elif name == "BINPERSID":
                storage = _storage_ref(stack.pop())
                storages.append(storage)
                if len(storages) > MAX_STORAGES:
                    raise ValueError(f"prompt_embeds pickle declares more than {MAX_STORAGES} storages")
                stack.append(storage)
            elif name == "REDUCE":
                args, func = stack.pop(), stack.pop()
                if not isinstance(func, _Global) or not isinstance(args, tuple):
                    raise ValueError("prompt_embeds pickle calls something that is not an allowed global")
                stack.append(("call", func, args))
            elif name in _CONTAINER_OPS:
                raise ValueError("prompt_embeds must hold a single tensor; the payload pickles a container")
            else:
                raise ValueError(f"prompt_embeds pickle uses opcode {name}, never written for a tensor")
    except ValueError as err:
        message = str(err)
        if not message.startswith("prompt_embeds"):
            message = f"prompt_embeds pickle is malformed: {message}"
        raise ValueError(shown_message(message)) from None
    except (IndexError, TypeError, KeyError, OverflowError, EOFError) as err:
        raise ValueError(f"prompt_embeds pickle is malformed: {type(err).__name__}") from None
    if len(stack) != 1 or not (isinstance(stack[0], tuple) and stack[0][:1] == ("call",)):
        raise ValueError("prompt_embeds pickle does not rebuild one tensor")
    return storages, stack[0]


def shown_message(message: str) -> str:
    """An error message cut to a bounded length (it may quote caller data)."""
    return message if len(message) <= 2 * _MAX_SHOWN else message[: 2 * _MAX_SHOWN] + "..."


def _pop_to_mark(stack: list[object]) -> tuple:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _MARK:
            items = tuple(stack[i + 1 :])
            del stack[i:]
            return items
    raise ValueError("prompt_embeds pickle: no MARK on the stack")


def _check_global(module: str, attr: str) -> _Global:
    key = (module, attr)
    if key in _REFUSED_GLOBALS:
        raise ValueError(f"prompt_embeds: {_REFUSED_GLOBALS[key]}")
    allowed = (
        key in _ALLOWED_GLOBALS
        or (module == "torch" and attr.isidentifier())
        or (module == "torch._utils" and attr.startswith("_rebuild_") and attr.isidentifier())
    )
    if not allowed:
        where = shown(f"{module}.{attr}")
        raise ValueError(f"prompt_embeds pickle names a global that is not allowed: {where}")
    return _Global(key)


def _storage_ref(pid: object) -> _Storage:
    """Check a persistent id ("storage", type, key, location, numel) and keep what sizes need."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise ValueError("prompt_embeds pickle has a persistent id that is not a storage reference")
    _, storage_type, key, location, numel = pid
    if not isinstance(storage_type, _Global) or storage_type[1] not in _STORAGE_ITEMSIZE:
        raise ValueError("prompt_embeds pickle declares a storage of an unknown type")
    if not isinstance(key, str) or not isinstance(location, str):
        raise ValueError("prompt_embeds pickle declares a storage with a malformed key or location")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"prompt_embeds pickle declares a storage of {shown(numel)} elements")
    return _Storage((storage_type[1], key, numel))
