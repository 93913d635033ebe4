"""A device run's results: the generators' results and the server samples merged, what
the server's own presence log says, the verdict (pass or fail), and the report."""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .generator.spec import GeneratorSpec
from .mqtt_versions import NAMES
from .report import figure, number, plural, verdict, write_json
from .sampler import Sample
from .stats import summary_ms
from .workload import DeviceLoad, Timeline, steady_seconds

__all__ = [
    "Arrived",
    "connect_rate",
    "connect_rate_text",
    "devices_passed",
    "merge",
    "passed",
    "protocol_lines",
    "read_presence_log",
    "report",
    "server_view",
    "write_outputs",
]


def _window(samples: list[Sample], start: float, end: float) -> tuple[Sample, Sample] | None:
    inside = [s for s in samples if start <= s.t <= end]
    return (inside[0], inside[-1]) if len(inside) >= 2 else None


class Arrived:
    """The generators' results that arrived (a generator that died leaves a ``missing``
    stub), with their figures summed or joined by key."""

    def __init__(self, results: list[dict[str, Any]]) -> None:
        self.ok = [r for r in results if not r.get("missing")]

    def total(self, key: str) -> int:
        """A count, summed over the generators."""
        return int(sum(r[key] for r in self.ok))

    def joined(self, key: str) -> list[Any]:
        """A list, concatenated over the generators."""
        return [v for r in self.ok for v in r[key]]

    def counted(self, key: str) -> dict[str, int]:
        """Counts by name (``{name: n}``), summed over the generators (absent: none)."""
        out: dict[str, int] = {}
        for r in self.ok:
            for name, n in r.get(key, {}).items():
                out[name] = out.get(name, 0) + n
        return out

    def nested(self, key: str) -> dict[str, dict[str, int]]:
        """Counts by two names (``{name: {inner: n}}``), summed over the generators."""
        out: dict[str, dict[str, int]] = {}
        for r in self.ok:
            for name, inner in r.get(key, {}).items():
                into = out.setdefault(name, {})
                for key2, n in inner.items():
                    into[key2] = into.get(key2, 0) + n
        return out


def connect_rate(connack: list[float]) -> float:
    """Devices connected per second, from the first CONNACK to the last (``connack`` sorted)."""
    span = connack[-1] - connack[0] if len(connack) > 1 else math.nan
    return len(connack) / span if span == span and span > 0 else math.nan


