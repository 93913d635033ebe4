"""A fleet run's results: the generators' results, the presence feed, the gateways' logs
and the samples folded into one report; the verdict (pass or fail), and the report's text."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from ..device_results import Arrived, connect_rate, connect_rate_text, devices_passed
from ..history import check_history, merged_by_time
from ..report import figure, number, plural, verdict
from ..stats import summary_ms
from .gateways import Gateway
from .judge import classify_drops, judge_sessions, killed_node_view, node_of, sessions_of, takeover_summary
from .load import FleetLoad, FleetTimeline
from .redis import PresenceReader

__all__ = ["HISTORY_SLACK", "TAKEOVER_P99_TARGET_MS", "merge_fleet", "passed", "report"]

TAKEOVER_P99_TARGET_MS = 50.0
"""The cross-node takeover p99 the report measures a run against (reported, not judged)."""
HISTORY_SLACK = 3.0
"""Seconds past the lease that one device's two sessions may both look online: a
survivor's sweep of a killed node's sessions follows the lease by up to a sweep."""


def merge_fleet(
    load: FleetLoad,
    timeline: FleetTimeline,
    results: list[dict[str, Any]],
    reader: PresenceReader,
    logs: list[dict[str, Any]],
    gateways: list[Gateway],
    kill: dict[str, Any],
    outage: dict[str, float],
    redis_rss: list[tuple[float, int]],
    online_at_settle: dict[str, float],
) -> dict[str, Any]:
    """Fold the generators' results, the feed and the samples into one report."""
    arrived = Arrived(results)
    ok, total, joined = arrived.ok, arrived.total, arrived.joined

    window = 1.5 * load.keepalive
    sessions = sessions_of(((e.incarnation, e.event) for e in reader.events), logs)
    feed = judge_sessions(sessions)
    # The whole history, checked per device: what the stream gave its reader, in order,
    # and what the gateways logged, merged by time.
    lease = load.lease + HISTORY_SLACK
    stream_history = check_history(({**e.event, "incarnation": e.incarnation} for e in reader.events), lease=lease)
    # Gateways pass over a second online (issue 66); only a store restarted empty under
    # more sessions than a reader remembers may put a copy in a log.
    log_history = check_history(merged_by_time(logs), lease=lease, reannounced_copies=load.redis_restart)
    drops = classify_drops(joined("drops"), kill.get("port"), kill.get("mono"), window)
    killed = killed_node_view(sessions, kill["gateway"], kill["wall"]) if kill else None
    # A gateway that was never killed must end its own sessions: node-lost there means its
    # lease lapsed while it was alive (or still draining), and a survivor swept it.
    swept_alive = sum(
        1
        for s in sessions.values()
        if s.offline and s.offline[0].get("reason") == "node-lost" and node_of(s.node) != kill.get("gateway")
    )
    connack = sorted(joined("connack_times"))
    t0 = timeline.start
    steady_end = timeline.detect_by
    by_node: dict[str, int] = {}
    for s in sessions.values():
        name = node_of(s.node)
        by_node[name] = by_node.get(name, 0) + 1
    gw_out = []
    for gw in gateways:
        steady = [v for t, v in gw.rss if t <= steady_end]
        gw_out.append(
            {
                "name": gw.name,
                "port": gw.port,
                "workers": gw.workers,
                "killed": gw.killed_at is not None,
                "online_at_settle": online_at_settle.get(gw.name, math.nan),
                "sessions": by_node.get(gw.name, 0),
                "rss_mb_steady": (steady[-1] if steady else math.nan) / 1e6,
                "rss_mb_peak": max((v for _, v in gw.rss), default=0) / 1e6,
                "exit_code": gw.exit_code,
                "stop_s": gw.stop_s,
            }
        )
    end = max((s[0] for s in reader.stats.samples), default=t0)
    return {
        "options": asdict(load),
        "workers_per_node": load.workers(),
        "generators": len(results),
        "generators_missing": len(results) - len(ok),
        "devices": load.devices,
        "connected": len(connack),
        "connect_failed": total("connect_failed"),
        "refused": total("refused"),
        "connect_rate_per_s": connect_rate(connack),
        "heartbeats": total("pings"),
        "silent": total("silent"),
        "detected": len(joined("lateness")),
        "undetected": total("undetected"),
        "lateness_ms": summary_ms(joined("lateness")),
        "reconnected": total("reconnected"),
        "takeover_ms": takeover_summary(joined("takeover_s")),
        "takeover_missed": total("takeover_missed"),
        "failovers": total("failovers"),
        "retries": total("retries"),
        "online_at_end": total("online_at_end"),
        "drops": drops,
        "false_expiries": drops["false_expiries"] + sum(len(r["false_expiries"]) for r in ok),
        "feed": feed,
        "history": {"lease_s": lease, "stream": stream_history.as_dict(), "logs": log_history.as_dict()},
        "node_lost_on_live_gateways": swept_alive,
        "stream_entries": len(reader.events),
        "log_entries": len(logs),
        "reader_errors": reader.errors,
        "reader_lag_ms": summary_ms(reader.lag),
        "write_lag_ms": summary_ms(reader.write_lag),
        "redis_incarnations": reader.incarnation + 1,
        "kill": None
        if not kill
        else {"gateway": kill["gateway"], "at_s": kill["mono"] - t0, "pids": kill["pids"], **(killed or {})},
        "redis_outage": None
        if not outage
        else {
            "down_at_s": outage["down"] - t0,
            "down_for_s": outage.get("up", math.nan) - outage["down"],
            "stream_length": outage.get("stream_length", math.nan),
            "read_before": outage.get("read", math.nan),
            "migrated_slots": outage.get("migrated_slots", 0),
            "migrated_keys": outage.get("migrated_keys", 0),
            "lost_shards": outage.get("lost_shards", 0),
            "old_port": outage.get("old_port"),
            "new_port": outage.get("new_port"),
        },
        "redis": {
            "ops_per_s_steady": reader.stats.ops_per_s(timeline.acts - load.keepalive, timeline.acts),
            "ops_per_s_run": reader.stats.ops_per_s(t0, end),
            "ops_per_s_peak": max((s[1] for s in reader.stats.samples), default=math.nan),
            "commands": reader.stats.commands,
            "rss_mb_steady": max((v for t, v in redis_rss if t <= steady_end), default=0) / 1e6,
            "rss_mb_peak": max((v for _, v in redis_rss), default=0) / 1e6,
            "used_memory_mb_peak": reader.stats.peak_used_memory / 1e6,
            "ops_per_device_hour": reader.stats.ops_per_s(timeline.acts - load.keepalive, timeline.acts)
            * 3600
            / max(1, load.devices),
        },
        "gateways": gw_out,
        "timeline": {
            "acts": timeline.acts - t0,
            "detect_by": timeline.detect_by - t0,
            "wave2": timeline.wave2 - t0,
            "end": timeline.end - t0,
        },
    }


