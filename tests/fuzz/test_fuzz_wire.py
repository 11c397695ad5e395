"""Fuzzing `load_prompt_embeds`: every payload either loads as a dense, finite (n, hidden) CPU
tensor that owns its storage, or raises ValueError with a bounded message; nothing else, no
hang, and bounded memory (measured in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_cases import HIDDEN, archive_of, payloads, tensors
from wire_crafting import b64

from bridge.wire import load_prompt_embeds

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
CAP = 2**20


def load_or_value_error(payload: str, dtype: torch.dtype | None) -> torch.Tensor | None:
    try:
        out = load_prompt_embeds(payload, hidden_size=HIDDEN, max_bytes=CAP, max_rows=4096, dtype=dtype)
    except ValueError as err:
        assert len(str(err)) < 600, str(err)[:1000]
        return None
    assert type(out) is torch.Tensor and out.device.type == "cpu" and out.layout == torch.strided
    assert out.dim() == 2 and out.shape[1] == HIDDEN and 1 <= out.shape[0] <= 4096
    assert out.dtype == (dtype or out.dtype) and out.dtype.is_floating_point
    assert bool(torch.isfinite(out).all()) and out.is_contiguous()
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    return out


@settings(max_examples=250)
@given(payloads(), st.sampled_from([None, torch.float16, torch.float32]))
def test_any_payload_loads_or_is_a_value_error(payload, dtype):
    load_or_value_error(payload, dtype)


@settings(max_examples=60)
@given(tensors())
def test_well_formed_float_matrices_round_trip(tensor):
    out = load_or_value_error(b64(archive_of(tensor)), None)
    plain = (
        isinstance(tensor, torch.Tensor) and not tensor.is_nested and tensor.device.type == "cpu"
        and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        and tensor.dim() in (2, 3) and tensor.shape[-1] == HIDDEN and tensor.shape[-2] >= 1
        and (tensor.dim() == 2 or tensor.shape[0] == 1)
        and tensor.shape[-2] * HIDDEN * tensor.dtype.itemsize <= CAP
    )
    if plain and bool(torch.isfinite(tensor.to_dense() if tensor.is_sparse else tensor).all()):
        dense = tensor.to_dense() if tensor.layout != torch.strided else tensor
        assert out is not None and torch.equal(out, dense.detach().reshape(-1, HIDDEN))


def test_fuzzed_payloads_stay_in_bounded_memory():
    """The same payload mix in a fresh process: peak RSS grows by far less than the bytes the
    hostile archives declare (up to GBs), i.e. nothing was inflated or densified past the cap."""
    script = (
        "import resource, torch\n"
        "from hypothesis import given, settings, HealthCheck\n"
        "from hypothesis import strategies as st\n"
        "from wire_cases import payloads\n"
        "from test_fuzz_wire import load_or_value_error\n"
        "load_or_value_error('AAAA', None)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "@settings(max_examples=150, derandomize=True, database=None, deadline=None,\n"
        "          suppress_health_check=list(HealthCheck))\n"
        "@given(payloads(), st.sampled_from([None, torch.float16]))\n"
        "def run(payload, dtype):\n"
        "    load_or_value_error(payload, dtype)\n"
        "run()\n"
        "print('grew_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    env = {"PYTHONPATH": f"{ROOT}:{TESTS}:{TESTS / 'fuzz'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=240)
    assert "grew_kib" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert int(out.stdout.split("grew_kib")[1]) < 96 * 1024
