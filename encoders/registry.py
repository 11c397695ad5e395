"""Name -> class registries for towers, projectors and preprocessors.

Recipes name their parts as strings ("open_clip", "mlp", ...); these plain dicts are where those
strings resolve. Plain dicts (not entry points) keep the lookup obvious and let a research team
register its own tower with one decorator in its own module. A name may also be a reference
``"package.module:ClassName"``, imported on lookup, so a part needs no registration at all.

This module is a leaf: it imports nothing of its own package. The built-in parts register
themselves when ``encoders.builtins`` is imported (``encoders.api`` and ``encoders.encoder`` do).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T", bound=Callable[..., Any])

#: tower name -> class; the class has ``from_config(cfg: dict) -> Tower``
TOWERS: dict[str, Any] = {}
#: projector name -> class; the class has ``from_config(cfg: dict, in_dim: int, out_dim: int) -> Projector``
PROJECTORS: dict[str, Any] = {}
#: preprocessor name -> class; the class has ``from_config(cfg: dict) -> Preprocessor``
PREPROCESSORS: dict[str, Any] = {}

_TABLES = {"tower": TOWERS, "projector": PROJECTORS, "preprocessor": PREPROCESSORS}


def _defining_file(obj: Any) -> str | None:
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    path = getattr(module, "__file__", None)
    return str(Path(path).resolve()) if path else None


def _same_definition(a: Any, b: Any) -> bool:
    """The same class from the same file, imported twice under two module names (a recipe's
    `imports: [my_tower.py]` after a script's `import my_tower`): not a name clash."""
    return getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None) and (
        _defining_file(a) is not None and _defining_file(a) == _defining_file(b)
    )


def _register(table: dict[str, Any], kind: str, name: str) -> Callable[[T], T]:
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"{kind} name must be a non-empty string without ':', got {name!r}")

    def decorate(obj: T) -> T:
        if name in table and table[name] is not obj and not _same_definition(table[name], obj):
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


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_reference(ref: str, kind: str = "class") -> Any:
    """``"package.module:ClassName"`` -> the class (the module is imported first)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{kind} reference {_clip(ref)!r}: expected 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported by name
        raise ValueError(
            f"{kind} reference {_clip(ref)!r}: cannot import module {_clip(module_name)!r}: "
            f"{type(exc).__name__}: {_clip(str(exc))}"
        ) from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} reference {_clip(ref)!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def lookup(table: dict[str, Any], kind: str, name: Any) -> Any:
    """Resolve ``name`` (a registered name or ``"module:Class"``) or raise a ValueError that lists
    every valid name and the nearest one."""
    if isinstance(name, str) and ":" in name:
        return resolve_reference(name, kind)
    if not isinstance(name, str) or name not in table:
        valid = ", ".join(sorted(table)) or "(none registered)"
        close = difflib.get_close_matches(name, list(table), n=1) if isinstance(name, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown {kind} name {_clip(repr(name))}{hint}; valid {kind} names: {valid}, "
            f"or 'package.module:ClassName' (a recipe's `imports:` loads modules that register more)"
        )
    return table[name]


def require_name(cfg: Any, kind: str) -> str:
    """The ``name`` key of a part's config, with a clear error when the config is malformed."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{kind} config must be a dict with a 'name' key, got {type(cfg).__name__}")
    if "name" not in cfg:
        raise ValueError(
            f"{kind} config has no 'name' key; valid {kind} names: {', '.join(sorted(_TABLES[kind]))}"
        )
    return cfg["name"]
