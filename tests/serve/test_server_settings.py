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
    # several API processes parse in their own event loops: no pool, no hop
    assert default_workers("cuda", api_processes=2) == 0
    assert default_workers("cuda", api_processes=64) == 0


def test_api_processes_by_default_only_for_a_cuda_engine_in_its_own_process(monkeypatch):
    from bridge.serve.server import default_api_server_count

    def flags(**kw):
        return argparse.Namespace(**{"device": None, "engine_process": None, **kw})

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert default_api_server_count(flags(device="cpu")) == 1  # the CPU engine needs the cores
    assert default_api_server_count(flags(device="cpu", engine_process=True)) == 1
    assert default_api_server_count(flags(device="cuda:0")) == 8
    assert default_api_server_count(flags(device="cuda", engine_process=False)) == 1  # one process
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert default_api_server_count(flags(device="cuda")) == 8
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert default_api_server_count(flags(device="cuda")) == 1
