"""Part 2 of the core benchmark (:mod:`benchmarks.core`): the reaper's own CPU per second
under ``trio.testing.MockClock``. A million watched entries, each active once per
keep-alive period K against a timeout of 1.5 K (MQTT's rule), 1% going silent; and a
fixed due-rate while the number of entries that are *not* due grows.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import trio
import trio.testing

import idlekeeper
from idlekeeper.watch import Watch

__all__ = ["reaper_cpu", "reaper_rows"]


def _bare_watch(keeper: idlekeeper.Keeper, idle: float) -> Watch:
    """A watch kept without a task or cancel scope: the reaper's work is identical."""
    w = keeper.watch(idle=idle)
    w.start()
    return w


def reaper_cpu(
    active: int, idle_extra: int, timeout: float, silent_fraction: float, sim_seconds: float, tick: float
) -> dict[str, Any]:
    """Simulate ``sim_seconds`` of a keeper; measure the reaper's own CPU."""

    async def main() -> dict[str, Any]:
        async with idlekeeper.open_keeper(tick=tick) as keeper:
            start = trio.current_time()
            watches = [_bare_watch(keeper, timeout) for _ in range(active)]
            # Entries that are watched but never due during the run.
            parked = [_bare_watch(keeper, 24 * 3600) for _ in range(idle_extra)]
            silent_every = round(1 / silent_fraction) if silent_fraction else 0
            talkers = [w for i, w in enumerate(watches) if not (silent_every and i % silent_every == 0)]
            silent = active - len(talkers)
            # Each talker is active once per keep-alive period K, at its own phase (one
            # slice per tick), against a timeout of 1.5 K: MQTT's rule.
            slices = max(1, round(timeout / 1.5 / tick))
            per_slice = math.ceil(len(talkers) / slices)
            epochs = keeper._epochs
            driver_ns = 0
            gc.collect()
            gc.freeze()
            base_busy = keeper.stats.busy_seconds
            base_wakeups = keeper.stats.wakeups
            slice_no = 0
            while trio.current_time() - start < sim_seconds:
                t0 = time.perf_counter_ns()
                lo = (slice_no % slices) * per_slice
                for w in talkers[lo : lo + per_slice]:
                    w._rx = epochs.current
                driver_ns += time.perf_counter_ns() - t0
                slice_no += 1
                await trio.sleep(tick)
            stats = keeper.stats
            expired = stats.expired_total
            out = {
                "active_entries": active,
                "parked_entries": idle_extra,
                "timeout_s": timeout,
                "tick_s": tick,
                "simulated_s": sim_seconds,
                "silent": silent,
                "expired": expired,
                "refiles": stats.refiles,
                "wakeups": stats.wakeups - base_wakeups,
                "reaper_cpu_ms_per_s": (stats.busy_seconds - base_busy) * 1000 / sim_seconds,
                "driver_cpu_ms_per_s": driver_ns / 1e6 / sim_seconds,
                "lag_max_s": stats.lag.max,
                "false_expiries": sum(1 for w in talkers if w.expired),
            }
            del parked
            gc.unfreeze()
            return out

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def reaper_rows(big: int, huge: int, quick: bool) -> list[dict[str, Any]]:
    """Part 2's table."""
    timeout = 60.0 if not quick else 10.0
    rows = [reaper_cpu(huge, 0, timeout, 0.01, 3 * timeout, 0.1)]
    fixed = 10_000 if not quick else 2_000
    for parked in (0, big, huge):
        # Best of two: the figure is small, and a shared machine adds noise.
        runs = [reaper_cpu(fixed, parked, 10.0, 0.0, 60.0, 0.1) for _ in range(2)]
        rows.append(min(runs, key=lambda row: float(row["reaper_cpu_ms_per_s"])))
    return rows
