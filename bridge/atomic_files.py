"""Files and folders a run writes, written so that a kill at any moment leaves the old version or the
new one, never part of one.

Each is written under a hidden temp name next to its final place (`.NAME.tmp-PID`) and renamed into
place once complete: `os.replace` is atomic on one filesystem. A folder that already exists is first
renamed aside (`.NAME.old-PID`) and removed after the new one is in place. Temp names carry the
writer's PID, so `remove_stale_temps` can tell the leftovers of a killed writer from a live one's.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path


def temp_sibling(path: str | Path, kind: str = "tmp") -> Path:
    """`.NAME.KIND-PID` next to `path`."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yields a temp path next to `path`; the file the block writes there replaces `path` when the
    block ends, and is removed when it raises."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:  # on disk before the name points at it
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def replacing_dir(path: str | Path) -> Iterator[Path]:
    """Yields an empty temp folder next to `path`; when the block ends the folder replaces `path`
    (a folder already there, complete or not, is removed), and when it raises it is removed."""
    path = Path(path)
    tmp = temp_sibling(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists() or path.is_symlink():
        old = temp_sibling(path, "old")
        os.replace(path, old)
        os.replace(tmp, path)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        os.replace(tmp, path)
    _fsync_dir(path.parent)


def _pid_alive_elsewhere(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's) or unknowable: leave it
    return True


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Remove the `.NAME.tmp-PID` / `.NAME.old-PID` leftovers of `path` whose writer is gone."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?:tmp|old)-(\d+)$")
    removed = []
    for child in path.parent.iterdir():
        match = pattern.match(child.name)
        if match and not _pid_alive_elsewhere(int(match.group(1))):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child)
    return removed
