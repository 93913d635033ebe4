"""``python -m benchmarks.instructions``: callgrind's count of one heartbeat, taken the
way the benchmark takes it (a real server under valgrind, a real client)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from benchmarks.instructions import Count, callgrind_total, main, table

IN_CI = os.environ.get("CI") == "true"


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


@pytest.mark.skipif(shutil.which("valgrind") is None and not IN_CI, reason="valgrind not installed")
def test_a_request_is_counted(capsys: pytest.CaptureFixture[str]) -> None:
    """The HTTP server: its start-up under callgrind is half the MQTT server's (36 s
    against 73 s here), and both are driven, counted and read by the same code; the
    MQTT figure is ``python -m benchmarks.instructions --server mqtt`` (BENCHMARKS.md)."""
    assert main(["--server", "http", "--count", "10", "--connections", "2"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    per_request = int(row.split("|")[4].split()[0].replace(",", ""))
    # A request read, answered and its wake-up: hundreds of thousands of instructions,
    # not nothing (a client that was not answered fails the run before this).
    assert 1_000 < per_request < 10_000_000, row