def merge(
    load: DeviceLoad,
    timeline: Timeline,
    results: list[dict[str, Any]],
    progress: list[tuple[float, dict[str, float]]],
    samples: list[Sample],
    stall_at: dict[str, float],
) -> dict[str, Any]:
    """Fold the generators' results and the samples into one report."""
    arrived = Arrived(results)
    ok, total, joined = arrived.ok, arrived.total, arrived.joined

    connack = sorted(joined("connack_times"))
    connected = len(connack)
    errors: dict[str, int] = {}
    for r in ok:
        for why, n in r["errors"].items():
            errors[why] = errors.get(why, 0) + n
    base = samples[0]
    # Steady state: every device online, before anything happens to them. A ramp that
    # ran past its planned time (a busy machine accepts more slowly) would put CONNECTs,
    # each far dearer than a heartbeat, into the window, so it opens after the last one.
    ramp_end = max((t for t in connack if t < timeline.acts), default=timeline.start)
    steady_from = max(timeline.acts - steady_seconds(load), ramp_end + 1.0)
    steady = _window(samples, steady_from, timeline.acts)
    hb_window = [(t, p["pings"]) for t, p in progress if steady_from <= t <= timeline.acts]
    heartbeat_rate = (
        (hb_window[-1][1] - hb_window[0][1]) / (hb_window[-1][0] - hb_window[0][0]) if len(hb_window) >= 2 else math.nan
    )
    steady_out: dict[str, float] = {}
    if steady is not None:
        first, last = steady
        cores = (last.cpu - first.cpu) / (last.t - first.t)
        steady_out = {
            "rss_mb": last.rss / 1e6,
            "rss_per_device_bytes": (last.rss - base.rss) / connected if connected else math.nan,
            "open_files": last.fds,
            "cpu_cores": cores,
            "heartbeats_per_s": heartbeat_rate,
            "cpu_pct_per_1k_heartbeats_per_s": 100 * cores / (heartbeat_rate / 1000) if heartbeat_rate else math.nan,
            "window_s": last.t - first.t,
            "ramp_overran_s": max(0.0, ramp_end - (timeline.acts - steady_seconds(load))),
        }
    lateness = joined("lateness")
    t0 = timeline.start
    return {
        "options": asdict(load),
        "generators": len(results),
        "generators_missing": len(results) - len(ok),
        "devices": load.devices,
        "connected": connected,
        "connect_failed": total("connect_failed"),
        "connect_sent_late": total("connect_sent_late"),
        "connect_send_max_s": max((r.get("connect_send_max", 0.0) for r in ok), default=math.nan),
        "refused": total("refused"),
        "refusals": arrived.counted("refusals"),
        "protocols": arrived.counted("protocols"),
        "disconnects": arrived.nested("disconnects"),
        "server_keepalive": arrived.counted("server_keepalive"),
        "connect_errors": errors,
        "connect_rate_per_s": connect_rate(connack),
        "connect_ms": summary_ms(joined("connect_s")),
        "heartbeats": total("pings"),
        "silent": total("silent"),
        "detected": len(lateness),
        "undetected": total("undetected"),
        "lateness_ms": summary_ms(lateness),
        "negative_lateness": sum(1 for v in lateness if v < 0),
        "false_expiries": sum(len(r["false_expiries"]) for r in ok),
        "false_expiry_examples": joined("false_expiries")[:20],
        "generator_late": total("generator_late"),
        "generator_max_gap_s": max((r["max_gap"] for r in ok), default=math.nan),
        "vanished": total("vanished"),
        "reconnected": total("reconnected"),
        "takeover_ms": summary_ms(joined("takeover_s")),
        "takeover_missed": total("takeover_missed"),
        "stall": {"from": stall_at["from"] - t0, "to": stall_at.get("to", math.nan) - t0} if stall_at else None,
        "steady": steady_out,
        "server_base_rss_mb": base.rss / 1e6,
        "server_peak_rss_mb": max(s.rss for s in samples) / 1e6,
        "server_peak_open_files": max(s.fds for s in samples),
        "timeline": {
            "acts": timeline.acts - t0,
            "detect_by": timeline.detect_by - t0,
            "end": timeline.end - t0,
            "samples": [[round(s.t - t0, 2), s.rss, round(s.cpu, 3), s.fds, s.online] for s in samples],
            "progress": [[round(t - t0, 2), p["online"], p["started"], p["detected"]] for t, p in progress[::4]],
        },
        "lateness_s": lateness,
    }


