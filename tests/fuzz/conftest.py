"""Fuzz-suite settings: derandomized (the same examples every run, so the default suite is stable
and bounded in time) and no example database on disk. `HYPOTHESIS_PROFILE=explore` draws fresh
random examples instead, for a longer hunt."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "fuzz",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("explore", database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fuzz"))
