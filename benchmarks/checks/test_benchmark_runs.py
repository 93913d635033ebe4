"""The benchmark programs run small, against real servers (and Mosquitto beside ours):
callgrind's count of a heartbeat (``benchmarks.instructions``), a scale shape
(``benchmarks.scale``), the wake-up benchmark with and without coalescing
(``benchmarks.wakeups``), and a tiny topic-filter run (``benchmarks.topics``). Each
checks that the program drives its servers and reads figures that are figures; the
figures themselves are the benchmarks' (BENCHMARKS.md). ``make bench`` runs these
first; they take about two minutes, which the test suite cannot spare."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from benchmarks import instructions, scale, topics
from benchmarks.wakeups import measure_server
from loadtest.mqtt_targets import mosquitto_binary

IN_CI = os.environ.get("CI") == "true"


@pytest.mark.skipif(shutil.which("valgrind") is None and not IN_CI, reason="valgrind not installed")
def test_a_heartbeat_is_counted(capsys: pytest.CaptureFixture[str]) -> None:
    assert instructions.main(["--server", "mqtt", "--count", "10", "--connections", "2"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    per_heartbeat = int(row.split("|")[4].split()[0].replace(",", ""))
    # A PINGREQ read, answered and its wake-up: tens of thousands of instructions, not
    # nothing (a client that was not answered fails the run before this).
    assert 1_000 < per_heartbeat < 10_000_000, row


def test_one_small_shape_is_run_and_every_heartbeat_answered(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--shape", "50x20", "--seconds", "2", "--warmup", "0", "--touch-rounds", "2", "--repeat", "1"]
    assert scale.main([*args, "--no-mosquitto"]) == 0
    out = capsys.readouterr().out
    assert "pair 1: 50 devices at 20/s: idlekeeper " in out and "| 50 | 20 | " in out


def test_both_servers_are_measured_in_one_window() -> None:
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run installs it)")
    pair = scale.measure_pair(50, 20.0, seconds=2, coalesce=1.0, warmup=0)
    ours, theirs = pair["idlekeeper"], pair["Mosquitto"]
    assert ours["answered"] == theirs["answered"] == 1.0
    assert ours["cpu_pct_per_1k"] > 0 and theirs["cpu_pct_per_1k"] > 0
    # The two drivers start their windows at the same instant, give or take a connect.
    assert abs(ours["window_start"] - theirs["window_start"]) < 0.5


def test_every_heartbeat_is_answered_with_and_without_coalescing() -> None:
    for coalesce in (0.0, 0.1):
        row = measure_server(devices=50, rate=20, seconds=2, coalesce=coalesce)
        assert row["answered"] == 1.0
        assert row["heartbeats_per_s"] > 15 and row["cpu_pct_per_1k"] > 0


def test_mosquitto_is_driven_and_measured_the_same_way() -> None:
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run installs it)")
    row = measure_server(devices=50, rate=20, seconds=2, coalesce=None)
    assert row["answered"] == 1.0 and row["coalesce"] == -1.0
    assert row["heartbeats_per_s"] > 15 and row["cpu_pct_per_1k"] > 0


@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists() and not IN_CI,
                    reason="mosquitto not installed")  # fmt: skip
def test_a_tiny_run_beside_mosquitto(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--filters", "0,50", "--rates", "100", "--seconds", "0.5", "--devices", "2", "--memory", "100"]
    assert topics.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| ours |", "| mosquitto |"))]
    windows = {(r[0][2:], r[1], r[3]): r for r in rows if len(r) == 10}
    for server in ("ours", "mosquitto"):
        assert {t for s, n, t in windows if s == server and n == "50"} == {"subscribing", "quiet", "none", "one"}
        one = windows[(server, "50", "one")]
        assert one[9].rstrip(" |") != "0"  # the one filter that matches got the messages
        assert windows[(server, "50", "none")][9].rstrip(" |") == "0"
        assert windows[(server, "50", "quiet")][6].endswith(" ms")  # the devices' pings were answered
    assert "| server / mosquitto |" in out and "bytes per wildcard filter" in out