def read_presence_log(path: Path) -> list[dict[str, Any]] | None:
    """The events of a server's presence log (JSON lines), None if it cannot be read. A
    line that is not JSON (one cut short as the server was killed) is passed over."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    events = []
    for line in lines:
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def server_view(
    log: Path,
    silent_last: dict[str, float],
    gen_specs: list[GeneratorSpec],
    load: DeviceLoad,
    windows: dict[str, float] | None = None,
) -> dict[str, Any]:
    """What the server's presence log says: when it closed each silent device, its own
    lateness figures, and the vanished devices it noticed.

    ``silent_last`` maps a silent device to its last packet (``CLOCK_MONOTONIC``); the
    log's times are wall-clock, so the two are put on one clock here (both run at
    the same rate, and a run is minutes long). ``windows`` holds the silent devices the
    server gave another keep-alive (a 5.0 Server Keep Alive): 1.5 x that one is theirs.
    """
    vanished = {f"{s.prefix}-{s.first + i}" for s in gen_specs for i, _ in s.vanish}
    window = 1.5 * load.keepalive
    wall_minus_mono = time.time() - time.monotonic()
    late: list[float] = []
    close_late: list[float] = []
    reasons: dict[str, int] = {}
    vanish_seen: dict[str, int] = {}
    events = read_presence_log(log)
    if events is None:
        return {}
    for event in events:
        if event.get("status") != "offline":
            continue
        reason = str(event.get("reason"))
        reasons[reason] = reasons.get(reason, 0) + 1
        cid = event.get("client_id")
        if cid in silent_last and reason == "keepalive-timeout":
            own = window if windows is None else windows.get(cid, window)
            late.append(float(event["silent_for"]) - own)
            # The event is written just after the close, so this bounds the close from above.
            close_late.append(float(event["time"]) - (silent_last[cid] + wall_minus_mono + own))
        elif cid in vanished:
            vanish_seen[reason] = vanish_seen.get(reason, 0) + 1
    return {
        "lateness_ms": summary_ms(late),
        "close_lateness_ms": summary_ms(close_late),
        "close_lateness_s": close_late,
        "offline_by_reason": reasons,
        "vanished_seen": vanish_seen,
    }


def devices_passed(r: dict[str, Any]) -> bool:
    """What every device run must show, one server or a fleet: every device connected and
    its generator's results in, no healthy device dropped, every silent one found, every
    takeover done."""
    return bool(
        r["connected"] == r["devices"]
        and r["generators_missing"] == 0
        and r["false_expiries"] == 0
        and r["undetected"] == 0
        and r["takeover_missed"] == 0
    )


def passed(r: dict[str, Any]) -> bool:
    """The run's pass criteria: all connected, none dropped, every silent one found, none early."""
    return devices_passed(r) and bool(
        r["negative_lateness"] == 0 and r.get("server_view", {}).get("close_lateness_ms", {}).get("min", 0) >= 0
    )


