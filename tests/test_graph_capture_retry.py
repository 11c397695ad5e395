"""`GraphBuckets.capture`'s warm-up count and its one retry, with stand-ins for the CUDA calls.

After a build-ahead pass the captures warm each body up once (`warmups=1`); should a capture fail
there (something set up lazily on a body's second run), the bucket gets the second warm-up the default
gives and one more capture. With the default two warm-ups a failure is raised as before.
"""

from __future__ import annotations

import pytest
import torch

from runner.worker.cuda_graphs import GraphBuckets


class _Graph:
    def __init__(self) -> None:
        self.captured = False

    def pool(self) -> tuple:
        return (1, 2)


class _Cuda:
    """torch.cuda's capture calls, recording what ran; the first `fail` captures raise as CUDA does."""

    def __init__(self, fail: int) -> None:
        self.fail, self.events = fail, []

    def synchronize(self) -> None:
        self.events.append("sync")

    def graph(self, graph: _Graph, pool=None):
        cuda = self

        class _Capture:
            def __enter__(self):
                cuda.events.append("capture")

            def __exit__(self, *exc):
                if cuda.fail:
                    cuda.fail -= 1
                    raise RuntimeError("operation not permitted when stream is capturing")
                graph.captured = True

        return _Capture()


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(fail: int) -> _Cuda:
        cuda = _Cuda(fail)
        monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
        monkeypatch.setattr(torch.cuda, "graph", cuda.graph)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
        return cuda

    return install


def _buckets(cuda: _Cuda) -> GraphBuckets:
    buckets = GraphBuckets()
    buckets.sizes = [4, 8]

    def make_body(b: int):
        return lambda: cuda.events.append(f"run {b}")

    buckets.make_body = make_body
    return buckets


def test_one_warm_up_then_capture(fake_cuda):
    cuda = fake_cuda(fail=0)
    buckets = _buckets(cuda)
    assert buckets.capture(buckets.make_body, warmups=1) == (1, 2)
    assert cuda.events == ["run 8", "sync", "capture", "run 8", "run 4", "sync", "capture", "run 4", "sync"]
    assert all(g.captured for g in buckets.graphs.values()) and sorted(buckets.graphs) == [4, 8]


def test_a_failed_capture_after_one_warm_up_warms_up_again_and_retries(fake_cuda):
    cuda = fake_cuda(fail=1)
    buckets = _buckets(cuda)
    buckets.capture(buckets.make_body, warmups=1)
    assert cuda.events[:9] == ["run 8", "sync", "capture", "run 8",  # failed
                               "sync", "run 8", "sync", "capture", "run 8"]  # second warm-up, retry
    assert all(g.captured for g in buckets.graphs.values()) and sorted(buckets.graphs) == [4, 8]


def test_two_warm_ups_by_default_and_failures_raised_there_or_on_the_retry(fake_cuda):
    cuda = fake_cuda(fail=0)
    buckets = _buckets(cuda)
    buckets.capture(buckets.make_body)
    assert cuda.events[:5] == ["run 8", "run 8", "sync", "capture", "run 8"]
    cuda = fake_cuda(fail=1)
    buckets = _buckets(cuda)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        buckets.capture(buckets.make_body, warmups=2)
    cuda = fake_cuda(fail=2)
    buckets = _buckets(cuda)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        buckets.capture(buckets.make_body, warmups=1)
