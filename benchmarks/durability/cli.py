"""Durable state on SQLite (issue 62), measured against the server without it and
against Mosquitto with ``persistence true``, side by side in one run:

1. QoS 1 throughput to absent persistent subscribers, and retained updates a second,
   for our server in memory and with each ``--persistence-sync`` (always, interval,
   off), and for Mosquitto; each as msg/s and as a ratio to ours in memory; then a
   subscriber that comes back must get every message that was PUBACKed.
2. Start-up: seconds from starting the process to its first CONNACK, and its RSS,
   on a store of ``--devices`` device records and ``--sessions`` persistent sessions
   with ``--queued`` messages each (written through the server's own classes), and
   on a nearly empty one (one session, one message); one worker and ``--workers 2``.
3. The crash drill: ``--drill-devices`` devices, persistent subscribers, QoS 1 and
   QoS 2 publishers, ``--workers 2``; ``kill -9`` mid-load, restart on the same file;
   every PUBACKed message must reach every subscriber, every QoS 2 one exactly once
   (copies are counted), and every device session must end once over the presence
   logs. Mosquitto beside it.

    python -m benchmarks.durability            # the full run (about 3 minutes)
    python -m benchmarks.durability --quick    # tiny sizes, for the test

The exit code is 1 if ours with ``--persistence-sync always`` lost a PUBACKed
message, or its presence history broke a rule; 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from loadtest.mqtt_targets import mosquitto_binary
from loadtest.processes import free_port, split_cpus
from loadtest.report import plural
from loadtest.sampler import cpu_model

from .drill import Drill, DrillLoad, drill_target, run_drill
from .startup import Built, Started, build_store, measure_start
from .targets import MODES, mosquitto_version
from .throughput import Load, Rates, fresh_target, measure_rates

__all__ = ["Report", "main", "run"]

PARTS = ("throughput", "startup", "drill")


@dataclass
class Report:
    """Everything one run measured."""

    rates: dict[str, list[Rates]] = field(default_factory=dict)
    """By server (our modes, ``mosquitto``): one per round."""
    built: Built | None = None
    starts: list[tuple[str, int, list[Started]]] = field(default_factory=list)
    """(store, workers, one per round)."""
    drills: dict[str, Drill] = field(default_factory=dict)
    """By server (our sync modes, ``mosquitto``)."""

    @property
    def ok(self) -> bool:
        """Ours kept every PUBACKed message and delivered it, and its presence history
        is clean, where the store promises it (in memory, ``always``; ``interval`` and
        ``off`` only when the server was stopped cleanly)."""
        for mode, rounds in self.rates.items():
            if mode != "mosquitto" and any(r.delivered < r.acked or r.retained_seen < r.retained_acked for r in rounds):
                return False
        drill = self.drills.get("always")
        if drill is not None and (
            drill.total_lost or drill.total_lost2 or drill.history is None or not drill.history.ok
        ):
            return False
        queued = self.built.queued if self.built is not None else 0
        return all(s.resumed in (-1, queued) for _, _, rounds in self.starts for s in rounds)


def _options(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.durability",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (the test's): seconds, not minutes")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    p.add_argument("--rounds", type=int, default=3, help="throughput rounds, the servers in turn (default: 3)")
    p.add_argument("--subscribers", type=int, default=10, help="absent persistent subscribers (default: 10)")
    p.add_argument("--publishers", type=int, default=4, help="QoS 1 publishers (default: 4)")
    p.add_argument("--messages", type=int, default=10_000, help="queued messages per publisher (default: 10,000)")
    p.add_argument("--retained", type=int, default=10_000, help="retained updates per publisher (default: 10,000)")
    p.add_argument("--window", type=int, default=32, help="unacknowledged messages per publisher (default: 32)")
    p.add_argument("--devices", type=int, default=100_000, help="device records in the store (default: 100,000)")
    p.add_argument("--sessions", type=int, default=10_000, help="persistent sessions in the store (default: 10,000)")
    p.add_argument("--queued", type=int, default=100, help="messages queued per stored session (default: 100)")
    p.add_argument("--start-rounds", type=int, default=2, help="starts of each kind (default: 2)")
    p.add_argument("--drill-devices", type=int, default=5000, help="devices online at the kill (default: 5,000)")
    p.add_argument("--drill-seconds", type=float, default=4.0, help="seconds of load before the kill (default: 4)")
    p.add_argument("--drill-rate", type=float, default=2000.0, help="QoS 1 messages a second (default: 2,000)")
    p.add_argument("--drill-modes", default="always,interval", help="our sync modes drilled (default: always,interval)")
    p.add_argument("--dir", type=Path, default=None, help="where the stores go (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.subscribers, args.publishers, args.messages, args.retained = 1, 2, 2, 300, 300
        args.devices, args.sessions, args.queued, args.start_rounds = 2000, 100, 10, 1
        args.drill_devices, args.drill_seconds, args.drill_rate = 50, 1.0, 400.0
    args.parts = [part for part in args.parts.split(",") if part]
    args.drill_modes = [mode for mode in args.drill_modes.split(",") if mode]
    for part in args.parts:
        if part not in PARTS:
            p.error(f"--parts: {part!r} is not one of {', '.join(PARTS)}")
    for mode in args.drill_modes:
        if mode not in MODES[1:]:
            p.error(f"--drill-modes: {mode!r} is not one of {', '.join(MODES[1:])}")
    for name, low, high in (
        ("rounds", 1, 20), ("subscribers", 1, 1000), ("publishers", 1, 64), ("messages", 1, 1_000_000),
        ("retained", 1, 1_000_000), ("window", 1, 65_000), ("devices", 0, 10_000_000), ("sessions", 1, 1_000_000),
        ("queued", 1, 100_000), ("start_rounds", 1, 10), ("drill_devices", 0, 15_000), ("drill_seconds", 0.5, 60),
        ("drill_rate", 10, 100_000),
    ):  # fmt: skip
        value = getattr(args, name)
        if not low <= value <= high:
            p.error(f"--{name.replace('_', '-')} {value}: {low:,} to {high:,}")
    return args


def machine() -> str:
    """The machine line."""
    return (
        f"{os.cpu_count()} cores ({cpu_model()}), Python {platform.python_version()}, trio {trio.__version__}, "
        f"SQLite {sqlite3.sqlite_version}, {mosquitto_version() or 'no Mosquitto'}"
    )


def run(argv: list[str] | None = None, out: Callable[[str], object] = print) -> Report:
    """Measure the parts asked for; print the tables (through ``out``); the report."""
    args = _options(argv)
    report = Report()
    workdir = Path(tempfile.mkdtemp(prefix="ik-durability-", dir=args.dir))
    out(f"machine: {machine()}; stores in {workdir}")
    try:
        if "throughput" in args.parts:
            _throughput(args, workdir, report, out)
        if "startup" in args.parts:
            _startup(args, workdir, report, out)
        if "drill" in args.parts:
            _drill(args, workdir, report, out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    drill = report.drills.get("always")
    if drill is not None and drill.total_copies2:
        out(f"NOTE: with sync always, {drill.total_copies2} QoS 2 message(s) reached a subscriber twice")
    out("PASS" if report.ok else "FAIL: ours lost a message it acknowledged, or broke a presence rule")
    return report


def _throughput(args: argparse.Namespace, workdir: Path, report: Report, out: Callable[[str], object]) -> None:
    load = Load(args.subscribers, args.publishers, args.messages, args.retained, args.window)
    split = split_cpus()
    servers = [*MODES, *(["mosquitto"] if mosquitto_binary() else [])]
    before = os.sched_getaffinity(0) if split is not None else None
    try:
        if split is not None:
            os.sched_setaffinity(0, split.load)
        for round_ in range(args.rounds):
            for mode in servers[round_ % len(servers) :] + servers[: round_ % len(servers)]:  # each goes first once
                target = fresh_target(mode, free_port(), workdir, load, split.server if split else None)
                report.rates.setdefault(mode, []).append(measure_rates(target, load))
                shutil.rmtree(target.workdir, ignore_errors=True)
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
    out("")
    out(
        f"1. QoS 1 to {load.subscribers} absent persistent subscribers ({load.publishers} publishers x "
        f"{load.messages:,}, window {load.window}, {load.size}-byte payloads; each subscriber queues "
        f"{load.per_subscriber:,}, --max-queued / max_queued_messages {load.per_subscriber + 1000:,}), and retained "
        f"updates ({load.publishers} x {load.retained:,} topics); median of {plural(args.rounds, 'round')}; "
        f"{split or 'not pinned'}"
    )
    report.rates = {mode: report.rates[mode] for mode in servers}
    base = report.rates["in-memory"]
    base_q = statistics.median(r.queued for r in base)
    base_r = statistics.median(r.retained for r in base)
    out(
        f"{'server':<28}{'queued msg/s':>13}{'ratio':>8}{'retained msg/s':>16}{'ratio':>8}"
        f"{'delivered':>20}{'retained':>20}"
    )
    for mode, rounds in report.rates.items():
        q = statistics.median(r.queued for r in rounds)
        r_ = statistics.median(r.retained for r in rounds)
        name = "mosquitto persistence" if mode == "mosquitto" else f"idlekeeper {mode}"
        delivered = f"{sum(r.delivered for r in rounds):,}/{sum(r.acked for r in rounds):,}"
        kept = f"{sum(r.retained_seen for r in rounds):,}/{sum(r.retained_acked for r in rounds):,}"
        out(f"{name:<28}{q:>13,.0f}{q / base_q:>7.2f}x{r_:>16,.0f}{r_ / base_r:>7.2f}x{delivered:>20}{kept:>20}")
    if args.rounds > 1:
        out("each round, queued / retained msg/s (the server's CPU, % of its core):")
        for mode, rounds in report.rates.items():
            each = ", ".join(
                f"{r.queued:,.0f} ({r.queued_cpu:.0f}%) / {r.retained:,.0f} ({r.retained_cpu:.0f}%)" for r in rounds
            )
            out(f"  {mode:<12}{each}")


def _startup(args: argparse.Namespace, workdir: Path, report: Report, out: Callable[[str], object]) -> None:
    full, empty = workdir / "full.db", workdir / "empty.db"
    built = report.built = build_store(full, args.devices, args.devices // 10, args.sessions, args.queued)
    build_store(empty, 0, 0, 1, 1)
    label = f"{args.devices:,} devices ({args.devices // 10:,} online), {args.sessions:,} sessions x {args.queued}"
    for store, name, resume in ((empty, "1 session x 1 message", 0), (full, label, args.queued)):
        for workers in (1, 2):
            rounds = [measure_start(store, workdir, workers, resume) for _ in range(args.start_rounds)]
            report.starts.append((name, workers, rounds))
    out("")
    out(
        f"2. Start-up on a store written through the server's classes: {label} queued "
        f"({built.size / 2**20:,.0f} MiB, written in {built.seconds:.1f} s), left as kill -9 leaves it; "
        f"median of {args.start_rounds}"
    )
    out(f"{'store':<52}{'workers':>8}{'CONNACK s':>11}{'restore s':>11}{'RSS MB':>9}{'holder MB':>11}  restored")
    for name, workers, rounds in report.starts:
        connack = statistics.median(s.connack for s in rounds)
        restore = statistics.median(s.restore_seconds for s in rounds)
        rss = statistics.median(s.rss for s in rounds) / 1e6
        holder = statistics.median(s.holder_rss for s in rounds) / 1e6
        found = rounds[0].restored
        said = "?" if found is None else f"{found[0]:,} devices, {found[2]:,} sessions, {found[3]:,} messages"
        if rounds[0].resumed >= 0:
            said += f"; a resumed session got {rounds[0].resumed}"
        out(f"{name:<52}{workers:>8}{connack:>11.2f}{restore:>11.2f}{rss:>9,.0f}{holder:>11,.0f}  {said}")


def _drill(args: argparse.Namespace, workdir: Path, report: Report, out: Callable[[str], object]) -> None:
    load = DrillLoad(args.drill_devices, 4, args.drill_rate, args.drill_seconds, quiet=1.5 if args.quick else 3.0)
    for mode in [*args.drill_modes, *(["mosquitto"] if mosquitto_binary() else [])]:
        target = drill_target(mode, free_port(), workdir, load)
        report.drills[mode] = run_drill(target, load)
        shutil.rmtree(target.workdir, ignore_errors=True)
    out("")
    out(
        f"3. Crash drill: {load.devices:,} devices (keep-alive 60), 4 persistent subscribers (2 live, 2 absent; QoS 1 "
        f"and QoS 2), QoS 1 publisher at {load.rate:,.0f}/s and QoS 2 at {load.rate / 4:,.0f}/s, window "
        f"{load.window}; kill -9 of every process after {load.before:g} s, restart on the same state"
    )
    out(
        f"{'server':<34}{'QoS1 acked':>11}{'lost live':>10}{'lost absent':>12}{'QoS2 sent':>10}{'lost':>7}"
        f"{'copies':>7}{'sessions':>9}{'restart s':>10}  presence"
    )
    for drill in report.drills.values():
        subs = sorted(drill.lost)
        live, absent = subs[: len(subs) // 2], subs[len(subs) // 2 :]
        lost_live = sum(drill.lost[s] for s in live)
        lost_absent = sum(drill.lost[s] for s in absent)
        presence = "not logged" if drill.history is None else _presence(drill)
        out(
            f"{drill.name:<34}{drill.acked:>11,}{lost_live:>10,}{lost_absent:>12,}{drill.published2:>10,}"
            f"{drill.total_lost2:>7,}{drill.total_copies2:>7,}{drill.sessions_present:>6}/{len(subs)}"
            f"{drill.restart:>10.2f}  {presence}"
        )
    out("(lost: summed over the subscribers of each kind; QoS 2: of every message published, those not")
    out(" PUBREC'd resent after the restart; copies: QoS 2 messages a subscriber got twice)")


def _presence(drill: Drill) -> str:
    assert drill.history is not None
    h = drill.history
    found = ", ".join(f"{k} {n}" for k, n in h.counts().items() if n) or "no violation"
    ends = ", ".join(f"{k} {n:,}" for k, n in sorted(drill.reasons.items()))
    return f"{h.sessions:,} sessions: {found} (offline: {ends})"


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.durability``: 0 if ours lost nothing it promised to keep."""
    return 0 if run(argv).ok else 1


if __name__ == "__main__":
    sys.exit(main())