def report(r: dict[str, Any]) -> str:
    """A short human-readable report."""
    late = r["lateness_ms"]
    close = r.get("server_view", {}).get("close_lateness_ms", {})
    lines = [
        f"target                 {r['target']}",
        f"devices connected      {r['connected']:,} of {r['devices']:,} "
        f"({connect_rate_text(r)}; failed {r['connect_failed']}, refused {r['refused']})",
        f"silent devices found   {r['detected']:,} of {r['silent']:,}",
    ]
    lines += protocol_lines(r)
    if close.get("n"):
        lines.append(
            f"detection lateness     p50 {close['p50']:.0f} / p99 {close['p99']:.0f} / max {close['max']:.0f} ms "
            f"(min {close['min']:.0f}): the server's close, past the last packet sent + 1.5 x keep-alive"
        )
    if late.get("n"):
        lines.append(
            f"  as devices saw it    p50 {late['p50']:.0f} / p99 {late['p99']:.0f} / max {late['max']:.0f} ms "
            f"(min {late['min']:.0f}; adds the generators' own delay in noticing)"
        )
    sv = r.get("server_view", {}).get("lateness_ms", {})
    if sv.get("n"):
        lines.append(
            f"  by server's stamps   p50 {sv['p50']:.0f} / p99 {sv['p99']:.0f} / max {sv['max']:.0f} ms "
            f"(min {sv['min']:.0f}; from the server's stamp of the last packet: "
            "its read, or its arrival when coalescing)"
        )
    if r.get("connect_sent_late"):
        lines.append(
            f"generator behind       {r['connect_sent_late']} CONNECTs sent over 10 s after their connect() "
            f"by the generator itself (the longest {r['connect_send_max_s']:.1f} s): the server closes those"
        )
    lines.append(f"false expiries         {plural(r['false_expiries'], 'healthy device')} dropped")
    if r["generator_late"]:
        lines.append(
            f"generator overloaded   {r['generator_late']} devices pinged late by the generator itself "
            f"(longest gap {r['generator_max_gap_s']:.1f} s)"
        )
    if r["vanished"]:
        seen = r.get("server_view", {}).get("vanished_seen")
        lines.append(f"vanished (RST)         {r['vanished']:,}" + (f"; server saw {seen}" if seen else ""))
    if r["reconnected"]:
        t = r["takeover_ms"]
        timed = f"(p50 {t['p50']:.0f} / max {t['max']:.0f} ms), " if t.get("n") else ""
        lines.append(
            f"takeovers              {t.get('n', 0):,} of {r['reconnected']:,} old connections closed "
            f"{timed}missed {r['takeover_missed']}"
        )
    if r["stall"]:
        saves = r.get("server_metrics", {}).get("stall_saves")
        lines.append(
            "stall                  SIGSTOP "
            + figure(r["stall"]["to"] - r["stall"]["from"], ".1f", " s", why="never resumed")
            + "; "
            + ("" if saves is None else f"stall saves {saves:,.0f}; ")
            + f"healthy dropped: {r['false_expiries']}"
        )
    s = r["steady"]
    if s:
        per_device = number(s["rss_per_device_bytes"]) / 1024
        lines.append(
            f"server at steady state {s['rss_mb']:,.0f} MB RSS, "
            f"{figure(per_device, '.2f', ' KiB', why='no device connected')} per device, "
            f"{figure(s['open_files'], ',.0f')} open files, {s['cpu_cores'] * 100:.0f}% CPU for "
            f"{figure(s['heartbeats_per_s'], ',.0f', why='under two readings')} heartbeats/s "
            f"({figure(s['cpu_pct_per_1k_heartbeats_per_s'], '.1f', '%')} per 1k/s, "
            f"over {figure(s.get('window_s'), '.0f', ' s')}"
            + (f" after the ramp overran by {s['ramp_overran_s']:.0f} s)" if s.get("ramp_overran_s", 0) > 0 else ")")
        )
    m = r.get("server_metrics")
    if m and not m["expiries"]:
        lines.append("reaper lag (/metrics)  n/a (no expiries to time)")
    elif m:
        lines.append(
            f"reaper lag (/metrics)  p50 <= {m['reaper_lag_p50_ms']:.0f} ms, p99 <= {m['reaper_lag_p99_ms']:.0f} ms "
            f"over {m['expiries']:,.0f} expiries"
        )
    lines.append(verdict(passed(r)))
    return "\n".join(lines)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n:,}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def connect_rate_text(r: dict[str, Any]) -> str:
    """The run's connect rate for a report line (a rate needs two CONNACKs at least)."""
    return figure(r["connect_rate_per_s"], ",.0f", "/s", why="fewer than two CONNACKs")


def protocol_lines(r: dict[str, Any]) -> list[str]:
    """The report's lines on the MQTT versions: the devices of each, the refusals by the
    server's answer, the keep-alives the server gave, its DISCONNECTs by reason code."""
    protocols = r.get("protocols") or {}
    order = list(NAMES.values())
    mix = ", ".join(f"{name} {protocols[name]:,}" for name in sorted(protocols, key=order.index))
    lines = [f"protocols              {mix or '—'} devices"]
    if r.get("refusals"):
        lines.append(f"refused, by answer     {_counts(r['refusals'])}")
    told = r.get("server_keepalive") or {}
    if told:
        shown = ", ".join(f"{k} s to {n:,}" for k, n in sorted(told.items(), key=lambda kv: int(kv[0])))
        lines.append(f"server keep-alive      {shown} devices (5.0 CONNACK's Server Keep Alive; they ping at it)")
    if protocols.get("5.0"):
        disconnects = r.get("disconnects") or {}
        shown = "; ".join(
            f"{reason} {sum(roles.values()):,} ({_counts(roles)})" for reason, roles in sorted(disconnects.items())
        )
        lines.append(f"server DISCONNECTs     {shown or 'none'} (5.0 devices, by reason code and role)")
    return lines


def write_outputs(r: dict[str, Any], json_path: str, plots: str | None) -> list[str]:
    """Write the JSON (and the PNG plots, if ``plots``); return the files written."""
    written = [str(write_json(json_path, r))]
    if plots:
        from .plots import device_plots

        written += device_plots(r, Path(plots))
    return written
