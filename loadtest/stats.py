"""The few statistics the load tester reports: nearest-rank percentiles and their summary."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["percentile", "summary_ms"]


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    # q * n / 100 rather than q / 100 * n: for a whole q the product is exact, so a rank
    # that falls exactly on a value (q=7, n=100) is not pushed one rank up by rounding.
    return ordered[max(1, math.ceil(q * len(ordered) / 100)) - 1]


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    """Count, min, p50, p99 and max of durations in seconds, in milliseconds."""
    if not values:
        return {"n": 0}
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "min": min(ms),
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "max": max(ms),
    }
