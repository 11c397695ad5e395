"""What stands in for an engine's parts once `LLM.shutdown()` has freed them.

Why one object instead of a check in every method: `shutdown()` replaces the engine core and the other
parts the `LLM` reaches through (multimodal state, prompt processor, live requests) by `ShutDown()`, so
any method or property that needs the engine meets it on its first use of a part and gets the one
`RuntimeError`, with no check to forget in a method added later, and nothing on the step's hot path.
"""

from __future__ import annotations

from typing import Any, NoReturn

SHUT_DOWN_MESSAGE = "this LLM was shut down; build a new one"


class ShutDown:
    """Every attribute read or write, item access, membership test, iteration, length or truth test
    raises `RuntimeError(SHUT_DOWN_MESSAGE)`. Dunder lookups (copy, pickle and introspection probes)
    get the usual `AttributeError`, and `repr` works, so debuggers and loggers still can show it."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise RuntimeError(SHUT_DOWN_MESSAGE)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise RuntimeError(SHUT_DOWN_MESSAGE)

    def __getitem__(self, key: Any) -> NoReturn:
        raise RuntimeError(SHUT_DOWN_MESSAGE)

    def __contains__(self, key: Any) -> NoReturn:
        raise RuntimeError(SHUT_DOWN_MESSAGE)

    def __iter__(self) -> NoReturn:
        raise RuntimeError(SHUT_DOWN_MESSAGE)

    def __len__(self) -> NoReturn:
        raise RuntimeError(SHUT_DOWN_MESSAGE)

    def __bool__(self) -> NoReturn:
        raise RuntimeError(SHUT_DOWN_MESSAGE)

    def __repr__(self) -> str:
        return "<shut down>"


__all__ = ["SHUT_DOWN_MESSAGE", "ShutDown"]
