"""One launch path for the runner's Triton kernels, so that start-up can build them all at once.

Why: a cold start builds each kernel specialisation the first time a launch meets it, one after another
(W1's model on an H200: 13 builds, 7.5 s of a 15 s construction). Triton's compiler spends most of a
build in native code that releases the GIL (MLIR passes, LLVM, ptxas), so builds run side by side on
threads; what is missing is knowing the specialisations before the launches that need them.

`launch(kernel, grid)(*args, **kwargs)` is `kernel[grid](*args, **kwargs)`. Inside `build_ahead()` it
only *builds*: Triton's `warmup` binds the same arguments with the same binder, so the cache key is the
one the real launch will look up, and under Triton's `AsyncCompileMode` the build is submitted to a
thread pool instead of run in place. Start-up runs a step's code once that way (the torch ops run for
real on scratch data, the Triton kernels only get built), leaves the block (which waits for every
build and fills the kernels' in-memory caches), then runs the step for real on warm caches.

A build that fails inside the block is dropped there: the real launch builds it again and raises its
error where it would have without this module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

logger = logging.getLogger(__name__)

_BUILD_ONLY: ContextVar[bool] = ContextVar("bridge_triton_build_only", default=False)

# Threads for start-up kernel builds: unset or "0" turns build-ahead off (every build in place, as
# before); "auto" takes min(8, cores).
BUILD_THREADS_ENV = "BRIDGE_KERNEL_BUILD_THREADS"


def launch(kernel: Any, grid: Any) -> Callable[..., Any]:
    """`kernel[grid]`, or inside `build_ahead()` a call that builds the same specialisation and
    launches nothing."""
    if _BUILD_ONLY.get():
        return functools.partial(kernel.warmup, grid=grid)
    return kernel[grid]


def build_threads_from_env() -> int:
    """The thread count `BRIDGE_KERNEL_BUILD_THREADS` asks for (0: off)."""
    raw = os.environ.get(BUILD_THREADS_ENV, "0").strip().lower()
    if raw == "auto":
        return min(8, os.cpu_count() or 1)
    try:
        return max(0, int(raw))
    except ValueError:
        logger.warning("%s=%r is not an int or 'auto': kernel builds stay in place", BUILD_THREADS_ENV, raw)
        return 0


@contextlib.contextmanager
def build_ahead(threads: int) -> Iterator[bool]:
    """Inside the block, `launch` builds on `threads` threads instead of launching; leaving the block
    waits for every build and puts it in its kernel's cache.

    Yields whether it is on. It stays off (yields False, changes nothing) with fewer than 2 threads,
    under the Triton interpreter (nothing to build), without Triton's async-compile mode, or when
    another build-ahead block is active in this context.
    """
    mode_cls = _async_compile_mode()
    if threads < 2 or mode_cls is None or _BUILD_ONLY.get() or os.environ.get("TRITON_INTERPRET") == "1":
        yield False
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-build") as pool:
        try:
            mode = mode_cls(pool, ignore_errors=True)
            mode.__enter__()
        except RuntimeError:  # another AsyncCompileMode is active (someone else's): leave it be
            yield False
            return
        token = _BUILD_ONLY.set(True)
        try:
            yield True
        finally:
            _BUILD_ONLY.reset(token)
            mode.__exit__(None, None, None)


def _async_compile_mode() -> type | None:
    try:  # Triton >= 3.4; a private module, hence the fallback to building in place
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


__all__ = ["BUILD_THREADS_ENV", "build_ahead", "build_threads_from_env", "launch"]
