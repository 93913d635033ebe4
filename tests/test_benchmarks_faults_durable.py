"""``python -m benchmarks.faults_durable`` on a small box: a worker killed, one stalled,
hostile input, a SIGTERM and a crash of every process, each device's presence told
once across the three runs, and the drill says so."""

from __future__ import annotations

import pytest

from benchmarks.faults_durable import main


def test_the_durable_box_drill_passes_and_says_what_it_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--devices", "120", "--workers", "2", "--subscribers", "2"]) == 0
    out = capsys.readouterr().out
    for line in (
        "worker_lost_right                      True",
        "ended_by_the_stall                     0",
        "server_shutdown_right                  True",
        "server_lost_right                      True",
        "history_ok                             True",
        "result                                 PASS",
    ):
        assert line in out, out
