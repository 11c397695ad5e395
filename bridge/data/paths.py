"""`data.train` / `data.eval` as several files: a brace pattern (`shards/train-{00000..00099}.tar`),
a glob (`parquet/*.parquet`), or both, as webdataset and Hugging Face users write them.

Braces expand first, as webdataset expands them (the `braceexpand` package: numeric ranges keep
their zero padding, `{a,b}` lists, nesting); each result is then a glob or a plain path. A path that
exists as written is taken as it is, so a file whose name holds `[` or `{` still works. Every
expanded plain path must exist: a missing shard of a range is named, not silently left out.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

#: characters that make a data path a pattern
PATTERN_CHARS = "*?[{"
#: how to get the optional libraries the file sources need
DATA_EXTRA = "pip install -e '.[data]'"
#: problems listed per pattern (the rest are counted)
_SHOWN = 5


def is_pattern(value: str) -> bool:
    return any(c in value for c in PATTERN_CHARS)


def expand_braces(pattern: str) -> list[str]:
    """`a-{00..02}.tar` -> [a-00.tar, a-01.tar, a-02.tar] (webdataset's expansion)."""
    if "{" not in pattern:
        return [pattern]
    try:
        from braceexpand import braceexpand
    except ImportError:
        raise ValueError(f"brace patterns need the braceexpand package (the data extra: {DATA_EXTRA})") \
            from None
    return list(braceexpand(pattern))


def expand_data_paths(spec: str | os.PathLike) -> list[Path]:
    """The files (or folders) `spec` names, in pattern order (each glob sorted); ValueError naming
    what is missing when a brace-expanded path does not exist or a glob matches nothing."""
    spec = str(spec)
    if os.path.exists(spec) or not is_pattern(spec):
        return [Path(spec)]
    out: list[Path] = []
    seen: set[str] = set()
    missing: list[str] = []
    for part in expand_braces(spec):
        found = sorted(glob.glob(part)) if glob.has_magic(part) else [part] if os.path.exists(part) else []
        if not found:
            missing.append(part)
        for f in found:
            if f not in seen:
                seen.add(f)
                out.append(Path(f))
    if missing:
        more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        what = "nothing matches" if len(missing) == 1 and missing[0] == spec else "not found"
        raise ValueError(f"{what}: {', '.join(missing[:_SHOWN])}{more}")
    return out
