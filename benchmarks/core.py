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
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

import idlekeeper
from idlekeeper.watch import Watch, WatchedStream
from loadtest.sampler import cpu_model

# -- helpers --------------------------------------------------------------------


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


def per_op_ns(loop: Callable[[], None], ops: int, repeats: int) -> float:
    """Median ns per operation over ``repeats`` runs of ``loop`` (which does ``ops``).

    The garbage collector is off while timing, as in ``timeit``: a collection
    triggered by one case's garbage would otherwise land in another's figure.
    """
    samples = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            loop()
            samples.append((time.perf_counter_ns() - t0) / ops)
    finally:
        if enabled:
            gc.enable()
    return statistics.median(samples)


class _Slots:
    __slots__ = ("x",)

    def __init__(self) -> None:
        self.x = 0.0


class _NullStream(trio.abc.HalfCloseableStream):
    """A transport that is never read: the stamp is what is being timed."""

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return b""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        return None

    async def wait_send_all_might_not_block(self) -> None:
        return None

    async def send_eof(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


# -- part 1: cost per activity --------------------------------------------------


async def activity_costs(conns: int, passes: int, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {"connections": conns}
    async with idlekeeper.open_keeper(tick=0.1) as keeper, trio.open_nursery() as nursery:
        streams: list[WatchedStream] = []
        scopes: list[trio.CancelScope] = []
        ready = trio.Event()
        null = _NullStream()

        async def connection() -> None:
            with keeper.watch(null, idle=600) as w, trio.CancelScope(deadline=trio.current_time() + 600) as cs:
                streams.append(w.stream)
                scopes.append(cs)
                if len(streams) == conns:
                    ready.set()
                await trio.sleep_forever()

        for _ in range(conns):
            nursery.start_soon(connection)
        await ready.wait()
        objs = [_Slots() for _ in range(conns)]
        ops = conns * passes
        now = trio.current_time()

        # The two cheap statements are unrolled eight times per object so that the
        # loop itself does not drown them; the costly two run once per object.
        def empty() -> None:
            for _ in range(passes):
                for _s in streams:
                    pass

        def bare_store() -> None:
            # A float store on the very same connection objects: same memory, same
            # cache behaviour, so the difference is exactly the stamp's extra loads.
            value = 1.0
            for _ in range(passes):
                for o in streams:
                    o.lag = value
                    o.lag = value
                    o.lag = value
                    o.lag = value
                    o.lag = value
                    o.lag = value
                    o.lag = value
                    o.lag = value

        def bare_store_small() -> None:
            value = 1.0
            for _ in range(passes):
                for o in objs:
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value
                    o.x = value

        def idlekeeper_stamp() -> None:
            # Exactly the statement WatchedStream.receive_some runs per read.
            for _ in range(passes):
                for self in streams:
                    self.rx = self._epochs.current
                    self.rx = self._epochs.current
                    self.rx = self._epochs.current
                    self.rx = self._epochs.current
                    self.rx = self._epochs.current
                    self.rx = self._epochs.current
                    self.rx = self._epochs.current
                    self.rx = self._epochs.current

        def cancel_scope_deadline() -> None:
            for p in range(passes):
                deadline = now + 600 + p
                for cs in scopes:
                    cs.deadline = deadline

        def move_on_after() -> None:
            for _ in range(passes):
                for _s in streams:
                    with trio.move_on_after(600):  # noqa: ASYNC100 - the scope's cost is what is timed
                        pass

        gc.collect()
        # Interleaved rounds, medians: drift on a shared machine hits all alike.
        cases: dict[str, tuple[Callable[[], None], int]] = {
            "loop": (empty, ops),
            "a_idlekeeper_stamp": (idlekeeper_stamp, ops * 8),
            "b_cancel_scope_deadline": (cancel_scope_deadline, ops),
            "c_move_on_after": (move_on_after, ops),
            "d_bare_store": (bare_store, ops * 8),
            "d2_bare_store_small_object": (bare_store_small, ops * 8),
        }
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats):
            for name, (fn, count) in cases.items():
                samples[name].append(per_op_ns(fn, count, 1))
        loop = statistics.median(samples.pop("loop"))
        timed = {name: statistics.median(values) for name, values in samples.items()}
        # Loop overhead per operation: full for the costly two, an eighth for the unrolled.
        overhead = {name: loop / 8 if count > ops else loop for name, (_, count) in cases.items()}

        # The whole wrapper call, await included, against the bare transport's.
        stream = streams[0]
        calls = 200_000

        async def through(target: trio.abc.ReceiveStream) -> float:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                await target.receive_some()
            return (time.perf_counter_ns() - t0) / calls

        wrapped = statistics.median([await through(stream) for _ in range(repeats)])
        raw = statistics.median([await through(null) for _ in range(repeats)])
        nursery.cancel_scope.cancel()

    results["loop_overhead_ns"] = loop
    results["gross_ns"] = timed
    results["net_ns"] = {k: max(v - overhead[k], 0.01) for k, v in timed.items()}
    net = results["net_ns"]
    results["ratios"] = {
        "b_over_a_gross": timed["b_cancel_scope_deadline"] / timed["a_idlekeeper_stamp"],
        "c_over_a_gross": timed["c_move_on_after"] / timed["a_idlekeeper_stamp"],
        "a_over_d_gross": timed["a_idlekeeper_stamp"] / timed["d_bare_store"],
        "b_over_a_net": net["b_cancel_scope_deadline"] / net["a_idlekeeper_stamp"],
        "c_over_a_net": net["c_move_on_after"] / net["a_idlekeeper_stamp"],
        "a_over_d_net": net["a_idlekeeper_stamp"] / net["d_bare_store"],
        "a_over_d2_gross": timed["a_idlekeeper_stamp"] / timed["d2_bare_store_small_object"],
    }
    results["wrapper_call_ns"] = {"watched_stream": wrapped, "raw_stream": raw, "extra": wrapped - raw}
    return results


# -- part 2: reaper CPU -----------------------------------------------------------


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
            epochs = keeper.epochs
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
                    w.rx = epochs.current
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


# -- part 3: memory -----------------------------------------------------------------


def bytes_per_connection(conns: int) -> dict[str, Any]:
    async def measure(watched: bool) -> int:
        async with idlekeeper.open_keeper() as keeper, trio.open_nursery() as nursery:
            null = _NullStream()
            ready = trio.Event()
            count = 0

            async def connection() -> None:
                nonlocal count
                if watched:
                    with keeper.watch(null, idle=600, receive=300):
                        count += 1
                        if count == conns:
                            ready.set()
                        await trio.sleep_forever()
                else:
                    count += 1
                    if count == conns:
                        ready.set()
                    await trio.sleep_forever()

            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(conns):
                nursery.start_soon(connection)
            await ready.wait()
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - before
            nursery.cancel_scope.cancel()
            return used

    tracemalloc.start()
    try:
        plain = trio.run(measure, False)
        watched = trio.run(measure, True)
    finally:
        tracemalloc.stop()
    probe = Watch.__new__(Watch)
    return {
        "connections": conns,
        "task_only_bytes": plain / conns,
        "task_with_watch_bytes": watched / conns,
        "watch_bytes": (watched - plain) / conns,
        "sizeof": {
            "Watch": sys.getsizeof(probe),
            "CancelScope": sys.getsizeof(trio.CancelScope()),
            "WatchedStream": sys.getsizeof(WatchedStream.__new__(WatchedStream)),
        },
    }


# -- report -------------------------------------------------------------------------


def report(r: dict[str, Any]) -> str:
    lines = [
        f"Measured {r['machine']['date']} on {r['machine']['cpu']} ({r['machine']['cores']} cores), "
        f"Python {r['machine']['python']}, trio {r['machine']['trio']}.",
    ]
    if "activity" in r:
        lines += report_activity(r["activity"])
    if "reaper" in r:
        lines += report_reaper(r["reaper"])
    if "memory" in r:
        lines += report_memory(r["memory"])
    return "\n".join(lines)


def report_activity(a: dict[str, Any]) -> list[str]:
    g, n, q = a["gross_ns"], a["net_ns"], a["ratios"]
    lines = [
        "",
        f"### Cost per activity, {a['connections']:,} live connections",
        "",
        "| | per activity (gross) | net of loop | vs (a), gross | vs (a), net |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {
        "a_idlekeeper_stamp": "(a) idlekeeper stamp",
        "b_cancel_scope_deadline": "(b) `CancelScope.deadline = ...`",
        "c_move_on_after": "(c) `with trio.move_on_after(...)`",
        "d_bare_store": "(d) bare `__slots__` store, same objects",
        "d2_bare_store_small_object": "(d′) bare store, small separate objects",
    }
    for key, label in names.items():
        lines.append(
            f"| {label} | {g[key]:.1f} ns | {n[key]:.1f} ns | "
            f"{g[key] / g['a_idlekeeper_stamp']:.2f}× | {n[key] / n['a_idlekeeper_stamp']:.2f}× |"
        )
    w = a["wrapper_call_ns"]
    lines += [
        "",
        f"- (b) / (a) = **{q['b_over_a_gross']:.0f}×** gross, {q['b_over_a_net']:.0f}× net (target: at least 50×).",
        f"- (a) / (d) = **{q['a_over_d_gross']:.2f}×** gross, {q['a_over_d_net']:.2f}× net (target: at most 3×); "
        f"against (d′), a store into {a['connections']:,} small separate objects, {q['a_over_d2_gross']:.2f}× gross.",
        f"- *Gross* includes the loop; (a) and (d) are unrolled 8× per object, so they carry an eighth "
        f"of it. *Net* subtracts the measured empty loop ({a['loop_overhead_ns']:.1f} ns per object).",
        f"- Whole `WatchedStream.receive_some` call over a no-op transport: {w['watched_stream']:.0f} ns "
        f"against {w['raw_stream']:.0f} ns for the bare transport (+{w['extra']:.0f} ns: one more "
        "coroutine layer plus the stamp).",
    ]
    return lines


def report_reaper(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "### Reaper CPU",
        "",
        "| active entries | parked (never due) | timeout | silent | expired | false expiries "
        "| re-files | wake-ups | reaper CPU | max lag |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['active_entries']:,} | {row['parked_entries']:,} | {row['timeout_s']:.0f} s "
            f"| {row['silent']:,} | {row['expired']:,} | {row['false_expiries']} | {row['refiles']:,} "
            f"| {row['wakeups']:,} | {row['reaper_cpu_ms_per_s']:.2f} ms/s | {row['lag_max_s'] * 1000:.0f} ms |"
        )
    flat = [row for row in rows if row["active_entries"] == rows[-1]["active_entries"]]
    if len(flat) > 1:
        base = flat[0]["reaper_cpu_ms_per_s"]
        ratios = ", ".join(
            f"{row['parked_entries']:,} parked: {row['reaper_cpu_ms_per_s'] / base:.2f}×" for row in flat
        )
        lines += ["", f"Same due-rate, more entries that are not due: {ratios} (flat means O(due), not O(all))."]
    return lines


def report_memory(m: dict[str, Any]) -> list[str]:
    return [
        "",
        f"### Memory, {m['connections']:,} connections (tracemalloc)",
        "",
        f"- A trio task alone: {m['task_only_bytes']:.0f} B; the same task inside `keeper.watch(stream, ...)`: "
        f"{m['task_with_watch_bytes']:.0f} B.",
        f"- **{m['watch_bytes']:.0f} B per watched connection**, everything included: the Watch "
        f"({m['sizeof']['Watch']} B), its CancelScope ({m['sizeof']['CancelScope']} B) and the scope's "
        f"cancel status, the WatchedStream (~{m['sizeof']['WatchedStream']} B) and its wheel slot.",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    main()
