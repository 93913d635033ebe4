"""benchmarks.operator_errors measures what an operator reads: its cells are real."""

from __future__ import annotations

from pathlib import Path

from benchmarks.operator_errors import ROOT, cases, run_case


def test_a_refused_value_is_measured_as_one_line_and_exit_2(tmp_path: Path) -> None:
    outcome = run_case(ROOT, ["servers.heartbeat", "--port", "0", "--tick", "0"], tmp_path, limit=30)
    assert (outcome.code, outcome.lines, outcome.traceback) == (2, 1, False)
    assert "--tick" in outcome.first


def test_a_server_that_starts_is_measured_as_running_and_stopped(tmp_path: Path) -> None:
    outcome = run_case(ROOT, ["servers.heartbeat", "--port", "0"], tmp_path, limit=3)
    assert outcome.code is None  # still serving at the limit: stopped by its PID
    assert outcome.seconds >= 3 and not outcome.traceback


def test_every_case_names_a_module_of_ours(tmp_path: Path) -> None:
    listed = cases(tmp_path, 1)
    assert len(listed) >= 10
    assert {argv[0] for _, argv in listed} == {"servers.heartbeat", "servers.http"}
