"""A mass expiry: how long one reaper pass holds trio's loop, and how late it expires.

    python -m benchmarks.reaper_pass                     # this tree, 200,000 watches
    python -m benchmarks.reaper_pass --roots /tmp/old,.  # trees side by side, in turn

N watches (no socket, as a dense engine's or a bare ``Watch.start()``'s) all fall due
in one slot, as at a mass disconnect: a network that went away, a process that was
stopped. A second task wakes every millisecond and records the longest gap between
two of its runs: how long the program could not run while the reaper worked. The
keeper's lag histogram gives how late each expiry ran. Real clock; each tree runs in
a process of its own, with ``PYTHONPATH`` set to it, so the same command measures the
tree before a change and after, in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "measure"]


def measure(watches: int, timeout: float = 2.0) -> dict[str, Any]:
    """One mass expiry of ``watches`` watches, in this process (the tree on its path)."""
    import gc

    import trio

    import idlekeeper

    async def run() -> dict[str, Any]:
        async with idlekeeper.open_keeper() as keeper:
            made = [keeper.watch(idle=timeout) for _ in range(watches)]
            for w in made:
                w.start()
            gc.collect()
            gc.freeze()  # the pass, not a collection of the watches made above
            gc.disable()  # and the reaper's hold, not the collector's (a full collection anywhere holds the loop too)
            longest = 0.0
            gaps = 0
            deadline = trio.current_time() + timeout + 10
            last = time.perf_counter()
            while keeper.stats.expired_total < watches and trio.current_time() < deadline:
                await trio.sleep(0.001)
                now = time.perf_counter()
                gap = now - last - 0.001
                if gap > 0.002:
                    gaps += 1
                longest = max(longest, gap)
                last = now
            lag = keeper.stats.lag
            out = {
                "watches": watches,
                "expired": keeper.stats.expired_total,
                "longest_hold_ms": longest * 1000,
                "holds_over_2ms": gaps,
                "lag_p50_ms": lag.quantile(0.5) * 1000,
                "lag_max_ms": lag.max * 1000,
                "reaper_busy_ms": keeper.stats.busy_seconds * 1000,
                "pass_yields": getattr(keeper.stats, "pass_yields", 0),
            }
            for w in made:
                w.stop()
            gc.enable()
            gc.unfreeze()
            return out

    return trio.run(run)


def _in_tree(root: str, watches: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(Path(root).resolve()))
    done = subprocess.run(
        [sys.executable, __file__, "--one", str(watches)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    result["root"] = root
    return result


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.reaper_pass``: measure each tree in turn and print a table."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.reaper_pass",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--watches", type=int, default=200_000)
    parser.add_argument("--roots", default=".", help="comma-separated trees, measured in this order")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one)))
        return
    rows = [_in_tree(root, args.watches) for root in args.roots.split(",")]
    print(f"{args.watches:,} watches due in one slot")
    print("| tree | longest hold of the loop | holds over 2 ms | lag p50 / max | reaper busy | pass stops |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['root']} | {r['longest_hold_ms']:.1f} ms | {r['holds_over_2ms']} | "
            f"{r['lag_p50_ms']:.0f} / {r['lag_max_ms']:.0f} ms | {r['reaper_busy_ms']:.0f} ms | {r['pass_yields']} |"
        )
    by_root: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_root.setdefault(r["root"], []).append(r)
    if len(by_root) == 2:
        (first, a), (second, b) = by_root.items()
        for key in ("longest_hold_ms", "lag_max_ms", "reaper_busy_ms"):
            ratio = statistics.median(x[key] for x in b) / max(1e-9, statistics.median(x[key] for x in a))
            print(f"{key}: {second} / {first} = {ratio:.3f}x (medians)")


if __name__ == "__main__":
    main()
