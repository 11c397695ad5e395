"""Test-wide setup: Triton runs in interpreter mode when there is no GPU, and `gpu` tests skip.

TRITON_INTERPRET must be set before triton is first imported, so it is decided here from the
presence of an NVIDIA device node rather than by asking torch (which would not import triton,
but keeps the rule obvious).
"""

from __future__ import annotations

import os

if not os.path.exists("/dev/nvidia0") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory):
    """A session-wide folder for tiny Hugging Face model directories (built once, reused)."""
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny-model engine tests run on one torch thread: on a shared 2-core machine, OpenMP across
    both cores costs more in contention than it gains on matrices this small."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused decoder layers and their SiLU*mul kernel on CPU tensors (under TRITON_INTERPRET);
    a test turns the norm-GEMM and PDL kernels on itself (`fused_layers.NORM_GEMM_ON_CPU`, `PDL_ON_CPU`),
    undone here too."""
    from runner.layers import fused_layers, fused_linear

    monkeypatch.setattr(fused_layers, "FUSED_LAYERS_ON_CPU", True)
    monkeypatch.setattr(fused_linear, "SILU_MUL_ON_CPU", True)
    monkeypatch.setattr(fused_layers, "NORM_GEMM_ON_CPU", False)
    monkeypatch.setattr(fused_layers, "PDL_ON_CPU", False)
