"""Core benchmark: activity cost, reaper CPU and memory, side by side in one run.

    python -m benchmarks.core            # full run (about two minutes)
    python -m benchmarks.core --quick    # smaller, for a smoke check

Three parts, each compared inside the same run (shared machines are noisy, so the
ratios matter more than the absolute figures):

1. Cost per activity with 100,000 live connections: (a) idlekeeper's activity
   stamp, as ``WatchedStream`` runs it, (b) resetting an entered
   ``trio.CancelScope.deadline``, (c) ``with trio.move_on_after(...)`` around each
   read, (d) a bare attribute store on a ``__slots__`` object.
2. Reaper CPU per second with 1,000,000 watched entries, each active once per
   keep-alive period K against a timeout of 1.5 K (MQTT's rule), 1% going
   silent; and the same reaper with a fixed due-rate while the number of entries
   that are *not* due grows from 0 to 1,000,000.
3. Bytes per watched connection (tracemalloc), against the same tasks unwatched.

Parts 2 and 3 run under ``trio.testing.MockClock`` so that simulated minutes take
seconds; the reaper's CPU is measured with ``perf_counter`` around its own work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import trio

from benchmarks.core.activity import activity_costs
from benchmarks.core.memory import bytes_per_connection
from benchmarks.core.reaper import reaper_rows
from benchmarks.core.report import report
from loadtest.sampler import cpu_model


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "trio": trio.__version__,
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.core``: run the parts asked for, save the JSON, print the report."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.core", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke check")
    parser.add_argument("--json", type=Path, default=Path("results/bench-core.json"), help="where to save")
    parser.add_argument(
        "--part",
        type=int,
        choices=(1, 2, 3),
        action="append",
        help="run only this part (repeatable); default: all three",
    )
    args = parser.parse_args(argv)
    parts = set(args.part or (1, 2, 3))

    big = 100_000 if not args.quick else 10_000
    huge = 1_000_000 if not args.quick else 50_000
    repeats = 5 if not args.quick else 3
    result: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    if 1 in parts:
        print("part 1: cost per activity ...", file=sys.stderr)
        result["activity"] = trio.run(activity_costs, big, 10 if not args.quick else 3, repeats)
    if 2 in parts:
        print("part 2: reaper CPU ...", file=sys.stderr)
        result["reaper"] = reaper_rows(big, huge, args.quick)
    if 3 in parts:
        print("part 3: memory ...", file=sys.stderr)
        result["memory"] = bytes_per_connection(big)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(report(result))
    print(f"\n(JSON: {args.json})")