def passed(r: dict[str, Any]) -> bool:
    """The run's pass criteria: every device connected, every session ended exactly once,
    the whole history without a violation (:mod:`loadtest.history`), no healthy device
    dropped, every silent one found, every takeover done, every session of a killed
    gateway ended, and, in a failover run, a replica promoted (else it tested no failover)."""
    feed = r["feed"]
    kill = r["kill"]
    outage = r["redis_outage"]
    promoted = outage is not None and not math.isnan(number(outage["down_for_s"]))
    return devices_passed(r) and bool(
        feed["lost"] == 0
        and feed["duplicated"] == 0
        and feed["online_duplicated"] == 0
        and r["node_lost_on_live_gateways"] == 0
        and r["history"]["stream"]["ok"]
        and r["history"]["logs"]["ok"]
        and (kill is None or (kill["accounted"] and not kill["other"]))
        and (not r["options"].get("failover") or promoted)
    )


def _ms(s: dict[str, float], key: str) -> str:
    return figure(s.get(key))


NO_COUNTS = "fewer than two readings of Redis's counters"


def _redis_kind(o: dict[str, Any]) -> str:
    if o.get("redis_cluster"):
        replicas = " with a replica each" if o.get("failover") else ""
        return f"Redis Cluster: three primaries{replicas}, {o.get('shards')} presence shards; "
    return "Redis: a primary, two replicas, three Sentinels; " if o.get("sentinel") else "one redis-server; "


def _runs(r: dict[str, Any]) -> str:
    """What the stream's incarnations are: runs of one Redis, or of a cluster's primaries."""
    if r["options"].get("redis_cluster"):
        # A failover's promoted replica starts a run of the shards it took over.
        return f"{plural(r['redis_incarnations'], 'run')} of the shards' primaries"
    return f"{plural(r['redis_incarnations'], 'run')} of Redis"


