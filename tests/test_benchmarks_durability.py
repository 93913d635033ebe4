"""``python -m benchmarks.durability`` on tiny sizes: every part measures every server
(Mosquitto's only where it is installed), nothing PUBACKed is lost where nothing
crashed or where the store promised to keep it (``always``), and the drill's counts
do see a loss: ``off`` (commits at shutdown only) loses the absent subscribers'
messages to ``kill -9``, and a report holding such a drill fails."""

from __future__ import annotations

import pytest

from benchmarks.durability import Report, run
from benchmarks.durability.targets import MODES
from loadtest.mqtt_targets import mosquitto_binary


@pytest.mark.slow
def test_a_tiny_run_measures_every_part_and_loses_nothing_acknowledged(capsys: pytest.CaptureFixture[str]) -> None:
    report = run(["--quick", "--drill-modes", "always,off"])
    out = capsys.readouterr().out
    peers = ["mosquitto"] if mosquitto_binary() else []

    # 1. Throughput: each server measured, and every PUBACKed message (queued or
    # retained) came back: nothing crashed, so nothing may be missing.
    assert list(report.rates) == [*MODES, *peers]
    for mode, (rates,) in report.rates.items():
        assert rates.queued > 0 and rates.retained > 0, mode
        assert rates.acked == rates.delivered == 600, (mode, rates)
        assert rates.retained_acked == rates.retained_seen == 600, (mode, rates)

    # 2. Start-up: both stores, one and two workers, restored whole.
    assert report.built is not None and report.built.size > 0
    assert [(workers, len(rounds)) for _, workers, rounds in report.starts] == [(1, 1), (2, 1), (1, 1), (2, 1)]
    for name, workers, (started,) in report.starts:
        assert 0 < started.connack < 60 and started.rss >= started.holder_rss > 10_000_000, (name, workers)
    assert {s.restored for _, _, (s,) in report.starts} == {(0, 0, 1, 1), (2000, 0, 100, 1000)}
    assert [s.resumed for _, _, (s,) in report.starts] == [-1, -1, 10, 10]

    # 3. The drill: with sync always, every PUBACKed (and PUBREC'd) message reached every
    # subscriber after the kill, and every session of the presence logs ended once.
    always = report.drills["always"]
    assert always.acked > 100 and always.published2 > 20
    assert always.total_lost == 0 and always.total_lost2 == 0, (always.lost, always.lost2)
    assert always.sessions_present == 4
    assert always.history is not None
    assert always.history.ok, always.history.summary()
    assert always.reasons.get("server-lost", 0) >= 50  # the devices online at the kill, ended once
    assert always.reasons.get("server-shutdown", 0) >= 50  # those online at the clean stop
    # ... and the counts can fail: off keeps nothing between its saves.
    off = report.drills["off"]
    assert off.total_lost > 0 and off.history is not None and not off.history.ok
    assert list(report.drills) == ["always", "off", *peers]
    assert report.ok and out.rstrip().endswith("PASS")
    assert not Report(drills={"always": off}).ok

    for heading in ("1. QoS 1 to 2 absent", "2. Start-up", "3. Crash drill"):
        assert heading in out
    assert "idlekeeper always --workers 2" in out


def test_its_options_are_bounded() -> None:
    for bad in (["--rounds", "0"], ["--parts", "speed"], ["--drill-modes", "in-memory"], ["--drill-devices", "99999"]):
        with pytest.raises(SystemExit):
            run(bad)
