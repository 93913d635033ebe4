"""``python -m benchmarks.instructions``: callgrind's count of one heartbeat, taken the
way the benchmark takes it (a real server under valgrind, a real client)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.instructions import DRAIN_WINDOW, Count, callgrind_total, drain_client, table
from loadtest.processes import free_port, start_heartbeat, stop


def test_the_total_is_the_largest_summary_over_the_parts(tmp_path: Path) -> None:
    (tmp_path / "run.out").write_text("events: Ir\nsummary: 1000\n")
    (tmp_path / "run.out.2").write_text("events: Ir\ntotals: 2500\n")
    assert callgrind_total(tmp_path / "run.out") == 2500
    (tmp_path / "empty.out").write_text("events: Ir\n")
    with pytest.raises(RuntimeError):
        callgrind_total(tmp_path / "empty.out")


def test_each_tree_is_read_against_the_first() -> None:
    before = Count("mqtt", "/before", 100, loaded=1_000_000, idle=500_000)
    after = Count("mqtt", "/after", 100, loaded=1_100_000, idle=500_000)
    assert (before.per_item, after.per_item) == (5000, 6000)
    rows = table([before, after]).splitlines()
    assert rows[2].endswith("| 5,000 per heartbeat | 1.000× |")
    assert rows[3].endswith("| 6,000 per heartbeat | 1.200× |")


def test_a_drained_message_is_counted_as_one() -> None:
    rows = table([Count("drain", "/tree", 100, loaded=2_000_000, idle=500_000)]).splitlines()
    assert rows[2].endswith("| 15,000 per drained message | 1.000× |")


def test_the_drain_client_queues_then_takes_back_every_message_in_order() -> None:
    """The load the drain's count is taken under, against a real server (not under
    valgrind here): the session is present on return and every message comes once,
    in order, through a window of 20; the client checks that itself and raises."""
    port = free_port()
    proc = start_heartbeat(port, 1, ["--max-inflight", str(DRAIN_WINDOW), "--max-queued", "1000"])
    try:
        drain_client(port, 500, back=True)
        assert proc.poll() is None
    finally:
        stop(proc)
