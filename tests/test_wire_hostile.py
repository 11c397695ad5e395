"""Wire format against crafted archives: zip bombs, pickles that lie about their storages, nested
tensors, hostile global names. Each is a bounded ValueError before torch inflates anything."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from wire_crafting import b64, deflate_bomb, patch_numel, pickle_archive, saved_entries, zip_entries

from bridge.wire import encode_prompt_embeds, load_prompt_embeds

HIDDEN = 16
ROOT = Path(__file__).resolve().parents[1]


def _pkl_name(entries: dict[str, bytes]) -> str:
    return next(n for n in entries if n.endswith("data.pkl"))


def test_deflate_bomb_is_refused_in_bounded_memory(tmp_path):
    """A 128 MiB storage behind ~130 KB of DEFLATE: refused from the zip directory, and the
    loading process's peak RSS barely moves (torch alone would inflate all of it)."""
    raw = deflate_bomb(2**27, HIDDEN)
    assert len(raw) < 2**20
    payload = tmp_path / "bomb.b64"
    payload.write_text(b64(raw))
    script = textwrap.dedent(f"""
        import resource, sys
        from bridge.wire import load_prompt_embeds
        data = open({str(payload)!r}).read()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            load_prompt_embeds(data, hidden_size={HIDDEN}, max_bytes=2**20)
        except ValueError as err:
            print("refused:", err)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print("grew_kib", after - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert "refused:" in out.stdout and "compressed" in out.stdout, out.stdout + out.stderr
    grew_kib = int(out.stdout.split("grew_kib")[1])
    assert grew_kib < 32 * 1024  # far under the 128 MiB the archive declares


def test_stored_storage_larger_than_the_cap_is_refused_from_the_pickle():
    """A storage's declared bytes (numel x itemsize, read from the pickle) count against the cap,
    even when the tensor's own shape is small: a slice of a big saved tensor ships all of it."""
    big = torch.randn(4096, HIDDEN)
    saved = zip_entries(saved_entries(big[:2]))  # torch.save writes the whole 256 KiB storage
    with pytest.raises(ValueError, match="storages declare 262144 bytes"):
        load_prompt_embeds(b64(saved), hidden_size=HIDDEN, max_bytes=200_000)


def test_pickle_declaring_more_elements_than_its_record_is_refused():
    entries = saved_entries(torch.randn(4, HIDDEN))
    name = _pkl_name(entries)
    entries[name] = patch_numel(entries[name], 4 * HIDDEN, 10**8)
    with pytest.raises(ValueError, match="declares 400000000 bytes but its record holds 256"):
        load_prompt_embeds(b64(zip_entries(entries)), hidden_size=HIDDEN)


def test_result_never_keeps_a_larger_storage_alive():
    big = torch.randn(64, HIDDEN)
    for view in (big[10:12], big[:, :HIDDEN], big.unsqueeze(0)[:, 5:9]):
        saved = zip_entries(saved_entries(view))
        out = load_prompt_embeds(b64(saved), hidden_size=HIDDEN)
        assert torch.equal(out, view.reshape(-1, HIDDEN))
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensor_is_a_value_error():
    nested = torch.nested.nested_tensor([torch.randn(2, HIDDEN), torch.randn(3, HIDDEN)])
    with pytest.raises(ValueError, match="nested tensors are not accepted"):
        load_prompt_embeds(b64(zip_entries(saved_entries(nested))), hidden_size=HIDDEN)


def test_parameter_payload_loads_as_a_plain_tensor():
    param = torch.nn.Parameter(torch.randn(3, HIDDEN))
    out = load_prompt_embeds(b64(zip_entries(saved_entries(param))), hidden_size=HIDDEN)
    assert type(out) is torch.Tensor and not out.requires_grad and torch.equal(out, param.data)


def test_huge_global_name_gives_a_bounded_message():
    module = "m" * 5000
    pkl = b"\x80\x02c" + module.encode() + b"\nf\n)R."
    with pytest.raises(ValueError, match="global that is not allowed") as info:
        load_prompt_embeds(b64(pickle_archive(pkl)), hidden_size=HIDDEN)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    ("archive", "match"),
    [
        (lambda: pickle_archive(b"\x80\x02]q\x00."), "container"),  # an empty list
        (lambda: pickle_archive(b"\x80\x02}q\x00."), "container"),  # an empty dict
        (lambda: pickle_archive(b"\x80\x02h\x07."), "never written"),  # BINGET of an empty memo
        (lambda: pickle_archive(b"\x80\x02cbuiltins\nexec\nq\x00."), "not allowed"),
        (lambda: pickle_archive(b"\x80\x02(K\x01K\x02l."), "container"),
        (lambda: pickle_archive(b"\x80\x02K\x01"), "malformed"),  # no STOP
        (lambda: pickle_archive(b"\x80\x02K\x01K\x02."), "one tensor"),
        (lambda: pickle_archive(b"x" * (2**17)), "pickle is 131072 bytes"),
        (lambda: zip_entries({"data.pkl": b"."}), "no data.pkl"),
        (lambda: zip_entries({f"archive/e{i}": b"" for i in range(40)}), "40 entries"),
    ],
)
def test_crafted_pickles_and_archives_are_refused(archive, match):
    with pytest.raises(ValueError, match=match) as info:
        load_prompt_embeds(b64(archive()), hidden_size=HIDDEN)
    assert len(str(info.value)) < 500


def test_compressed_small_entry_is_refused_and_stored_round_trip_still_loads():
    x = torch.randn(3, HIDDEN)
    entries = saved_entries(x)
    with pytest.raises(ValueError, match="compressed"):
        compressed = zip_entries(entries, deflate=frozenset({_pkl_name(entries)}))
        load_prompt_embeds(b64(compressed), hidden_size=HIDDEN)
    assert torch.equal(load_prompt_embeds(b64(zip_entries(entries)), hidden_size=HIDDEN), x)
    assert torch.equal(load_prompt_embeds(encode_prompt_embeds(x.to(torch.float64)), hidden_size=HIDDEN),
                       x.double())
