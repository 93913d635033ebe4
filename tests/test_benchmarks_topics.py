"""``python -m benchmarks.topics``: its figures read the way the report says, and a tiny
run of it against real servers (ours, and Mosquitto where installed)."""

from __future__ import annotations

import math
import os

import pytest

from benchmarks.topics import ROOT, Row, cpu_of, main, memory_per_filter, ratios, table
from benchmarks.topics_load import Window, percentile


def _row(server: str, filters: int, topic: str, cpu: float, rtts: list[float]) -> Row:
    window = Window(5.0, 1000, cpu, True, rtts, [0.002], 10)
    return Row(server, filters, 0.5, topic, 200.0, window, cpu / 1000)


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (50.0, 99.0, 100.0)
    assert percentile([3.0], 0.99) == 3.0
    assert math.isnan(percentile([], 0.5))


def test_each_window_is_set_against_the_same_window_of_mosquitto() -> None:
    rows = [
        _row("ours", 1000, "none", 0.2, [0.001, 0.004]),
        _row("mosquitto", 1000, "none", 0.05, [0.001, 0.002]),
        _row("ours", 1000, "one", 0.3, [0.001]),  # mosquitto has no such window: no ratio
    ]
    assert "| ours | 1,000 | 0.50 s | none | 200 | 200.0 µs | 1.0 ms | 4.0 ms | 2.0 ms | 10 |" in table(rows)
    lines = ratios(rows).splitlines()
    assert lines[2] == "| ours | 1,000 | none | 200 | 1.00× | 4.00× | 1.00× | 2.00× |"
    assert len(lines) == 3


def test_the_cpu_of_a_process_grows_as_it_works() -> None:
    before = cpu_of([os.getpid()])
    sum(i * i for i in range(300_000))
    assert cpu_of([os.getpid()]) > before > 0


def test_a_wildcard_filter_costs_a_few_hundred_bytes() -> None:
    got = memory_per_filter(str(ROOT), 2000)
    assert 100 < got["subscriptions"] < 2000
    assert 50 < got["index"] < got["subscriptions"]


def test_each_tree_may_have_options_of_its_own() -> None:
    from argparse import Namespace

    from benchmarks.topics import ours_args

    both = Namespace(ours_args="--max-subscriptions 30000", root_list=["/a", "/b"])
    assert ours_args(both, "/a") == ours_args(both, "/b") == ["--max-subscriptions", "30000"]
    apart = Namespace(ours_args=";--max-subscriptions 30000", root_list=["/old", "/new"])
    assert ours_args(apart, "/old") == [] and ours_args(apart, "/new") == ["--max-subscriptions", "30000"]
    with pytest.raises(SystemExit):
        main(["--roots", "/a,/b,/c", "--ours-args", "x;y"])
