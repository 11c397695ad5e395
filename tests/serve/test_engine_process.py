"""The engine in its own process (bridge.serve.engine_process), without HTTP.

The API and fuzz modules run their shared server this way (`--engine-process`, conftest.py), so
everything a client sees is tested there; here are the failure paths: an engine that cannot be built
is reported with its own error, and an engine process that dies fails its live requests, refuses new
ones with EngineFailed and marks the front unhealthy, and the front still shuts down.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch

from bridge.serve.engine_loop import EngineFailed
from bridge.serve.engine_process import EngineProcess, EngineProcessFront
from bridge.serve.metrics import ServeMetrics
from bridge.serve.server import add_serve_arguments
from runner.sampling_params import SamplingParams


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args([*argv, "--device", "cpu", "--log-level", "warning"])


def test_an_engine_that_cannot_be_built_reports_its_error(tmp_path):
    engine = EngineProcess(serve_args(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="is not a directory"):
        engine.start(timeout=120)
    assert not engine.process.is_alive()


def test_a_dead_engine_fails_live_requests_and_refuses_new_ones(tiny_text_model):
    engine = EngineProcess(serve_args(str(tiny_text_model), "--dtype", "float32", "--max-model-len", "1024",
                                      "--num-kv-blocks", "300"))
    info = engine.start(timeout=120)
    assert info.hidden_size > 0 and info.max_model_len == 1024

    async def scenario() -> None:
        front = EngineProcessFront(engine.links[0], info, max_pending=8, metrics=ServeMetrics(),
                                 on_finish=engine.join)
        front.start()
        params = [SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)]
        prompt = {"prompt_token_ids": [5, 6, 7]}
        queue, lens = await asyncio.wait_for(front.submit([prompt], params, ["long"], stream_text=False), 60)
        assert lens == [3]
        first = await asyncio.wait_for(queue.get(), timeout=60)
        assert first.new_token_ids  # it runs in the other process
        engine.process.kill()
        while True:  # deltas already on their way, then the failure
            item = await asyncio.wait_for(queue.get(), timeout=30)
            if isinstance(item, EngineFailed):
                break
            assert not item.finished
        assert not front.healthy and front.num_live == 0
        with pytest.raises(EngineFailed):
            late = front.submit([{"prompt_token_ids": [5]}], params, ["late"], stream_text=False)
            await asyncio.wait_for(late, 10)
        await asyncio.wait_for(front.stop(timeout=1), timeout=60)

    asyncio.run(scenario())
    assert not engine.process.is_alive()


def test_messages_carry_tensors_as_raw_bytes_next_to_the_pickle():
    """What crosses the pipe comes back equal: contiguous CPU tensors of every dtype and shape (empty,
    0-d, a slice view, bfloat16), and what is pickled as is (a strided view, a sparse tensor)."""
    import multiprocessing
    import threading

    from bridge.serve.engine_process import _recv, _send, _widen

    base = torch.randn(40, 300)
    message = ("submit", {"embeds": torch.randn(512, 1024).bfloat16(), "ids": [1, 2],
                          "empty": torch.empty(0, 4), "scalar": torch.tensor(3.5), "rows": base[5:9],
                          "strided": base[:, ::3],
                          "flags": torch.tensor([True, False]), "sparse": torch.eye(3).to_sparse()})
    receiving, sending = multiprocessing.Pipe(duplex=False)
    _widen(sending)
    writer = threading.Thread(target=_send, args=(sending, message))
    writer.start()
    got = _recv(receiving)
    writer.join()
    assert got[0] == "submit" and got[1]["ids"] == [1, 2]
    for key, value in message[1].items():
        if isinstance(value, torch.Tensor):
            assert got[1][key].dtype == value.dtype and got[1][key].shape == value.shape
            assert torch.equal(got[1][key].to_dense(), value.to_dense()), key


def test_a_tick_goes_to_api_process_0_and_to_those_it_concerns_only():
    """The engine's tick outcome, split between three API processes: process 0 gets every tick (the
    step's timings and the snapshot for the gauges), the others only a tick holding something of
    theirs (an admission, a delta, an abort), each exactly their own."""
    from bridge.serve.engine_loop import Submission, TickOutcome
    from bridge.serve.engine_process import _Owners
    from bridge.serve.metrics import EngineSnapshot
    from runner.outputs import RequestDelta

    owners = _Owners(3)
    sub = Submission([{"prompt_token_ids": [1]}], [SamplingParams()], ["b-0"], False, owner=1, token=7)
    admitted = TickOutcome([(sub, None)], [], EngineSnapshot(num_running=1), admit_s=0.001, step_s=0.002)
    parts = owners.split(admitted, {})
    assert [owners.wanted(k, p) for k, p in enumerate(parts)] == [True, True, False]
    assert parts[1].added[0][0] == 7 and parts[0].step_s == 0.002 and parts[1].step_s is None

    quiet = TickOutcome([], [RequestDelta("b-0", [5])], EngineSnapshot(num_running=1), step_s=0.002)
    parts = owners.split(quiet, {})
    assert [owners.wanted(k, p) for k, p in enumerate(parts)] == [True, True, False]
    assert [d.new_token_ids for d in parts[1].deltas] == [[5]] and not parts[0].deltas

    idle = TickOutcome([], [], EngineSnapshot(), step_s=None)
    parts = owners.split(idle, {})
    assert [owners.wanted(k, p) for k, p in enumerate(parts)] == [True, False, False]
    assert parts[0].snapshot is idle.snapshot

    aborted = TickOutcome([], [], EngineSnapshot(), aborted_ids=["b-0"])
    parts = owners.split(aborted, {1: ["b-0"]})
    assert [owners.wanted(k, p) for k, p in enumerate(parts)] == [True, True, False]
    assert parts[1].aborted_ids == ["b-0"] and owners.of == {}


def test_the_outbox_writes_in_order_and_reports_a_gone_api_process():
    """The engine's messages leave from a thread of their own (the engine's thread only queues them):
    each API process gets its own in the order queued; one whose pipe broke is reported to the engine's
    inbox as that process's end, and later messages for it are dropped."""
    import multiprocessing
    import queue

    from bridge.serve.engine_process import _Outbox, _recv

    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(2)]
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox = _Outbox([send for _, send in pipes], inbox)
    for k in range(5):
        outbox.send(0, ("tick", k))
        outbox.send(1, ("tick", -k))
    assert [_recv(pipes[0][0]) for _ in range(5)] == [("tick", k) for k in range(5)]
    assert [_recv(pipes[1][0]) for _ in range(5)] == [("tick", -k) for k in range(5)]
    pipes[1][0].close()  # API process 1 is gone
    outbox.send(1, ("tick", 99))
    assert inbox.get(timeout=10) == (1, ("eof",))
    outbox.send(1, ("tick", 100))
    outbox.send(0, ("tick", 5))
    assert _recv(pipes[0][0]) == ("tick", 5)
    outbox.close()
    assert inbox.empty()
