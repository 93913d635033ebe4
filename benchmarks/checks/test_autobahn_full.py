"""Every Autobahn|Testsuite case (517) against ``python -m servers.http`` on both
engines, through kosoku; none may fail. 10 to 15 minutes an engine, nearly all of
it the compression cases' 1,000 messages of up to 128 KiB: the test suite runs a
subset of each category instead (tests/test_ws_autobahn.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.autobahn import CATEGORIES, failures, run_engine, summary


@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_every_autobahn_case_passes(engine: str, tmp_path: Path) -> None:
    # Two cases at a time: the fuzzing client's work overlaps the server's (590 s
    # for dense here, where one at a time took over 800).
    run = run_engine(engine, tmp_path / engine, parallelism=2, timeout=3600)
    table = summary(run.outcomes)
    print(f"{engine}: {len(run.outcomes)} cases in {run.seconds:.0f} s\n{table}")
    assert len(run.outcomes) >= 500 and {o.category for o in run.outcomes} == set(CATEGORIES), table
    bad = failures(run.outcomes)
    assert not bad, f"{len(bad)} Autobahn cases failed on {engine} ({', '.join(o.case for o in bad)}):\n{table}"
