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


def test_engine_flags_are_the_engine_configs_fields():
    """Every EngineConfig field but the model is a `bridge serve` flag, and the parsed flags are exactly
    the keywords LLM(...) takes (with the engine's own defaults where a flag is not given)."""
    import dataclasses

    from bridge.serve.engine_flags import engine_options
    from bridge.serve.server import add_serve_arguments
    from runner.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["model", "--max-num-seqs", "3", "--no-fused-ops", "--enforce-eager",
                              "--kernel-build-threads", "0"])
    options = engine_options(args)
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    assert set(options) == set(fields)
    assert (options["max_num_seqs"], options["fused_ops"], options["enforce_eager"]) == (3, False, True)
    assert options["kernel_build_threads"] == 0 and options["fused_layers"] is None
    assert options["gpu_memory_utilization"] == fields["gpu_memory_utilization"]
    assert engine_options(args, dtype="bfloat16")["dtype"] == "bfloat16"
