"""`LocalBackend`: the in-process `runner.LLM` (today's path, and the default)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from bridge.backends.identity import ModelExpectation
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams


class LocalBackend:
    """Wraps an engine made on first use by `engine_factory` (loading an LLM is not free, and a
    Bridge used only with a remote backend never needs one). Requests pass as device tensors."""

    def __init__(self, engine_factory: Callable[[], object]):
        self._factory = engine_factory

    @property
    def engine(self):
        return self._factory()

    def verify(self, expected: ModelExpectation) -> None:
        """The engine is built from the Bridge's own LLM directory: nothing to check."""

    def generate(self, requests: Sequence[dict], sampling_params: SamplingParams | Sequence[SamplingParams],
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        return self.engine.generate(list(requests), sampling_params, use_tqdm=use_tqdm)

    def stream(self, request: dict, sampling_params: SamplingParams) -> Iterator[RequestOutput]:
        engine = self.engine
        request_id = engine.add_request(request, sampling_params)
        try:
            while True:
                for out in engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if engine.has_unfinished_requests():
                engine.abort_request(request_id)

    def close(self) -> None:
        """The engine belongs to the Bridge that made it."""
