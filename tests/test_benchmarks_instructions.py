"""``python -m benchmarks.instructions``: callgrind's count of one heartbeat, taken the
way the benchmark takes it (a real server under valgrind, a real client)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.instructions import Count, callgrind_total, table


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
