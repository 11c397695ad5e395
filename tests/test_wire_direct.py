"""Plain dense tensors are rebuilt from the checked archive without torch.load; the rest still go
through torch.load; a layout that reaches past its storage is refused either way."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from wire_crafting import b64, saved_entries, zip_entries

import bridge.wire as wire
from bridge.wire import load_prompt_embeds

HIDDEN = 16


def _saved(obj) -> str:
    """base64 of torch.save(obj) as it is, views included (encode_prompt_embeds would copy first)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.fixture
def torch_load_calls(monkeypatch):
    calls = []
    real = wire._torch_load_safely

    def spy(raw):
        calls.append(len(raw))
        return real(raw)

    monkeypatch.setattr(wire, "_torch_load_safely", spy)
    return calls


def _cases() -> dict[str, torch.Tensor]:
    base = torch.randn(12, HIDDEN * 2)
    return {
        "bf16": torch.randn(5, HIDDEN).to(torch.bfloat16),
        "fp16 batch of 1": torch.randn(1, 3, HIDDEN).to(torch.float16),
        "fp32 with a storage offset": base.view(-1)[7:7 + 4 * HIDDEN].view(4, HIDDEN),
        "fp32 column slice (strided view)": base[:, :HIDDEN],
        "fp32 transposed": torch.randn(HIDDEN, 6).t(),
        "fp64": torch.randn(2, HIDDEN, dtype=torch.float64),
        "requires grad": torch.randn(3, HIDDEN, requires_grad=True),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_dense_tensors_are_read_without_torch_load_and_equal_it(name, torch_load_calls):
    tensor = _cases()[name]
    payload = _saved(tensor)
    got = load_prompt_embeds(payload, hidden_size=HIDDEN)
    assert torch_load_calls == []  # the direct read
    want = torch.load(io.BytesIO(base64.b64decode(payload)), weights_only=True).detach()
    want = want[0] if want.dim() == 3 else want
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert got.is_contiguous() and not got.requires_grad
    assert got.untyped_storage().nbytes() == got.numel() * got.element_size()  # owns only its rows


def test_anything_else_still_goes_through_torch_load(torch_load_calls):
    param = torch.nn.Parameter(torch.randn(3, HIDDEN))  # pickled through _rebuild_parameter
    got = load_prompt_embeds(_saved(param), hidden_size=HIDDEN)
    assert len(torch_load_calls) == 1 and torch.equal(got, param.detach())

    entries = saved_entries(torch.randn(2, HIDDEN))  # no byteorder record: torch.load decides
    tensor_back = torch.load(io.BytesIO(zip_entries(entries)), weights_only=True)
    del entries[next(n for n in entries if n.endswith("/byteorder"))]
    got = load_prompt_embeds(b64(zip_entries(entries)), hidden_size=HIDDEN)
    assert len(torch_load_calls) == 2 and torch.equal(got, tensor_back)


def test_a_shape_reaching_past_the_storage_is_refused(torch_load_calls):
    entries = saved_entries(torch.zeros(4, HIDDEN))
    name = next(n for n in entries if n.endswith("data.pkl"))
    shape = b"K\x04K" + bytes([HIDDEN]) + b"\x86"
    assert entries[name].count(shape) == 1
    entries[name] = entries[name].replace(shape, b"K\x09K" + bytes([HIDDEN]) + b"\x86")  # 9 rows over 4
    with pytest.raises(ValueError, match="reaches past its storage"):
        load_prompt_embeds(b64(zip_entries(entries)), hidden_size=HIDDEN)
    assert torch_load_calls == []


@pytest.mark.parametrize("rows", [2**40, 2**62, 2**70])
def test_a_huge_zero_stride_shape_is_refused_without_allocating(rows, torch_load_calls):
    """A zero-stride view declares any number of rows over a tiny storage: refused as a ValueError (the
    cap on the declared dense size, or a count that overflows), never a crash or an allocation."""
    entries = saved_entries(torch.zeros(4, HIDDEN))
    name = next(n for n in entries if n.endswith("data.pkl"))
    shape, stride = b"K\x04K" + bytes([HIDDEN]) + b"\x86", b"K" + bytes([HIDDEN]) + b"K\x01\x86"
    assert entries[name].count(shape) == 1 and entries[name].count(stride) == 1
    big = rows.to_bytes((rows.bit_length() + 8) // 8, "little")
    pkl = entries[name].replace(shape, b"\x8a" + bytes([len(big)]) + big + b"K" + bytes([HIDDEN]) + b"\x86")
    entries[name] = pkl.replace(stride, b"K\x00K\x00\x86")
    with pytest.raises(ValueError, match="over the cap|impossible shape"):
        load_prompt_embeds(b64(zip_entries(entries)), hidden_size=HIDDEN)
    assert torch_load_calls == []


def test_a_record_cut_short_is_refused():
    raw = base64.b64decode(_saved(torch.randn(4, HIDDEN)))
    with pytest.raises(ValueError):
        load_prompt_embeds(b64(raw[: len(raw) // 2]), hidden_size=HIDDEN)
