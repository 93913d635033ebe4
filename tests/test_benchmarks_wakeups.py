"""The wake-up benchmark, CI-sized: every heartbeat answered with and without coalescing,
and figures that are figures (the speed itself is measured by the benchmark, not here)."""

from __future__ import annotations

import pytest

from benchmarks.wakeups import measure_server, wakeup_floor
from loadtest.mqtt_targets import mosquitto_binary


def test_every_heartbeat_is_answered_with_and_without_coalescing() -> None:
    for coalesce in (0.0, 0.1):
        row = measure_server(devices=50, rate=20, seconds=2, coalesce=coalesce)
        assert row["answered"] == 1.0
        assert row["heartbeats_per_s"] > 15 and row["cpu_pct_per_1k"] > 0


def test_the_wakeup_floor_is_measured_for_both_loops() -> None:
    floor = wakeup_floor(rate=50, seconds=0.5)
    assert floor["epoll_us_per_wakeup"] > 0 and floor["trio_us_per_wakeup"] > 0


def test_mosquitto_is_driven_and_measured_the_same_way() -> None:
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run installs it)")
    row = measure_server(devices=50, rate=20, seconds=2, coalesce=None)
    assert row["answered"] == 1.0 and row["coalesce"] == -1.0
    assert row["heartbeats_per_s"] > 15 and row["cpu_pct_per_1k"] > 0
