"""The Autobahn|Testsuite WebSocket cases against ``python -m servers.http``, on both
engines, through kosoku: a subset that covers every category (framing, pings,
reserved bits, opcodes, fragmentation, UTF-8, closing, limits, miscellaneous, and
permessage-deflate with each payload and each parameter set), none of which may
fail. The whole set takes 10 to 15 minutes an engine: ``make bench`` runs it
(benchmarks/checks/test_autobahn_full.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.autobahn import CATEGORIES, SUBSET, Outcome, failures, read_report, run_engine, summary


@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_no_autobahn_case_fails(engine: str, tmp_path: Path) -> None:
    # Four cases at a time: the one-second pauses of 5.19, 5.20 and 6.4.x overlap
    # (about 7 s an engine, 13 s one at a time).
    run = run_engine(engine, tmp_path / engine, SUBSET, parallelism=4, timeout=300)
    table = summary(run.outcomes)
    print(f"{engine}: {len(run.outcomes)} cases in {run.seconds:.1f} s\n{table}")
    assert {o.category for o in run.outcomes} == set(CATEGORIES), table
    bad = failures(run.outcomes)
    assert not bad, f"{len(bad)} Autobahn cases failed on {engine} ({', '.join(o.case for o in bad)}):\n{table}"
    # Compression was taken, not merely survived: 12.x and 13.x graded on their echoes.
    assert all(o.behavior == "OK" for o in run.outcomes if o.category in ("12", "13")), table


def _report(tmp_path: Path, cases: dict[str, tuple[str, str]]) -> Path:
    index = {}
    for case, (behavior, close) in cases.items():
        name = f"case_{case.replace('.', '_')}.json"
        (tmp_path / name).write_text(json.dumps({"result": f"why {case}", "resultClose": "closed"}))
        index[case] = {"behavior": behavior, "behaviorClose": close, "duration": 5, "reportfile": name}
    (tmp_path / "index.json").write_text(json.dumps({"127.0.0.1:9001": index}))
    return tmp_path


def test_the_report_is_read_and_every_kind_of_failure_named(tmp_path: Path) -> None:
    outcomes = read_report(
        _report(
            tmp_path,
            {
                "1.1.1": ("OK", "OK"),
                "3.2": ("NON-STRICT", "OK"),
                "7.13.1": ("INFORMATIONAL", "INFORMATIONAL"),
                "10.1.1": ("OK", "OK"),
                "2.10": ("FAILED", "OK"),
                "7.3.1": ("OK", "UNCLEAN"),
                "12.1.1": ("UNIMPLEMENTED", "OK"),
                "9.1.1": ("ERROR", "FAILED"),
            },
        )
    )
    assert [o.case for o in outcomes] == ["1.1.1", "2.10", "3.2", "7.3.1", "7.13.1", "9.1.1", "10.1.1", "12.1.1"]
    bad = failures(outcomes)
    assert [o.case for o in bad] == ["2.10", "7.3.1", "9.1.1", "12.1.1"]
    assert bad[0].result == "why 2.10 / closed"
    table = summary(outcomes)
    assert "| 3 Reserved Bits | 1 | 0 | 1 | 0 | 0 | 0 | 0 |" in table
    assert "| all | 8 | 3 | 1 | 1 | 1 | 1 | 1 |" in table
    assert "FAILED 2.10: behavior FAILED, close OK: why 2.10 / closed" in table


def test_an_unimplemented_case_outside_compression_passes() -> None:
    assert failures([Outcome("2.1", "UNIMPLEMENTED", "OK", 0, "")]) == []
