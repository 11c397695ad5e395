"""One launch path for the runner's Triton kernels, so that start-up can build them all at once.

Why: a cold start builds each kernel specialisation the first time a launch meets it, one after another
(about half of a cold construction goes to builds). Triton's compiler spends most of a
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
import itertools
import logging
import os
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Inside `build_ahead()`: the specialisations already handed to Triton in this block, by kernel (None
# outside). Triton files a build in a kernel's in-memory cache only when the block ends, so without this
# every later launch of the same specialisation would pay Triton's whole key computation again (start-up
# makes thousands of launches, and on a warm cache that was the pass's whole cost).
_BUILD_ONLY: ContextVar[set | None] = ContextVar("bridge_triton_build_only", default=None)


def _interpreter_accepts_numpy_2_4() -> None:
    """Let the runner's kernels run under TRITON_INTERPRET=1 with NumPy >= 2.4 (every kernel launches
    through this module, so importing it is enough).

    Triton 3.6's interpreter turns a runtime loop bound into an int with `int(array_of_shape_1)`, which
    NumPy 2.4 rejects, so every kernel whose loop bound is a runtime value fails in interpreter mode.
    Re-register `__index__` with an explicit element read. Interpreter only; compiled kernels are untouched.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_accepts_numpy_2_4", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._accepts_numpy_2_4 = True
    interpreter._patch_lang_tensor = patched


_interpreter_accepts_numpy_2_4()



def launch(kernel: Any, grid: Any) -> Callable[..., Any]:
    """`kernel[grid]`, or inside `build_ahead()` a call that builds the same specialisation and
    launches nothing."""
    seen = _BUILD_ONLY.get()
    if seen is None:
        return kernel[grid]
    return functools.partial(_build_once, seen, kernel, grid)


def _build_once(seen: set, kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """`kernel.warmup(...)` unless this block already handed Triton the same specialisation."""
    try:
        key = _launch_key(kernel, args, kwargs)
    except TypeError:  # an argument this key cannot describe: let Triton decide
        kernel.warmup(*args, grid=grid, **kwargs)
        return
    if key not in seen:
        seen.add(key)
        kernel.warmup(*args, grid=grid, **kwargs)


def _launch_key(kernel: Any, args: tuple, kwargs: dict) -> Hashable:
    """A key at least as fine as the specialisation Triton binds `args` and `kwargs` to: constexprs (and
    every argument of a kernel whose parameters are unknown) by value; other ints by what Triton
    specialises them on (width class, == 1, divisibility by 16); tensors by dtype and 16-byte alignment.
    Finer is harmless (one more warm-up, answered from Triton's cache); coarser would skip a build, so
    whatever it cannot describe raises TypeError."""
    params = getattr(kernel, "params", None) or ()
    constexpr = itertools.chain((getattr(p, "is_constexpr", True) for p in params),
                                itertools.repeat(True))  # beyond the known parameters: by value
    positional = tuple(_argument_key(a, exact) for a, exact in zip(args, constexpr))
    named = tuple(sorted((k, _argument_key(v, True)) for k, v in kwargs.items()))
    return (id(kernel), positional, named)


def _argument_key(value: Any, exact: bool) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, int) and not isinstance(value, bool) and not exact:
        return ("int", value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_argument_key(v, exact) for v in value))
    hash(value)  # TypeError for the unhashable
    return (type(value).__qualname__, value)


@contextlib.contextmanager
def build_ahead(threads: int) -> Iterator[bool]:
    """Inside the block, `launch` builds on `threads` threads instead of launching; leaving the block
    waits for every build and puts it in its kernel's cache.

    Yields whether it is on. It stays off (yields False, changes nothing) with fewer than 2 threads,
    under the Triton interpreter (nothing to build), without Triton's async-compile mode, or when
    another build-ahead block is active in this context.
    """
    mode_cls = _async_compile_mode()
    if threads < 2 or mode_cls is None or _BUILD_ONLY.get() is not None \
            or os.environ.get("TRITON_INTERPRET") == "1":
        yield False
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-build") as pool:
        try:
            mode = mode_cls(pool, ignore_errors=True)
            mode.__enter__()
        except RuntimeError:  # another AsyncCompileMode is active (someone else's): leave it be
            yield False
            return
        token = _BUILD_ONLY.set(set())
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


__all__ = ["build_ahead", "launch"]
