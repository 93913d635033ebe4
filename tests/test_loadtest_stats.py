"""The load tester's one percentile, against its definition (nearest rank)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from loadtest.stats import percentile, summary_ms


def test_nearest_rank_on_known_values() -> None:
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(values, 5) == 15.0
    assert percentile(values, 30) == 20.0
    assert percentile(values, 40) == 20.0
    assert percentile(values, 50) == 35.0
    assert percentile(values, 100) == 50.0
    assert percentile(reversed(values), 50) == 35.0  # any iterable, any order
    assert math.isnan(percentile([], 50))


def test_a_rank_that_falls_exactly_on_a_value_is_not_rounded_up() -> None:
    # 7 / 100 * 100 is 7.000000000000001 in floating point: ceil would give rank 8.
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 7) == 7.0
    assert all(percentile(values, q) == float(q) for q in range(1, 101))


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1), st.floats(min_value=0, max_value=100))
def test_a_percentile_is_a_sample_with_enough_at_or_below_it(values: list[float], q: float) -> None:
    p = percentile(values, q)
    assert p in values
    at_or_below = sum(1 for v in values if v <= p)
    below = sum(1 for v in values if v < p)
    # Nearest rank: the smallest sample with at least q% of the samples at or below it.
    assert at_or_below >= q / 100 * len(values) - 1e-9
    assert below < max(1, math.ceil(q * len(values) / 100))


def test_summary_in_milliseconds() -> None:
    assert summary_ms([]) == {"n": 0}
    s = summary_ms([0.001, 0.002, 0.010])
    assert s["n"] == 3 and s["min"] == 1.0 and s["p50"] == 2.0 and s["p99"] == 10.0 and s["max"] == 10.0
