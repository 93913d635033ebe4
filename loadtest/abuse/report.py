"""What ``python -m loadtest abuse`` writes: each run's record (JSON-ready), its lines
in the report, and the Markdown table of every attack with Mosquitto beside ours."""

from __future__ import annotations

import math
from typing import Any

from ..report import figure, number, ratio
from .attack import Attack
from .judge import Verdict, figures
from .observation import Observation

__all__ = ["failed_record", "not_applicable", "record", "render", "table"]


def record(obs: Observation, verdict: Verdict, summary: str) -> dict[str, Any]:
    """One attack on one server, judged (JSON-ready)."""
    return {
        "attack": obs.attack,
        "target": obs.target,
        "summary": summary,
        "result": "PASS" if verdict.passed else "FAIL",
        "reasons": verdict.reasons,
        "checks": [c.__dict__ for c in verdict.checks],
        "figures": figures(obs),
        "unit": obs.unit,
        "answers": dict(sorted(obs.outcome.answers.items())),
        "notes": obs.outcome.notes,
        "fleet_problems": obs.fleet.problems,
    }


def not_applicable(cls: type[Attack], target: str) -> dict[str, Any]:
    """The record of an attack that does not apply to ``target`` (never a pass or a fail)."""
    return {
        "attack": cls.name,
        "target": target,
        "summary": cls.summary,
        "result": "n/a",
        "reasons": [cls.not_for_mosquitto or "does not apply"],
    }


def failed_record(cls: type[Attack], target: str, why: str) -> dict[str, Any]:
    """The record of a run that could not be made (the server or the fleet did not start)."""
    return {
        "attack": cls.name,
        "target": target,
        "summary": cls.summary,
        "result": "FAIL",
        "reasons": [f"could not run: {why}"],
    }


def _answers(answers: dict[str, int]) -> str:
    return ", ".join(f"{key} x{n:,}" for key, n in sorted(answers.items(), key=lambda kv: -kv[1])) or "nothing"


def render(rec: dict[str, Any]) -> str:
    """A run's lines in the report."""
    head = f"{rec['attack']:<16} {rec['target']:<11} {rec['result']}"
    if "figures" not in rec:
        return head + "".join(f"\n    {reason}" for reason in rec["reasons"])
    f = rec["figures"]
    lines = [
        head,
        f"    healthy round trip   p50 {figure(f['p50_ms'], '.2f', ' ms')}, p99 {figure(f['p99_ms'], '.2f', ' ms')}, "
        f"max {figure(f['max_ms'], '.1f', ' ms')} over {f['pings']:,} pings (baseline p50 "
        f"{figure(f['baseline_p50_ms'], '.2f', ' ms')}, p99 {figure(f['baseline_p99_ms'], '.2f', ' ms')})",
        f"    server RSS           {f['rss_before_mib']:.1f} MiB before, {f['rss_growth_mib']:+.1f} MiB at the peak, "
        + (f"{f['bytes_per_unit']:+,.0f} B per {rec['unit']} ({f['units']:,})" if f["units"] else "no hostile units"),
        f"    attacker was told    {_answers(rec['answers'])}",
    ]
    lines.extend(f"    note                 {note}" for note in rec["notes"])
    for check in rec["checks"]:
        lines.append(f"    {check['status']:<4} {check['name']:<16} {check['detail']}")
    return "\n".join(lines)


def _p99(rec: dict[str, Any] | None) -> str:
    if rec is None or "figures" not in rec:
        return "—"
    f = rec["figures"]
    return f"{figure(f['p99_ms'], '.2f', ' ms', missing='—')} ({figure(f['baseline_p99_ms'], '.2f', missing='—')})"


def _per_unit(rec: dict[str, Any] | None) -> str:
    if rec is None or "figures" not in rec:
        return "—"
    value = number(rec["figures"]["bytes_per_unit"])
    return "—" if math.isnan(value) else f"{value:+,.0f} B/{rec['unit']}"


def _told(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "—"
    if "answers" not in rec:
        return rec["result"] if rec["result"] == "n/a" else "—"
    return _answers(rec["answers"])


def _result(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "not run"
    if rec["result"] == "n/a":
        return f"n/a: {rec['reasons'][0]}"
    return str(rec["result"])


def table(records: list[dict[str, Any]]) -> str:
    """Every attack with each server a row (ours, ours in a fleet, Mosquitto): the
    verdict, the healthy p99 round trip under attack (its baseline in brackets) and its
    ratio to Mosquitto's, server memory per hostile unit, and what the attacker was told."""
    by: dict[tuple[str, str], dict[str, Any]] = {(r["attack"], r["target"]): r for r in records}
    attacks = list(dict.fromkeys(r["attack"] for r in records))
    lines = [
        "| attack | server | result | healthy p99 (baseline) | ÷ mosquitto's | memory per hostile unit "
        "| what the attacker was told |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in attacks:
        theirs = by.get((name, "mosquitto"))
        for target in dict.fromkeys(r["target"] for r in records):
            rec = by.get((name, target))
            if rec is None:
                continue
            times = "—"
            if target != "mosquitto" and theirs is not None and "figures" in rec and "figures" in theirs:
                times = ratio(number(rec["figures"]["p99_ms"]), number(theirs["figures"]["p99_ms"]))
            lines.append(
                f"| {name} | {target} | {_result(rec)} | {_p99(rec)} | {times} | {_per_unit(rec)} | {_told(rec)} |"
            )
    return "\n".join(lines)
