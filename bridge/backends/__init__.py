"""Generation backends: the in-process engine or a vLLM-compatible server (see base.py)."""

from __future__ import annotations

from bridge.backends.base import GenerationBackend
from bridge.backends.errors import RemoteError, RemoteHTTPError, RemoteModelMismatch
from bridge.backends.identity import ModelExpectation, llm_names
from bridge.backends.local import LocalBackend
from bridge.backends.remote import RemoteBackend
from runner.outputs import GenerationError

__all__ = [
    "GenerationError",
    "GenerationBackend",
    "LocalBackend",
    "ModelExpectation",
    "RemoteBackend",
    "RemoteError",
    "RemoteHTTPError",
    "RemoteModelMismatch",
    "llm_names",
    "resolve_backend",
]


def resolve_backend(spec: object, **remote_options) -> GenerationBackend | None:
    """None or "local" -> None (the caller's in-process engine); an http(s) URL -> RemoteBackend;
    a backend object as is."""
    if spec is None or spec == "local":
        return None
    if isinstance(spec, str):
        if spec.startswith(("http://", "https://")):
            return RemoteBackend(spec, **remote_options)
        raise ValueError(f"backend must be 'local' or an http(s):// URL, got {spec[:200]!r}")
    if isinstance(spec, GenerationBackend):
        return spec
    raise ValueError(
        f"backend must be 'local', an http(s):// URL or a backend object, got {type(spec).__name__}"
    )
