"""Process settings `bridge serve` applies before serving (no server started here)."""

from __future__ import annotations

import argparse

import torch

from bridge.serve.engine_build import set_torch_threads
from bridge.serve.ingest import default_workers


def test_torch_threads_one_on_a_gpu_server_default_on_cpu_and_as_told():
    before = torch.get_num_threads()
    try:
        set_torch_threads(argparse.Namespace(torch_threads=None), "cpu")
        assert torch.get_num_threads() == before  # a CPU server computes on them
        set_torch_threads(argparse.Namespace(torch_threads=None), "cuda")
        assert torch.get_num_threads() == 1
        set_torch_threads(argparse.Namespace(torch_threads=2), "cuda")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_ingest_pool_only_by_default_on_a_gpu_server():
    assert default_workers("cpu") == 0
    assert 1 <= default_workers("cuda") <= 8
    # several API processes share the budget (a share of 0: each parses in its own event loop)
    assert default_workers("cuda", api_processes=2) == default_workers("cuda") // 2
    assert default_workers("cuda", api_processes=64) == 0
