"""The QoS load test's report: the table's columns and rows, the ratio row of ours over each
peer, a run's description, and the workload's headline."""

from __future__ import annotations

import math
from typing import Any

from ..report import Column, figure, number, plural, ratio, table
from .load import QosLoad
from .throughput import CLIENT_SATURATED_PCT

__all__ = ["QOS_COLUMNS", "describe", "headline", "qos_row", "qos_table"]

QOS_COLUMNS: tuple[Column, ...] = (
    ("msgs_per_s", "QoS 1 msg/s", "", True),
    ("latency_p50_ms", "latency p50", "ms", False),
    ("latency_p99_ms", "latency p99", "ms", False),
    ("lost", "lost", "", False),
    ("duplicates", "duplicated", "", False),
    ("out_of_order", "out of order", "", False),
    ("server_cpu_pct", "server CPU", "% core", False),
    ("client_cpu_pct", "client CPU", "% core", False),
    ("bytes_per_queued", "RSS per queued msg", "B", False),
    ("queued_lost", "queued lost", "", False),
    ("queued_out_of_order", "queued out of order", "", False),
    ("drain_msgs_per_s", "queue drain msg/s", "", True),
    ("drain_cpu_us_per_msg", "server CPU per drained msg", "µs", False),
)

COUNTS = frozenset({"lost", "duplicates", "out_of_order", "queued_lost", "queued_out_of_order"})
"""Columns that count failures: 0 is the only good figure, and a ratio of them says nothing."""


def qos_row(r: dict[str, Any]) -> dict[str, float]:
    """The figures of one target's run that go into the table."""
    t = r.get("throughput", {})
    q = r.get("queued", {})
    late = t.get("latency_ms", {})
    return {
        "msgs_per_s": number(t.get("msgs_per_s")),
        "latency_p50_ms": number(late.get("p50")),
        "latency_p99_ms": number(late.get("p99")),
        "lost": number(t.get("lost")),
        "duplicates": number(t.get("duplicates")),
        "out_of_order": number(t.get("out_of_order")),
        "server_cpu_pct": number(t.get("server_cpu_pct")),
        "client_cpu_pct": number(t.get("client_cpu_pct")),
        "bytes_per_queued": number(q.get("bytes_per_queued")),
        "queued_lost": number(q.get("lost")),
        "queued_out_of_order": number(q.get("out_of_order")),
        "drain_msgs_per_s": number(q.get("drain_msgs_per_s")),
        "drain_cpu_us_per_msg": number(q.get("drain_cpu_us_per_msg")),
    }


def qos_table(rows: dict[str, dict[str, float]], missing: dict[str, str]) -> str:
    """:func:`loadtest.report.table` (each figure with its ratio to ours), then for each
    peer that ran a row of ours / the peer's, figure by figure."""
    lines = [table(rows, QOS_COLUMNS, missing)]
    ours = rows.get("idlekeeper")
    for peer, theirs in rows.items():
        if ours is None or peer == "idlekeeper":
            continue
        cells = []
        for key, _, _, _ in QOS_COLUMNS:
            cells.append("—" if key in COUNTS else ratio(ours.get(key, math.nan), theirs.get(key, math.nan)))
        lines.append(f"| idlekeeper / {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(r: dict[str, Any]) -> str:
    """A short human-readable report of one target's run."""
    lines = [f"target                 {r['target']}"]
    t = r.get("throughput")
    if t:
        late = t["latency_ms"]
        lines.append(
            f"QoS 1 throughput       {figure(t['msgs_per_s'], ',.0f', ' msg/s', why='no time measured')} delivered "
            f"over {t['window_s']:.1f} s "
            f"({plural(t['publishers'], 'publisher')} x {t['window']} unacknowledged, {t['payload_bytes']} B payloads, "
            f"at most {t['outstanding']} undelivered)"
        )
        if late.get("n"):
            lines.append(
                f"publish -> deliver     p50 {late['p50']:.2f} ms, p99 {late['p99']:.2f} ms, max {late['max']:.1f} ms"
            )
        verdict = "exactly once" if t["exactly_once"] else "NOT exactly once"
        lines.append(
            f"delivery               {verdict}: {t['published']:,} published, {t['unique']:,} delivered, "
            f"{t['lost']} lost, {t['duplicates']} duplicated, {t['out_of_order']} out of order"
        )
        bound = "client-bound: a lower bound" if t["client_saturated"] else "the client is not the bottleneck"
        if t["machine_cpu_pct"] >= CLIENT_SATURATED_PCT:
            bound += f"; all {plural(t['cores'], 'core')} busy"
        lines.append(
            f"CPU                    server {figure(t['server_cpu_pct'], '.0f', '%')} of a core, "
            f"client {figure(t['client_cpu_pct'], '.0f', '%')}, "
            f"machine {figure(t['machine_cpu_pct'], '.0f', '%')} of {plural(t['cores'], 'core')} "
            f"({bound})"
        )
        for error in t["errors"]:
            lines.append(f"error                  {error}")
    q = r.get("queued")
    if q:
        lines.append(
            f"queued while away      {q['queued']:,} messages: {q['bytes_per_queued']:,.0f} B of RSS each "
            f"({q['rss_before_bytes'] / 2**20:.1f} -> {q['rss_queued_bytes'] / 2**20:.1f} MiB)"
        )
        lines.append(
            f"on return              session present {int(q['session_present'])}, {q['unique']:,} delivered "
            f"in {q['drain_s']:.2f} s ({figure(q['drain_msgs_per_s'], ',.0f', ' msg/s')}, server CPU "
            f"{figure(q.get('drain_cpu_us_per_msg'), '.1f', ' µs each', why='none delivered')}), {q['lost']} lost, "
            f"{q['duplicates']} duplicated, {q['out_of_order']} out of order"
        )
        if q.get("connects_refused"):
            lines.append(
                f"{'':<22} (its CONNECT answered 'server unavailable' {q['connects_refused']} times first,"
                " while the server caught up: tried again every 0.2 s, the drain timed from the accepted one)"
            )
    return "\n".join(lines)


def headline(load: QosLoad) -> str:
    """The line above the table: what the workload was."""
    return (
        f"QoS 1: {plural(load.publishers, 'publisher')} x {load.window} unacknowledged, {load.payload} B payloads, "
        f"{load.duration:g} s ({load.warmup:g} s warm-up), at most {load.cap} undelivered; "
        f"{load.queued:,} messages queued for an absent persistent session"
        + (f"; ours with --workers {load.workers} (sessions in its supervisor)" if load.workers > 1 else "")
    )
