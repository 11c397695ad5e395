"""Hypothesis strategies for prompt-embeds payloads (shared by the in-process fuzz tests and the
bounded-memory subprocess): well-formed archives of every dtype and layout, archives with
hostile headers, mutated bytes, and nested containers."""

from __future__ import annotations

import io
import struct
import warnings
import zipfile

import torch
from hypothesis import strategies as st
from wire_crafting import b64, saved_entries, zip_entries

HIDDEN = 8
DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
]
LAYOUTS = ["contiguous", "slice", "transposed", "expanded", "sparse_coo", "sparse_csr", "nested", "meta",
           "parameter", "offset"]


@st.composite
def tensors(draw) -> object:
    """A tensor of any dtype, a small shape, and one of many layouts."""
    dtype = draw(st.sampled_from(DTYPES))
    rank = draw(st.integers(0, 4))
    shape = [draw(st.integers(0, 5)) for _ in range(rank)]
    if rank >= 1 and draw(st.booleans()):
        shape[-1] = HIDDEN
    scale = draw(st.sampled_from([1.0, 1e5, 1e39, float("nan")]))
    if dtype.is_floating_point:
        base = (torch.randn(shape, dtype=torch.float64) * scale).to(dtype)
    else:
        base = torch.zeros(shape, dtype=dtype)
    layout = draw(st.sampled_from(LAYOUTS))
    if layout == "slice" and rank >= 1 and shape[0] > 1:
        return torch.cat([base, base]).narrow(0, 1, shape[0])
    if layout == "transposed" and rank >= 2:
        return base.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "expanded" and rank >= 1 and shape[0] >= 1:  # zero stride: huge shape, tiny storage
        return base.narrow(0, 0, 1).expand(draw(st.integers(0, 10**6)), *shape[1:])
    if layout == "sparse_coo" and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return base.to_sparse()
    if layout == "sparse_csr" and rank == 2 and dtype.is_floating_point and dtype.itemsize > 1:
        return base.to_sparse_csr()
    if layout == "nested" and rank == 2 and dtype.is_floating_point and dtype.itemsize > 1:
        with warnings.catch_warnings():  # "nested tensors are a prototype"
            warnings.simplefilter("ignore")
            return torch.nested.nested_tensor([base, base[:1]])
    if layout == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if layout == "parameter" and dtype.is_floating_point:
        return torch.nn.Parameter(base)
    if layout == "offset" and base.numel() > 0:  # a view one element into a larger storage
        return torch.cat([base.flatten()[:1], base.flatten()])[1:].view(base.shape)
    return base


def nested_containers() -> st.SearchStrategy:
    matrix = st.builds(lambda n: torch.randn(n, HIDDEN), st.integers(1, 3))
    leaf = matrix | st.integers() | st.text(max_size=5)
    return st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=3), inner, max_size=3) | st.tuples(inner, inner), max_leaves=6)


def archive_of(obj) -> bytes:
    return zip_entries(saved_entries(obj))


@st.composite
def hostile_headers(draw) -> bytes:
    """A real archive of a small float tensor with one header lie: a pickle integer (element
    count, shape, stride, offset) replaced, an entry renamed, duplicated, dropped or compressed."""
    entries = saved_entries(torch.randn(draw(st.integers(1, 4)), HIDDEN))
    names = list(entries)
    kind = draw(st.sampled_from(["int", "rename", "duplicate", "drop", "compress", "extra"]))
    if kind == "int":
        pkl_name = next(n for n in names if n.endswith("data.pkl"))
        pkl = entries[pkl_name]
        spots = [i for i in range(len(pkl) - 1) if pkl[i : i + 1] == b"K"]
        spot = draw(st.sampled_from(spots))
        value = draw(st.integers(-(2**31), 2**31 - 1) | st.sampled_from([0, 2**31 - 1, 2**20, -1]))
        entries[pkl_name] = pkl[:spot] + b"J" + struct.pack("<i", value) + pkl[spot + 2 :]
        return zip_entries(entries)
    victim = draw(st.sampled_from(names))
    if kind == "rename":
        entries[draw(st.text(min_size=1, max_size=300))] = entries.pop(victim)
    elif kind == "drop":
        entries.pop(victim)
    elif kind == "extra":
        entries[f"archive/data/{draw(st.integers(1, 9))}"] = draw(st.binary(max_size=64))
    elif kind == "compress":
        return zip_entries(entries, deflate=frozenset({victim}))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        if kind == "duplicate":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                archive.writestr(victim, entries[victim] + b"\0" * 8)
    return buffer.getvalue()


@st.composite
def mutated_bytes(draw) -> bytes:
    """A real archive with bytes flipped, cut or inserted."""
    raw = bytearray(archive_of(torch.randn(draw(st.integers(1, 3)), HIDDEN)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]))
        pos = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del raw[pos:]
        elif op == "insert":
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        else:
            chunk = draw(st.binary(min_size=1, max_size=8))
            raw[pos : pos + len(chunk)] = chunk
    return bytes(raw)


def payloads() -> st.SearchStrategy[str]:
    """Every kind of payload, base64-encoded as on the wire."""
    return st.one_of(
        tensors().map(archive_of),
        nested_containers().map(archive_of),
        hostile_headers(),
        mutated_bytes(),
    ).map(b64)
