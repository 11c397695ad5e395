"""Malformed rows: the error a row raises, and `data.skip_bad_rows`, which passes over such rows.

A `BadRow` is a problem of one row (bad JSON, a missing caption, an image that does not decode);
any other error (a file that cannot be read, a corrupt shard, a missing column) is the whole file's
and always stops the run. With `data.skip_bad_rows: true` the data sets drop the rows they find
bad when they load (`skipped`, counted before training starts), and `SkipBadRows` passes over a row
that fails only when it is read (an image whose header is fine but whose pixels are not): item i is
then the next good row after it. That choice is a pure function of i, so batches stay identical
whatever the loader's worker count, and the rows passed over travel with the example
(`Example.skipped`) to the trainer, which counts them in metrics.jsonl and the run summary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: bad rows in a row `SkipBadRows` passes over before it gives up (a data set this broken is the
#: file's problem, not a few rows')
MAX_CONSECUTIVE_BAD = 64


class BadRow(ValueError):
    """One row cannot become an example; the message starts with where it is (`file:line: `)."""


class SkipBadRows:
    """`dataset` whose item i is its first good item at i, i + 1, ... (wrapping around)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # vocab_words, skipped, check_all_items, ...
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index: int):
        n = len(self.dataset)
        passed: list[str] = []
        for k in range(min(n, MAX_CONSECUTIVE_BAD)):
            try:
                example = self.dataset[(index + k) % n]
            except BadRow as exc:
                passed.append(str(exc))
                continue
            return dataclasses.replace(example, skipped=(*example.skipped, *passed)) if passed else example
        raise ValueError(
            f"data.skip_bad_rows: {len(passed)} bad rows in a row from item {index}, the last: "
            f"{passed[-1][:300]}; a data set this broken is refused"
        )
