"""``python -m loadtest abuse``: each attack of issue 33 replayed with a healthy fleet
beside it, on our server and on Mosquitto; it fails when a healthy client is hurt.

    python -m loadtest abuse [--targets idlekeeper,fleet,mosquitto] [--attacks all|a,b,...]
        [--healthy 20] [--seconds 8] [--baseline 3] [--json results/abuse.json] [--quiet]

For each attack in turn, each server is started afresh with the options the attack
needs (:mod:`.targets`); ``--healthy`` devices ping it every ``--interval`` s, a
reconnect comes every half second, a subscriber follows ``$SYS/presence/#`` and
``/healthz`` is polled (ours); after a ``--baseline`` of quiet the attacker (from
127.0.0.2) runs for at most ``--seconds``, then the victims are checked. The judge
(:mod:`.judge`) fails a run on a late or missing PINGRESP, a refused healthy CONNECT, a
healthy device dropped, a forged or lost presence event, /healthz not 200, memory
past the attack's bound, or one of the attack's own checks (a victim's retained value,
a message across an ACL). The attacks (:mod:`.catalog`): will-forgery, huge-ids,
wildcard-flood, retained-fill, pattern-escape, status-starve, wildcard-ids,
connect-flood. Mosquitto runs those that apply to it, for comparison only; the exit
status is 1 when any attack fails on ours.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..fuzz.cli import machine
from ..options import add_json, add_quiet, add_targets, command_parser
from ..report import skip_reason, verdict, write_json, write_table, written
from .catalog import ATTACKS, pick
from .fleet_process import FleetOptions
from .judge import Limits, judge
from .report import failed_record, not_applicable, record, render, table
from .runner import RunOptions, run_attack
from .targets import TARGETS, is_ours

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command's options."""
    p = command_parser("python -m loadtest abuse", __doc__)
    a = p.add_argument
    add_targets(p, TARGETS)
    a("--attacks", default="all", help=f"comma-separated, or all (default: all: {','.join(ATTACKS)})")
    a("--healthy", type=int, default=20, help="healthy devices pinging beside the attacker (default: 20)")
    a("--interval", type=float, default=0.1, help="seconds between a healthy device's PINGREQs (default: 0.1)")
    a("--seconds", type=float, default=8.0, help="each attack's time at most (default: 8)")
    a("--baseline", type=float, default=3.0, help="seconds of no attack before each, measured (default: 3)")
    a(
        "--max-p99-ms",
        type=float,
        default=Limits.p99_floor * 1000,
        help="a healthy p99 round trip under attack within this always passes (default: %(default)g)",
    )
    a(
        "--p99-factor",
        type=float,
        default=Limits.p99_factor,
        help="beyond --max-p99-ms, the p99 may reach this many times the baseline's (default: %(default)g)",
    )
    a(
        "--ours-root",
        default=None,
        help="run our server from this source tree (another checkout, for before/after figures; default: this one)",
    )
    add_json(p, "results/abuse.json", table=True)
    add_quiet(p, live=False)
    return p


def _why(exc: BaseException) -> str:
    # A nursery's failure is a group: the first leaf says what happened.
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {skip_reason(exc)}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest abuse``; 1 if any attack fails on ours."""
    p = parser()
    args = p.parse_args(argv)
    try:
        attacks = pick(args.attacks)
    except ValueError as exc:
        p.error(str(exc))
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        p.error(f"--targets: one or more of {', '.join(TARGETS)}")
    if args.healthy < 1 or args.seconds <= 0 or args.baseline <= 0 or args.interval <= 0:
        p.error("--healthy, --seconds, --baseline and --interval must be positive")
    options = RunOptions(args.seconds, args.baseline, FleetOptions(args.healthy, args.interval), args.ours_root)
    limits = Limits(args.max_p99_ms / 1000, args.p99_factor)
    began = time.monotonic()
    records: list[dict[str, Any]] = []
    for cls in attacks:
        for target in targets:
            if not is_ours(target) and cls.not_for_mosquitto:
                rec = not_applicable(cls, target)
            else:
                if not args.quiet:
                    print(f"{cls.name} on {target}...", file=sys.stderr, flush=True)
                try:
                    obs = run_attack(cls, target, options)
                except Exception as exc:  # a run that cannot be made is reported, the rest go on
                    rec = failed_record(cls, target, _why(exc))
                else:
                    rec = record(obs, judge(obs, limits), cls.summary)
            records.append(rec)
            print(render(rec) + "\n", flush=True)
    ours_failed = [r["attack"] for r in records if is_ours(r["target"]) and r["result"] == "FAIL"]
    markdown = table(records)
    print(markdown + "\n")
    out = {
        "command": "python -m loadtest abuse " + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "seconds": round(time.monotonic() - began, 1),
        "result": "FAIL" if ours_failed else "PASS",
        "failed": ours_failed,
        "runs": records,
    }
    path = write_json(args.json, out)
    md = write_table(path, markdown)
    if ours_failed:
        print(f"failed on ours         {', '.join(ours_failed)}")
    print(verdict(not ours_failed))
    print(written([path, md]))
    return 1 if ours_failed else 0
