"""Import a research team's own modules (towers, projectors, preprocessors, datasets) by name or
by ``.py`` path, so a recipe or a saved encoder can use parts that live outside this package.

Why paths as well as module names: a tower written next to a recipe (``my_tower.py``) is not on
``sys.path`` when ``bridge train`` runs. A path is resolved against the folder of the file that
names it (the recipe, or the encoder checkpoint's config), and is recorded as an absolute path so
that loading a checkpoint imports the same file again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_path_spec(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def resolve_spec(spec: str, base_dir: str | Path | None = None) -> str:
    """A module name stays as is; a ``.py`` path becomes absolute (relative to ``base_dir``)."""
    if not is_path_spec(spec):
        return spec
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return str(path.resolve())


def _module_for_file(path: Path) -> ModuleType | None:
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path:
            return module
    return None


def _import_file(path: Path) -> ModuleType:
    existing = _module_for_file(path)
    if existing is not None:
        return existing
    name = path.stem
    if not name.isidentifier() or name in sys.modules:
        name = f"bridge_user_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a Python module file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def import_modules(
    specs: Sequence[str], base_dir: str | Path | None = None, where: str = "imports"
) -> list[str]:
    """Import every spec (module name or ``.py`` path); returns the resolved specs.

    A failure raises ValueError naming the spec, the resolved path and ``where`` it was listed
    (a recipe key or a checkpoint file), with the import's own error.
    """
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise ValueError(f"{where}: expected a list of module names or .py paths, got {type(specs).__name__}")
    resolved = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"{where}[{i}]: expected a module name or a .py path, got {_clip(repr(spec))}")
        target = resolve_spec(spec.strip(), base_dir)
        try:
            if is_path_spec(target):
                if not Path(target).is_file():
                    raise FileNotFoundError(f"no such file: {target}")
                _import_file(Path(target))
            else:
                importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001 - user code may raise anything; report it by name
            shown = f"{spec!r}" if target == spec else f"{spec!r} (resolved: {target})"
            raise ValueError(
                f"{where}: cannot import {_clip(shown)}: {type(exc).__name__}: {_clip(str(exc))}"
            ) from exc
        resolved.append(target)
    return resolved
