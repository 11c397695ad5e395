"""Hand-made torch.save archives for the wire-format tests: real ones re-zipped with a twist
(a compressed entry, a patched pickle, extra entries), and archives around a raw pickle."""

from __future__ import annotations

import base64
import io
import struct
import zipfile

import torch


def saved_entries(obj) -> dict[str, bytes]:
    """The entries of `torch.save(obj)`'s archive, in order."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def zip_entries(entries: dict[str, bytes], *, deflate: frozenset[str] = frozenset()) -> bytes:
    """A zip of `entries` (stored, except the names in `deflate`)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in entries.items():
            method = zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED
            archive.writestr(zipfile.ZipInfo(name), data, compress_type=method)
    return buffer.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def pickle_archive(pickle_bytes: bytes, extra: dict[str, bytes] | None = None) -> bytes:
    """An archive laid out like torch.save's around an arbitrary data.pkl."""
    entries = {"archive/data.pkl": pickle_bytes, "archive/byteorder": b"little", "archive/version": b"3\n"}
    return zip_entries({**entries, **(extra or {})})


def patch_numel(pickle_bytes: bytes, old: int, new: int) -> bytes:
    """Replace the storage element count `old` (written as BININT1/BININT2 before the persistent
    id's TUPLE) with `new` (as BININT)."""
    code = b"K" + bytes([old]) if old < 256 else b"M" + struct.pack("<H", old)
    marker = code + b"t"
    assert pickle_bytes.count(marker) == 1, pickle_bytes
    return pickle_bytes.replace(marker, b"J" + struct.pack("<i", new) + b"t")


def deflate_bomb(declared_bytes: int, hidden: int = 16) -> bytes:
    """A torch.save archive of a float32 (declared_bytes/4/hidden, hidden) tensor of zeros whose
    storage entry is DEFLATE-compressed: a few hundred KB of payload that torch's reader would
    inflate to `declared_bytes`. Streamed, so making it never holds the inflated bytes."""
    rows = declared_bytes // 4 // hidden
    entries = saved_entries(torch.zeros(4, hidden))
    pkl_name = next(n for n in entries if n.endswith("data.pkl"))
    pkl = patch_numel(entries[pkl_name], 4 * hidden, rows * hidden)
    shape = b"K" + bytes([hidden]) + b"\x86"  # (4, hidden) -> (rows, hidden)
    pkl = pkl.replace(b"K\x04" + shape, b"J" + struct.pack("<i", rows) + shape)
    entries[pkl_name] = pkl
    buffer = io.BytesIO()
    chunk = bytes(2**20)
    with zipfile.ZipFile(buffer, "w", compresslevel=1) as archive:
        for name, data in entries.items():
            if name.endswith("/data/0"):
                info = zipfile.ZipInfo(name)
                info.compress_type = zipfile.ZIP_DEFLATED
                with archive.open(info, "w", force_zip64=True) as out:
                    for _ in range(declared_bytes // len(chunk)):
                        out.write(chunk)
            else:
                archive.writestr(zipfile.ZipInfo(name), data)
    return buffer.getvalue()
