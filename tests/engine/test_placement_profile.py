"""bench placement --profile's co-run measure on a real model: one pinned one-thread process per core."""
from __future__ import annotations

import os

import pytest

from calid.bench.placement import measure_corun
from calid.models.presets import TEST_MODEL

pytestmark = pytest.mark.model


def test_corun_times_a_step_alone_and_beside_every_other_core():
    cores = len(os.sched_getaffinity(0))
    slowdown, ms = measure_corun(TEST_MODEL, tokens=4, rounds=1)
    assert ms["cores"] == cores
    if cores < 2:
        assert slowdown == 1.0
        return
    assert slowdown >= 1.0 and ms["alone_ms"] > 0 and ms["together_ms"] > 0
    assert slowdown == pytest.approx(max(1.0, ms["together_ms"] / ms["alone_ms"]), rel=0.01)
