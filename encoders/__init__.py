"""encoders: towers, projectors and their registries for vision, audio and graphs.

Meets the runner's encoder protocol structurally and never imports `runner` or `bridge`.

The package's names are `encoders.api`'s, imported on first use: importing one small module of the
package (`encoders.media_budget`, whose limits `bridge serve` reads for its flags) does not load every
tower with torchvision and open_clip (seconds, on the server's start-up path).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any


def __getattr__(name: str) -> Any:
    if (name.startswith("__") and name != "__all__") or importlib.util.find_spec(f"encoders.{name}"):
        # a submodule (`from encoders import audio_inputs`): the import system loads it on this answer
        raise AttributeError(f"module 'encoders' has no attribute {name!r}")
    api = importlib.import_module("encoders.api")
    if name == "__all__":
        return api.__all__
    if name not in api.__all__:
        raise AttributeError(f"module 'encoders' has no attribute {name!r}")
    value = getattr(api, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *importlib.import_module("encoders.api").__all__])
