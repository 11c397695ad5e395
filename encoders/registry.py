"""Name -> builder registries for towers, projectors and preprocessors.

Recipes name their parts as strings ("open_clip", "mlp", ...); these plain dicts are where those
strings resolve. Plain dicts (not entry points) keep the lookup obvious and let a research team
register its own tower with one decorator in its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=Callable[..., Any])

#: tower name -> class; the class has ``from_config(cfg: dict) -> Tower``
TOWERS: dict[str, Any] = {}
#: projector name -> class; the class has ``from_config(cfg: dict, in_dim: int, out_dim: int) -> Projector``
PROJECTORS: dict[str, Any] = {}
#: preprocessor name -> class; the class has ``from_config(cfg: dict) -> Preprocessor``
PREPROCESSORS: dict[str, Any] = {}


def _register(table: dict[str, Any], kind: str, name: str) -> Callable[[T], T]:
    def decorate(obj: T) -> T:
        if name in table and table[name] is not obj:
            raise ValueError(f"{kind} name {name!r} is already registered to {table[name]!r}")
        table[name] = obj
        return obj

    return decorate


def register_tower(name: str) -> Callable[[T], T]:
    """Class decorator: make a tower buildable by ``name`` from a recipe."""
    return _register(TOWERS, "tower", name)


def register_projector(name: str) -> Callable[[T], T]:
    """Class decorator: make a projector buildable by ``name`` from a recipe."""
    return _register(PROJECTORS, "projector", name)


def register_preprocessor(name: str) -> Callable[[T], T]:
    """Class decorator: make a preprocessor buildable by ``name``."""
    return _register(PREPROCESSORS, "preprocessor", name)


def lookup(table: dict[str, Any], kind: str, name: Any) -> Any:
    """Resolve ``name`` in ``table`` or raise a ValueError that lists every valid name."""
    _ensure_builtins_registered()
    if not isinstance(name, str) or name not in table:
        valid = ", ".join(sorted(table)) or "(none registered)"
        raise ValueError(f"unknown {kind} name {name!r}; valid {kind} names: {valid}")
    return table[name]


def require_name(cfg: Any, kind: str) -> str:
    """The ``name`` key of a part's config, with a clear error when the config is malformed."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{kind} config must be a dict with a 'name' key, got {type(cfg).__name__}")
    if "name" not in cfg:
        _ensure_builtins_registered()
        table = {"tower": TOWERS, "projector": PROJECTORS, "preprocessor": PREPROCESSORS}[kind]
        raise ValueError(f"{kind} config has no 'name' key; valid {kind} names: {', '.join(sorted(table))}")
    return cfg["name"]


def _ensure_builtins_registered() -> None:
    """Import the built-in part modules so their decorators have run before any lookup.

    Imported lazily because vision/audio modules pull in open_clip/torchaudio, which users of
    only the graph encoder should not pay for at import time of the registry itself.
    """
    from encoders import audio_towers, graph_tower, projectors, vision_towers  # noqa: F401
