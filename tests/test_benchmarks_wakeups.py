"""The wake-up benchmark, CI-sized: every heartbeat answered with and without coalescing,
and figures that are figures (the speed itself is measured by the benchmark, not here)."""

from __future__ import annotations

from benchmarks.wakeups import wakeup_floor


def test_the_wakeup_floor_is_measured_for_both_loops() -> None:
    floor = wakeup_floor(rate=50, seconds=0.5)
    assert floor["epoll_us_per_wakeup"] > 0 and floor["trio_us_per_wakeup"] > 0