def report(r: dict[str, Any]) -> str:
    """The human-readable report."""
    feed = r["feed"]
    o = r["options"]
    t = r["takeover_ms"]
    late = r["lateness_ms"]
    run = "run of its shard's primary" if o.get("redis_cluster") else "Redis run"
    lines = [
        f"fleet                  {plural(o['nodes'], 'gateway')} x {plural(r['workers_per_node'], 'worker')}, "
        + _redis_kind(o)
        + f"keep-alive {o['keepalive']} s",
        f"devices connected      {r['connected']:,} of {r['devices']:,} ({connect_rate_text(r)}; "
        f"failed {r['connect_failed']}, refused {r['refused']})",
        f"presence feed          {r['stream_entries']:,} stream entries over {_runs(r)}, "
        f"{plural(r['log_entries'], 'log line')}; {plural(feed['sessions'], 'session')}",
        f"  events lost          {feed['lost']} (sessions with no offline event)",
        f"  events duplicated    {feed['duplicated']} (sessions with more than one offline event); "
        f"online twice in one {run}: {feed['online_duplicated']}",
        "  offline by reason    " + ", ".join(f"{k} {v:,}" for k, v in feed["offline_by_reason"].items()),
    ]
    lines.append(
        f"  node-lost, not killed {r['node_lost_on_live_gateways']:,} sessions of gateways that were alive "
        "(a lease lapsed); offline queues drained "
        + figure(r.get("queues_drained_s"), ".1f", " s", why="not measured")
        + " after the devices left"
    )
    if feed["reannounced_after_restart"]:
        again = plural(feed["reannounced_after_restart"], "session")
        after = "re-claimed on the promoted replica" if o.get("failover") else "after Redis came back"
        lines.append(f"  re-announced         {again} {after}")
    for source in ("stream", "logs"):
        h = r["history"][source]
        found = ", ".join(f"{k} {v:,}" for k, v in h["violations"].items() if v) or "no violation"
        lines.append(
            f"  history ({source + ')':<8} {plural(h['sessions'], 'session')} of {plural(h['devices'], 'device')}: "
            f"{found}; "
            f"longest overlap {h['longest_overlap_s'] * 1000:,.0f} ms (lease {r['history']['lease_s']:g} s)"
        )
        for v in h["examples"][:3]:
            lines.append(f"    {v['kind']}: {v['client_id']} session {v['epoch']}: {v['detail']}")
    if feed["offline_without_online"]:
        lines.append(f"  offline w/o online   {feed['offline_without_online']:,} (their online event was not seen)")
    lines.append(
        f"silent devices found   {r['detected']:,} of {r['silent']:,}"
        + (f" (p50 {_ms(late, 'p50')} / p99 {_ms(late, 'p99')} ms past 1.5 x K)" if late.get("n") else "")
    )
    lines.append(
        f"false expiries         {plural(r['false_expiries'], 'healthy device')} dropped"
        + (f" (generator late: {r['drops']['generator_late']})" if r["drops"]["generator_late"] else "")
    )
    if t.get("n"):
        lines.append(
            f"cross-node takeovers   {t['n']:,} of {r['reconnected']:,}: p50 {_ms(t, 'p50')} / p99 {_ms(t, 'p99')} "
            f"/ max {_ms(t, 'max')} ms (new CONNACK -> old connection closed; "
            f"{t.get('before_connack', 0)} closed first); missed {r['takeover_missed']}; "
            f"p99 target {TAKEOVER_P99_TARGET_MS:.0f} ms "
            + ("met" if t.get("p99", math.inf) <= TAKEOVER_P99_TARGET_MS else "MISSED")
        )
    else:
        # No takeover, no latency: a p99 of nothing is neither met nor missed.
        lines.append(
            f"cross-node takeovers   none measured ({r['reconnected']:,} devices reconnected elsewhere); "
            f"missed {r['takeover_missed']}"
        )
    k = r["kill"]
    if k:
        lines.append(
            f"node killed            {k['gateway']} at {k['at_s']:.1f} s "
            f"({plural(len(k['pids']), 'process', 'processes')} SIGKILLed); "
            f"it held {plural(k['held'], 'session')}: node-lost {k['node_lost']:,}, taken over by a reconnect "
            f"{k['taken_over']:,}, other {k['other'] or 0}, never ended {k['unended']}"
        )
        swept = (
            f"first {k['first_node_lost_s']:.2f} s, last {k['last_node_lost_s']:.2f} s after the kill"
            if k["node_lost"]
            else "none (no session it held was left to its lease)"
        )
        lines.append(
            f"  node-lost events     {swept}; {plural(r['drops']['by_kill'], 'device')} failed over "
            f"({plural(r['retries'], 'refused retry', 'refused retries')})"
        )
    ro = r["redis_outage"]
    # An outage the run ended inside has no length: say so rather than print NaN seconds.
    over = bool(ro) and not math.isnan(number(ro["down_for_s"]))
    if ro and o.get("migrate"):
        moved = f"in {ro['down_for_s']:.1f} s" if over else "(still moving when the run ended)"
        lines.append(
            f"slot migration         began at {ro['down_at_s']:.1f} s: {ro['migrated_slots']} slots "
            f"({ro['migrated_keys']:,} keys) moved to another primary {moved}, "
            "while devices came, went and roamed"
        )
    elif ro and o.get("failover") and o.get("redis_cluster"):
        promoted = f"replica promoted in {ro['down_for_s']:.1f} s" if over else "no replica promoted by the end"
        lines.append(
            f"redis failover         primary SIGKILLed at {ro['down_at_s']:.1f} s; {promoted} (the cluster ok, "
            f"a new primary for its slots); it served {ro['lost_shards']} of {o.get('shards')} presence shards, "
            f"whose streams held {figure(ro['stream_length'], ',.0f')} entries then, "
            f"the reader had read {figure(ro['read_before'], ',.0f')}"
        )
    elif ro and o.get("failover"):
        promoted = f"promoted a replica {ro['down_for_s']:.1f} s later" if over else "promoted none by the end"
        lines.append(
            f"redis failover         primary SIGKILLed at {ro['down_at_s']:.1f} s; the Sentinels {promoted}; "
            f"its stream held {figure(ro['stream_length'], ',.0f')} entries then, "
            f"the reader had read {figure(ro['read_before'], ',.0f')}"
        )
    elif ro:
        back = f"for {ro['down_for_s']:.1f} s, back empty" if over else "and not back when the run ended"
        lines.append(
            f"redis restart          down at {ro['down_at_s']:.1f} s {back}; "
            f"its stream held {figure(ro['stream_length'], ',.0f')} entries, "
            f"the reader had read {figure(ro['read_before'], ',.0f')}"
        )
    lag = r["reader_lag_ms"]
    if lag.get("n"):
        lines.append(
            f"feed reader lag        p50 {_ms(lag, 'p50')} / p99 {_ms(lag, 'p99')} / max {_ms(lag, 'max')} ms "
            "(event time stamp to its reading by the load tester)"
        )
    written_lag = r.get("write_lag_ms", {})
    if written_lag.get("n"):
        lines.append(
            f"  of which written     p50 {_ms(written_lag, 'p50')} / p99 {_ms(written_lag, 'p99')} / max "
            f"{_ms(written_lag, 'max')} ms (event time stamp to its entry in Redis: the gateways' part)"
        )
    rd = r["redis"]
    lines.append(
        f"redis                  {figure(rd['ops_per_s_steady'], ',.0f', ' ops/s', why=NO_COUNTS)} at steady state, "
        f"{figure(rd['ops_per_s_run'], ',.0f')} over the run "
        f"(peak {figure(rd['ops_per_s_peak'], ',.0f')}); {figure(rd['ops_per_device_hour'], ',.0f')} ops per "
        f"device-hour at steady state; RSS {rd['rss_mb_steady']:,.0f} MB steady, "
        f"{rd['rss_mb_peak']:,.0f} MB peak"
    )
    for g in r["gateways"]:
        lines.append(
            f"gateway {g['name']:<14} port {g['port']}, "
            f"{figure(g['online_at_settle'], ',.0f', why='not read')} online at settle, "
            f"{plural(g['sessions'], 'session')}; "
            f"RSS {figure(g['rss_mb_steady'], ',.0f', ' MB', why='no sample')} steady, "
            f"{g['rss_mb_peak']:,.0f} MB peak"
            + (
                " (killed)"
                if g["killed"]
                else f"; SIGTERM took {figure(g['stop_s'], '.1f', ' s', why='not stopped')} (exit {g['exit_code']})"
            )
        )
    if r.get("workdir"):
        lines.append(f"kept for a look         {r['workdir']}")
    lines.append(verdict(passed(r)))
    return "\n".join(lines)
