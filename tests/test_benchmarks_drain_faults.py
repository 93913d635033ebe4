"""``python -m benchmarks.drain_faults`` on a small queue: the drill passes (a worker
killed and the supervisor stopped mid-drain, nothing lost), and says what it did."""

from __future__ import annotations

import pytest

from benchmarks.drain_faults import main


def test_a_drain_through_a_killed_worker_and_a_stalled_supervisor_loses_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--messages", "3000", "--stall", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "delivered              3,000 of 3,000; missing 0" in out
    assert "session present        True" in out
    assert "result                 PASS" in out


def test_one_worker_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--workers", "1"])
