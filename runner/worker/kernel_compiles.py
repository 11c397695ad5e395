"""Counts the Triton kernel specialisations this process builds, and the time they take.

Why: a specialisation is built (compiled, or loaded from Triton's disk cache) the first time a launch
meets new constexpr values or argument properties, and a compile stalls that step for up to seconds.
The warm-up at construction exists to pay those costs early; this counter says whether it did: a
server whose compile count still grows under traffic is paying them per request burst (e.g. a
prefill step with a number of requests no warm-up step had). `LLM.kernel_compiles` reads it and
`bridge serve` exports it to /metrics.

Triton's runtime hooks (`triton.knobs.runtime.jit_cache_hook`, called before a build on an
in-memory cache miss, and `jit_post_compile_hook`, after it) are chained, never replaced: a hook
installed before this one still runs. Builds made side by side at start-up
(`runner.layers.triton_launch.build_ahead`) are counted when their pass ends, and each one's seconds run
from its submission to that end: they overlap, so their sum is more than the pass took.
Triton's `knobs.compilation.listener` (after every build, with whether its on-disk cache answered) is
chained the same way: `disk_cache_hits` tells a start-up on a warm machine from one on a cold machine.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class KernelCompiles:
    """Specialisations built so far in this process (all devices), their total seconds, the last few."""

    count: int = 0
    seconds: float = 0.0
    #: of `count`, the builds Triton loaded from its on-disk cache instead of compiling (a warm machine)
    disk_cache_hits: int = 0
    recent: list[tuple[str, float]] = field(default_factory=list)
    _started: dict[Any, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _before(self, key: Any) -> None:
        with self._lock:
            self._started[key] = time.perf_counter()

    def _after(self, key: Any, name: str) -> None:
        now = time.perf_counter()
        with self._lock:
            took = now - self._started.pop(key, now)
            self.count += 1
            self.seconds += took
            self.recent = [*self.recent[-15:], (name, took)]
        logger.debug("built Triton kernel %s in %.3f s", name, took)


_COMPILES: KernelCompiles | None = None


def kernel_compiles() -> KernelCompiles | None:
    """The process's counter, installing the hooks on first use; None without Triton's hooks."""
    global _COMPILES
    if _COMPILES is not None:
        return _COMPILES
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without runtime hooks
        return None
    runtime = getattr(knobs, "runtime", None)
    if not all(hasattr(runtime, hook) for hook in ("jit_cache_hook", "jit_post_compile_hook")):
        return None
    counter = KernelCompiles()
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def cache_hook(*args: Any, **kwargs: Any) -> bool | None:
        counter._before(kwargs.get("key"))
        return before(*args, **kwargs) if before else None  # True from a chained hook skips the build

    def post_compile_hook(*args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(fn)
        constants = (kwargs.get("compile") or {}).get("constants")
        if constants:  # which specialisation: its constexpr values, bounded
            name = f"{name} {str(constants)[:160]}"
        counter._after(kwargs.get("key"), name)
        return after(*args, **kwargs) if after else None

    runtime.jit_cache_hook = cache_hook
    runtime.jit_post_compile_hook = post_compile_hook
    compilation = getattr(knobs, "compilation", None)
    if compilation is not None and hasattr(compilation, "listener"):
        listener = compilation.listener

        def on_compiled(*args: Any, **kwargs: Any) -> Any:  # after each compile() (hit or not)
            if kwargs.get("cache_hit"):
                with counter._lock:
                    counter.disk_cache_hits += 1
            return listener(*args, **kwargs) if listener else None

        compilation.listener = on_compiled
    _COMPILES = counter
    return counter
