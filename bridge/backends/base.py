"""The generation backend interface: where built requests (prompt embeddings) become outputs.

`Bridge` builds one request per prompt (its encoders run where Bridge runs) and hands the list to
a backend. `LocalBackend` is the in-process `runner.LLM`; `RemoteBackend` is any vLLM-compatible
server. Both return `runner.RequestOutput`s in input order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from bridge.backends.identity import ModelExpectation
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams


@runtime_checkable
class GenerationBackend(Protocol):
    def verify(self, expected: ModelExpectation) -> None:
        """Raise RemoteModelMismatch (a ValueError) when the backend's LLM is not the expected one."""

    def generate(self, requests: Sequence[dict], sampling_params: SamplingParams | Sequence[SamplingParams],
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per request dict (`prompt_embeds`, `prompt_is_token_ids`, `prompt_token_ids`);
        a progress bar on stderr only with `use_tqdm=True`."""

    def stream(self, request: dict, sampling_params: SamplingParams) -> Iterator[RequestOutput]:
        """One request's output so far, after each step or chunk; the last has `finished=True`."""

    def close(self) -> None:
        """Release what the backend holds (connections, threads; not the local engine's owner's)."""
