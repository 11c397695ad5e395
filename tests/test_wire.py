"""Wire format: vLLM-compatible round trip, and hostile payloads refused with ValueError."""

from __future__ import annotations

import base64
import builtins
import io
import pickle

import pytest
import torch

from bridge.wire import encode_prompt_embeds, load_prompt_embeds

HIDDEN = 16


def _b64_of_saved(obj) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


class _WritesMarker:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.path!r}, 'w').write('ran')",))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(dtype):
    x = torch.randn(7, HIDDEN).to(dtype)
    back = load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN)
    assert back.dtype == dtype and torch.equal(back, x)
    # Also what a vLLM client sends (its own torch.save, not ours).
    assert torch.equal(load_prompt_embeds(_b64_of_saved(x), hidden_size=HIDDEN), x)
    assert load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN, dtype=torch.float32).dtype == (
        torch.float32
    )


def test_encoding_a_slice_ships_only_its_rows():
    big = torch.randn(4096, HIDDEN)
    part = big[10:12]
    payload = encode_prompt_embeds(part)
    assert len(payload) < 4096 * HIDDEN * 4 // 10
    assert torch.equal(load_prompt_embeds(payload, hidden_size=HIDDEN), part)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("framing", ["raw_pickle", "torch_save"])
def test_pickle_that_runs_code_is_refused_and_never_runs(tmp_path, framing):
    marker = tmp_path / "marker"
    evil = _WritesMarker(marker)
    if framing == "raw_pickle":
        raw = pickle.dumps(evil)
        pickle.loads(raw)  # prove the payload is live: an unsafe load runs it
    else:
        buffer = io.BytesIO()
        torch.save(evil, buffer)
        raw = buffer.getvalue()
        torch.load(io.BytesIO(raw), weights_only=False)  # an unsafe load runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(ValueError, match="not a torch.save archive|global that is not allowed"):
        load_prompt_embeds(base64.b64encode(raw).decode(), hidden_size=HIDDEN)
    assert not marker.exists()


def test_non_tensor_payload_is_refused():
    with pytest.raises(ValueError, match="single tensor"):
        load_prompt_embeds(_b64_of_saved({"embeds": torch.zeros(2, HIDDEN)}), hidden_size=HIDDEN)


def test_sparse_huge_is_refused_before_densifying(monkeypatch):
    calls = []
    original = torch.Tensor.to_dense

    def spy(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to_dense", spy)
    huge = torch.sparse_coo_tensor(torch.tensor([[0, 5], [1, 2]]), torch.tensor([1.0, 2.0]), (10**9, HIDDEN))
    with pytest.raises(ValueError, match="declares"):
        load_prompt_embeds(_b64_of_saved(huge), hidden_size=HIDDEN, max_bytes=2**20)
    assert calls == []
    # A dense tensor whose zero stride declares a huge size (tiny payload) is refused too.
    strided = torch.zeros(HIDDEN).as_strided((10**7, HIDDEN), (0, 1))
    with pytest.raises(ValueError, match="declares"):
        load_prompt_embeds(_b64_of_saved(strided), hidden_size=HIDDEN, max_bytes=2**20)
    # A small sparse tensor is fine: densified once, values intact.
    small = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 3]]), torch.tensor([1.5, -2.0]), (3, HIDDEN))
    out = load_prompt_embeds(_b64_of_saved(small), hidden_size=HIDDEN)
    assert calls == [(3, HIDDEN)] and out.layout == torch.strided and torch.equal(out, small.to_dense())


def test_sparse_with_out_of_range_indices_is_refused():
    bad = torch.sparse_coo_tensor(
        torch.tensor([[0, 999], [1, 2]]), torch.tensor([1.0, 2.0]), (3, HIDDEN), check_invariants=False
    )
    with pytest.raises(ValueError, match="could not be loaded"):
        load_prompt_embeds(_b64_of_saved(bad), hidden_size=HIDDEN)


def test_payload_and_dense_byte_caps():
    x = torch.randn(64, HIDDEN)  # 4 KiB dense
    with pytest.raises(ValueError, match="over the cap"):
        load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN, max_bytes=1024)
    big = torch.randn(8192, HIDDEN)  # 512 KiB payload, far over cap + framing slack
    with pytest.raises(ValueError, match="exceeds the cap"):
        load_prompt_embeds(encode_prompt_embeds(big), hidden_size=HIDDEN, max_bytes=1024)
    assert load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN, max_bytes=4096).shape == x.shape


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_non_floating_dtypes_are_refused(dtype):
    x = torch.zeros(3, HIDDEN, dtype=dtype)
    with pytest.raises(ValueError, match="floating"):
        load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN)


def test_three_d_batch_of_one_is_squeezed_and_larger_batch_refused():
    x = torch.randn(1, 5, HIDDEN)
    out = load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN)
    assert out.shape == (5, HIDDEN) and torch.equal(out, x[0])
    with pytest.raises(ValueError, match="batch size 1"):
        load_prompt_embeds(encode_prompt_embeds(torch.randn(2, 5, HIDDEN)), hidden_size=HIDDEN)
    for shape in [(HIDDEN,), (1, 1, 5, HIDDEN)]:
        with pytest.raises(ValueError, match="2-D"):
            load_prompt_embeds(encode_prompt_embeds(torch.randn(*shape)), hidden_size=HIDDEN)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused(bad):
    x = torch.randn(4, HIDDEN)
    x[2, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN)


def test_overflow_on_cast_is_refused():
    x = torch.full((2, HIDDEN), 1e6)  # finite in fp32, Inf in fp16
    assert load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN).isfinite().all()
    with pytest.raises(ValueError, match="after casting"):
        load_prompt_embeds(encode_prompt_embeds(x), hidden_size=HIDDEN, dtype=torch.float16)


def test_wrong_hidden_size_empty_and_too_long():
    with pytest.raises(ValueError, match="hidden size"):
        load_prompt_embeds(encode_prompt_embeds(torch.randn(3, HIDDEN + 1)), hidden_size=HIDDEN)
    with pytest.raises(ValueError, match="empty"):
        load_prompt_embeds(encode_prompt_embeds(torch.randn(0, HIDDEN)), hidden_size=HIDDEN)
    with pytest.raises(ValueError, match="empty"):
        load_prompt_embeds("", hidden_size=HIDDEN)
    with pytest.raises(ValueError, match="context of 4"):
        load_prompt_embeds(encode_prompt_embeds(torch.randn(5, HIDDEN)), hidden_size=HIDDEN, max_rows=4)


@pytest.mark.parametrize("data", ["not base64!!", "abc", "ünïcode", b"\x00\x01\x02\x03"])
def test_invalid_base64_is_refused(data):
    with pytest.raises(ValueError, match="base64"):
        load_prompt_embeds(data, hidden_size=HIDDEN)


def test_valid_base64_of_garbage_and_wrong_types_are_refused():
    with pytest.raises(ValueError, match="not a torch.save archive"):
        load_prompt_embeds(base64.b64encode(b"definitely not a torch file").decode(), hidden_size=HIDDEN)
    with pytest.raises(ValueError, match="base64 string"):
        load_prompt_embeds(torch.zeros(2, HIDDEN), hidden_size=HIDDEN)
    with pytest.raises(ValueError, match="torch.Tensor"):
        encode_prompt_embeds([[0.0] * HIDDEN])
