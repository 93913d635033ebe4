"""The core benchmark's figures (:mod:`benchmarks.core`) as Markdown: one table or list
per part, under a line saying what they were measured on."""

from __future__ import annotations

from typing import Any

__all__ = ["report", "report_activity", "report_memory", "report_reaper"]


def report(r: dict[str, Any]) -> str:
    """The whole report: the machine, then each part that ran."""
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
    """Part 1: the cost of each way of noting activity, gross and net, and the ratios."""
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
    """Part 2: the reaper's CPU per row, and how flat it stays as entries not due are added."""
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
    """Part 3: bytes per watched connection, and what they are made of."""
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
