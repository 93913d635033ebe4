"""``python -m loadtest devices``: MQTT devices at real scale against a heartbeat server.

    python -m loadtest devices --devices 200000 --keepalive 30 --silent 0.05 --vanish 0.01 \\
        --reconnect 0.01 --stall

It starts ``servers.heartbeat`` with enough SO_REUSEPORT workers for the devices
(each process may hold under 20,000 files), then as many generator processes
(:mod:`loadtest.generator`), each with a loopback source address of its own
(127.0.0.2, 127.0.0.3, ...) and a share of the connection ramp. The run has phases:

1. **connect**: devices connect at ``--rate`` per second and ping every keep-alive
   K (minus up to ``--jitter`` of it), as paho and mosquitto clients do;
2. **settle**: one keep-alive with every device online;
3. **act**: within K/2, ``--silent`` devices stop sending (socket left open),
   ``--vanish`` ones reset their connection, ``--reconnect`` ones connect again
   with the same client id (the server must close the old connection);
4. **detect**: 1.5 K, until every silent device is due;
5. **stall** (``--stall``): every server process is SIGSTOPped for 2 K while
   the healthy devices keep pinging into the kernel's buffers, then SIGCONTed;
   1.5 K later, no healthy device may have been dropped.

Measured: connect rate; false expiries (healthy devices the server dropped: the
required figure is 0); detection lateness of every silent device (its close, seen
by the device, minus its last packet + 1.5 K: never negative); takeovers; server
RSS, CPU and open files over time (psutil, every process); reaper lag and stall
saves from the workers' ``/metrics``. Results go to JSON, and PNG plots next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .generator import GeneratorSpec
from .live import Live
from .processes import free_port, start_heartbeat, stop
from .sampler import Metrics, Sample, Sampler, histogram_quantile, percentile, process_tree

__all__ = ["DeviceLoad", "HeartbeatTarget", "ServerUnderTest", "main", "run_devices"]

_FILE_BUDGET = 15_000
"""Devices per generator and per server worker: under the 20,000-file limit, with room
for a reconnecting device's second socket and the kernel's uneven SO_REUSEPORT spread."""


@dataclass
class DeviceLoad:
    """The workload: how many devices, how they behave, what happens to them."""

    devices: int = 20_000
    keepalive: int = 10
    jitter: float = 0.2
    silent: float = 0.05
    vanish: float = 0.0
    reconnect: float = 0.0
    stall: bool = False
    stall_keepalives: float = 2.0
    rate: float = 2_000.0
    """Connections started per second, over all generators."""
    max_inflight: int = 1_024
    """Connections in their handshake at once, over all generators (the listen queues are finite)."""
    per_generator: int = _FILE_BUDGET
    host: str = "127.0.0.1"
    seed: int = 1


class ServerUnderTest(Protocol):
    """A running MQTT server: its port, its processes, and what else it exposes."""

    name: str
    port: int
    metrics_urls: list[str]
    presence_log: Path | None

    def pids(self) -> list[int]:
        """Every process of the server (RSS, CPU and SIGSTOP apply to all)."""
        ...


@dataclass
class HeartbeatTarget:
    """``servers.heartbeat`` started for a device run, with status ports and a presence log."""

    proc: subprocess.Popen[str]
    port: int
    workers: int
    metrics_urls: list[str]
    presence_log: Path | None
    name: str = "idlekeeper"

    @classmethod
    def start(cls, devices: int, tick: float = 0.1, workers: int | None = None) -> HeartbeatTarget:
        """Enough workers for ``devices`` (or ``workers``), each with /metrics and a shared presence log."""
        if workers is None:
            workers = max(2, math.ceil(devices / (_FILE_BUDGET - 1_000)))
        port = free_port()
        status = free_port(run=workers)
        log = Path(tempfile.mkdtemp(prefix="ik-devices-")) / "presence.jsonl"
        extra = ["--tick", str(tick), "--status-port", str(status), "--presence-log", str(log)]
        proc = start_heartbeat(port, workers, extra, timeout=60 + workers * 5)
        urls = [f"http://127.0.0.1:{status + i}/metrics" for i in range(workers)]
        return cls(proc, port, workers, urls, log)

    def pids(self) -> list[int]:
        """The supervisor and its workers."""
        return [p.pid for p in process_tree(self.proc.pid)]

    def stop(self) -> None:
        """SIGTERM by PID (workers close every connection on the way out); remove the presence log."""
        stop(self.proc, timeout=60)
        if self.presence_log is not None:
            shutil.rmtree(self.presence_log.parent, ignore_errors=True)


@dataclass
class Timeline:
    """When each phase starts, in ``CLOCK_MONOTONIC`` seconds (shared by every process)."""

    start: float
    acts: float
    detect_by: float
    stall: float | None
    stall_end: float | None
    end: float

    def phase(self, now: float) -> str:
        """The phase a run is in at ``now``."""
        if now < self.start:
            return "starting"
        if now < self.acts:
            return "connecting / settling"
        if now < self.detect_by:
            return "silencing, detecting"
        if self.stall is not None and self.stall_end is not None and now < self.stall_end:
            return "server stalled (SIGSTOP)"
        if now < self.end:
            return "watching for false expiries"
        return "finishing"


def generator_count(load: DeviceLoad) -> int:
    """Generator processes for the load: each holds at most ``per_generator`` devices."""
    return max(1, math.ceil(load.devices / load.per_generator))


def plan(load: DeviceLoad, generators: int) -> Timeline:
    """Lay the phases out from now."""
    k = load.keepalive
    start = time.monotonic() + 2.0 + 0.15 * generators  # generators start and import first
    # A fifth more than the ramp should take: a busy server accepts more slowly, and
    # the scenarios must find every device online.
    acts = start + 1.2 * load.devices / load.rate + k + 2.0
    detect_by = acts + k / 2 + 1.5 * k + 1.0
    if not load.stall:
        return Timeline(start, acts, detect_by, None, None, detect_by + 1.0)
    stall_end = detect_by + load.stall_keepalives * k
    return Timeline(start, acts, detect_by, detect_by, stall_end, stall_end + 1.5 * k + 2.0)


def specs(load: DeviceLoad, timeline: Timeline, port: int, workdir: Path) -> list[GeneratorSpec]:
    """Split the devices over generators and deal out the scenarios."""
    n = load.devices
    generators = generator_count(load)
    share = math.ceil(n / generators)
    rng = random.Random(load.seed)
    order = list(range(n))
    rng.shuffle(order)
    n_silent, n_vanish, n_reconnect = (round(n * f) for f in (load.silent, load.vanish, load.reconnect))
    roles: dict[str, list[int]] = {
        "silent": order[:n_silent],
        "vanish": order[n_silent : n_silent + n_vanish],
        "reconnect": order[n_silent + n_vanish : n_silent + n_vanish + n_reconnect],
    }
    out: list[GeneratorSpec] = []
    for g in range(generators):
        first = g * share
        count = min(share, n - first)
        out.append(
            GeneratorSpec(
                index=g,
                host=load.host,
                port=port,
                source=f"127.0.{(g + 2) // 256}.{(g + 2) % 256}",
                first=first,
                count=count,
                keepalive=load.keepalive,
                jitter=load.jitter,
                rate=load.rate / generators,
                max_inflight=max(16, load.max_inflight // generators),
                start_at=timeline.start,
                end_at=timeline.end,
                results=str(workdir / f"generator-{g}.json"),
                seed=load.seed,
            )
        )
    spread = load.keepalive / 2
    for role, members in roles.items():
        for i in members:
            spec = out[i // share]
            getattr(spec, role).append((i - spec.first, timeline.acts + rng.uniform(0, spread)))
    return out


class Fleet:
    """The generator processes, and their latest progress lines."""

    def __init__(self, specs: list[GeneratorSpec], workdir: Path) -> None:
        self.latest: dict[int, dict[str, Any]] = {}
        self.procs: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        for spec in specs:
            path = workdir / f"spec-{spec.index}.json"
            path.write_text(json.dumps(asdict(spec)))
            proc = subprocess.Popen(
                [sys.executable, "-m", "loadtest.generator", str(path)],
                stdout=subprocess.PIPE,
                text=True,
                cwd=str(Path(__file__).resolve().parent.parent),
            )
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(spec.index, proc), daemon=True).start()

    def _read(self, index: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                data = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.latest[index] = data

    def totals(self) -> dict[str, float]:
        """Progress summed over generators."""
        with self._lock:
            rows = list(self.latest.values())
        keys = ("started", "online", "failed", "pings", "detected")
        return {k: float(sum(r.get(k, 0) for r in rows)) for k in keys}

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """Stop any generator still running, by PID."""
        for proc in self.procs:
            stop(proc, timeout=5)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each PID (a process that is gone is skipped)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def run_devices(
    load: DeviceLoad,
    server: ServerUnderTest,
    *,
    show: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``load`` against a running ``server`` and return the merged results."""
    workdir = Path(tempfile.mkdtemp(prefix="ik-load-"))
    timeline = plan(load, generator_count(load))
    gen_specs = specs(load, timeline, server.port, workdir)
    progress: list[tuple[float, dict[str, float]]] = []
    stalled: list[int] = []
    stall_at: dict[str, float] = {}
    final_metrics: Metrics | None = None
    with Sampler(server.pids, server.metrics_urls, interval=1.0) as sampler:
        base = sampler.take()
        fleet = Fleet(gen_specs, workdir)
        try:
            deadline = timeline.end + 60 + load.devices / 1000
            while fleet.running() and time.monotonic() < deadline:
                now = time.monotonic()
                if timeline.stall is not None and not stalled and not stall_at and now >= timeline.stall:
                    stalled = server.pids()
                    sampler.stalled = True
                    signal_all(stalled, signal.SIGSTOP)
                    stall_at["from"] = time.monotonic()
                if stalled and timeline.stall_end is not None and now >= timeline.stall_end:
                    signal_all(stalled, signal.SIGCONT)
                    stall_at["to"] = time.monotonic()
                    stalled = []
                    sampler.stalled = False
                if final_metrics is None and server.metrics_urls and now >= timeline.end - 2.0:
                    # Read before the generators leave: then every worker is busy closing.
                    final_metrics = sampler.scrape(timeout=5.0)
                totals = fleet.totals()
                progress.append((now, totals))
                if show is not None:
                    last = sampler.samples[-1] if sampler.samples else base
                    show(
                        {
                            "phase": timeline.phase(now),
                            "elapsed": now - timeline.start,
                            "devices": load.devices,
                            "silent": round(load.devices * load.silent),
                            **totals,
                            "server_online": last.online,
                            "rss_mb": last.rss / 1e6,
                            "fds": last.fds,
                        }
                    )
                time.sleep(0.25)
        finally:
            if stalled:
                signal_all(stalled, signal.SIGCONT)
            fleet.stop()
        if final_metrics is None and server.metrics_urls:
            final_metrics = sampler.scrape(timeout=5.0)
    results = []
    for spec in gen_specs:
        try:
            results.append(json.loads(Path(spec.results).read_text()))
        except (OSError, ValueError):
            results.append({"index": spec.index, "missing": True})
    shutil.rmtree(workdir, ignore_errors=True)
    merged = merge(load, timeline, results, progress, [base, *sampler.samples], stall_at)
    merged["target"] = server.name
    if final_metrics is not None:
        merged["server_metrics"] = {
            "reaper_lag_p50_ms": histogram_quantile(final_metrics.lag_buckets, 0.5) * 1000,
            "reaper_lag_p99_ms": histogram_quantile(final_metrics.lag_buckets, 0.99) * 1000,
            "reaper_lag_mean_ms": final_metrics.lag_sum / final_metrics.lag_count * 1000
            if final_metrics.lag_count
            else math.nan,
            "expiries": final_metrics.lag_count,
            "stall_saves": final_metrics.stall_saves,
            "expired_by_reason": final_metrics.expired,
        }
    if server.presence_log is not None:
        silent_last = {cid: t for r in results for cid, t in r.get("silent_last", {}).items()}
        merged["server_view"] = server_view(server.presence_log, silent_last, gen_specs, load)
    return merged


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "min": min(ms),
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "max": max(ms),
    }


def _window(samples: list[Sample], start: float, end: float) -> tuple[Sample, Sample] | None:
    inside = [s for s in samples if start <= s.t <= end]
    return (inside[0], inside[-1]) if len(inside) >= 2 else None


def merge(
    load: DeviceLoad,
    timeline: Timeline,
    results: list[dict[str, Any]],
    progress: list[tuple[float, dict[str, float]]],
    samples: list[Sample],
    stall_at: dict[str, float],
) -> dict[str, Any]:
    """Fold the generators' results and the samples into one report."""
    ok = [r for r in results if not r.get("missing")]

    def total(key: str) -> int:
        return int(sum(r[key] for r in ok))

    def joined(key: str) -> list[Any]:
        return [v for r in ok for v in r[key]]

    connack = sorted(joined("connack_times"))
    connected = len(connack)
    connect_span = connack[-1] - connack[0] if connected > 1 else math.nan
    errors: dict[str, int] = {}
    for r in ok:
        for why, n in r["errors"].items():
            errors[why] = errors.get(why, 0) + n
    base = samples[0]
    # Steady state: every device online, before anything happens to them.
    steady = _window(samples, timeline.acts - load.keepalive, timeline.acts)
    hb_window = [(t, p["pings"]) for t, p in progress if timeline.acts - load.keepalive <= t <= timeline.acts]
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
        "refused": total("refused"),
        "connect_errors": errors,
        "connect_rate_per_s": connected / connect_span
        if connect_span == connect_span and connect_span > 0
        else math.nan,
        "connect_ms": _stats_ms(joined("connect_s")),
        "heartbeats": total("pings"),
        "silent": total("silent"),
        "detected": len(lateness),
        "undetected": total("undetected"),
        "lateness_ms": _stats_ms(lateness),
        "negative_lateness": sum(1 for v in lateness if v < 0),
        "false_expiries": sum(len(r["false_expiries"]) for r in ok),
        "false_expiry_examples": joined("false_expiries")[:20],
        "generator_late": total("generator_late"),
        "generator_max_gap_s": max((r["max_gap"] for r in ok), default=math.nan),
        "vanished": total("vanished"),
        "reconnected": total("reconnected"),
        "takeover_ms": _stats_ms(joined("takeover_s")),
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


def server_view(
    log: Path, silent_last: dict[str, float], gen_specs: list[GeneratorSpec], load: DeviceLoad
) -> dict[str, Any]:
    """What the server's presence log says: when it closed each silent device, its own
    lateness figures, and the vanished devices it noticed.

    ``silent_last`` maps a silent device to its last packet (``CLOCK_MONOTONIC``); the
    log's times are wall-clock, so the two are put on one clock here (both run at
    the same rate, and a run is minutes long).
    """
    vanished = {f"{s.prefix}-{s.first + i}" for s in gen_specs for i, _ in s.vanish}
    window = 1.5 * load.keepalive
    wall_minus_mono = time.time() - time.monotonic()
    late: list[float] = []
    close_late: list[float] = []
    reasons: dict[str, int] = {}
    vanish_seen: dict[str, int] = {}
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("status") != "offline":
            continue
        reason = str(event.get("reason"))
        reasons[reason] = reasons.get(reason, 0) + 1
        cid = event.get("client_id")
        if cid in silent_last and reason == "keepalive-timeout":
            late.append(float(event["silent_for"]) - window)
            # The event is written just after the close, so this bounds the close from above.
            close_late.append(float(event["time"]) - (silent_last[cid] + wall_minus_mono + window))
        elif cid in vanished:
            vanish_seen[reason] = vanish_seen.get(reason, 0) + 1
    return {
        "lateness_ms": _stats_ms(late),
        "close_lateness_ms": _stats_ms(close_late),
        "close_lateness_s": close_late,
        "offline_by_reason": reasons,
        "vanished_seen": vanish_seen,
    }


def passed(r: dict[str, Any]) -> bool:
    """The run's pass criteria: all connected, none dropped, every silent one found, none early."""
    return bool(
        r["connected"] == r["devices"]
        and r["false_expiries"] == 0
        and r["undetected"] == 0
        and r["negative_lateness"] == 0
        and r.get("server_view", {}).get("close_lateness_ms", {}).get("min", 0) >= 0
        and r["takeover_missed"] == 0
        and r["generators_missing"] == 0
    )


def report(r: dict[str, Any]) -> str:
    """A short human-readable report."""
    late = r["lateness_ms"]
    close = r.get("server_view", {}).get("close_lateness_ms", {})
    lines = [
        f"target                 {r['target']}",
        f"devices connected      {r['connected']:,} of {r['devices']:,} "
        f"({r['connect_rate_per_s']:,.0f}/s; failed {r['connect_failed']}, refused {r['refused']})",
        f"silent devices found   {r['detected']:,} of {r['silent']:,}",
    ]
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
            f"(min {sv['min']:.0f}; from the loop pass that read the last packet)"
        )
    lines.append(f"false expiries         {r['false_expiries']} healthy devices dropped")
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
        lines.append(
            f"takeovers              {t.get('n', 0):,} of {r['reconnected']:,} old connections closed "
            f"(p50 {t.get('p50', math.nan):.0f} / max {t.get('max', math.nan):.0f} ms), missed {r['takeover_missed']}"
        )
    if r["stall"]:
        saves = r.get("server_metrics", {}).get("stall_saves")
        lines.append(
            f"stall                  SIGSTOP {r['stall']['to'] - r['stall']['from']:.1f} s; "
            + ("" if saves is None else f"stall saves {saves:,.0f}; ")
            + f"healthy dropped: {r['false_expiries']}"
        )
    s = r["steady"]
    if s:
        lines.append(
            f"server at steady state {s['rss_mb']:,.0f} MB RSS, {s['rss_per_device_bytes'] / 1024:.2f} KiB per device, "
            f"{s['open_files']:,} open files, {s['cpu_cores'] * 100:.0f}% CPU for {s['heartbeats_per_s']:,.0f} "
            f"heartbeats/s ({s['cpu_pct_per_1k_heartbeats_per_s']:.1f}% per 1k/s)"
        )
    m = r.get("server_metrics")
    if m:
        lines.append(
            f"reaper lag (/metrics)  p50 <= {m['reaper_lag_p50_ms']:.0f} ms, p99 <= {m['reaper_lag_p99_ms']:.0f} ms "
            f"over {m['expiries']:,.0f} expiries"
        )
    lines.append(f"result                 {'PASS' if passed(r) else 'FAIL'}")
    return "\n".join(lines)


def write_outputs(r: dict[str, Any], json_path: str, plots: str | None) -> list[str]:
    """Write the JSON (and the PNG plots, if ``plots``); return the files written."""
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1, default=float))
    written = [str(path)]
    if plots:
        from .plots import device_plots

        written += device_plots(r, Path(plots))
    return written


def parser(prog: str = "python -m loadtest devices") -> argparse.ArgumentParser:
    """The command line."""
    d = DeviceLoad()
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0] if __doc__ else None)
    a = p.add_argument
    a("--devices", type=int, default=d.devices, help=f"simulated devices (default: {d.devices:,})")
    a("--keepalive", type=int, default=d.keepalive, help=f"device keep-alive K in seconds (default: {d.keepalive})")
    a(
        "--jitter",
        type=float,
        default=d.jitter,
        help="pings come (1 - jitter*U) x K after the last packet (default 0.2)",
    )
    a("--silent", type=float, default=d.silent, help=f"share of devices that go silent (default: {d.silent})")
    a("--vanish", type=float, default=d.vanish, help="share of devices that reset their connection (default: 0)")
    a("--reconnect", type=float, default=d.reconnect, help="share that reconnect with the same client id (default: 0)")
    a("--stall", action="store_true", help="SIGSTOP the server for 2 x K, then SIGCONT")
    a("--rate", type=float, default=d.rate, help=f"connections per second (default: {d.rate:,.0f})")
    a("--per-generator", type=int, default=d.per_generator, help="devices per generator process (default: 15000)")
    a("--workers", type=int, default=None, help="server workers (default: enough for the devices, at least 2)")
    a("--tick", type=float, default=0.1, help="server keeper tick in seconds (default: 0.1)")
    a("--port", type=int, default=None, help="drive an already running server on this port instead of starting one")
    a("--pid", type=int, action="append", default=[], help="with --port: a server PID to sample (and to stall)")
    a("--json", default="results/devices.json", help="JSON results (default: results/devices.json)")
    a("--plots", default="results/plots", help="directory for the PNG plots ('' for none)")
    a("--quiet", action="store_true", help="no live progress")
    a("--seed", type=int, default=d.seed, help="random seed for roles and jitter")
    return p


def load_from(args: argparse.Namespace) -> DeviceLoad:
    """The workload from parsed arguments."""
    return DeviceLoad(
        devices=args.devices,
        keepalive=args.keepalive,
        jitter=args.jitter,
        silent=args.silent,
        vanish=args.vanish,
        reconnect=args.reconnect,
        stall=args.stall,
        rate=args.rate,
        per_generator=args.per_generator,
        seed=args.seed,
    )


@dataclass
class ExternalServer:
    """A server started by someone else: a port, and the PIDs to sample."""

    port: int
    pid_list: list[int] = field(default_factory=list)
    name: str = "external"
    metrics_urls: list[str] = field(default_factory=list)
    presence_log: Path | None = None

    def pids(self) -> list[int]:
        return [p.pid for pid in self.pid_list for p in process_tree(pid)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest devices``."""
    return main_with(parser().parse_args(argv))


def main_with(args: argparse.Namespace) -> int:
    """Run the workload the parsed ``args`` describe; print the report; 0 if it passed."""
    load = load_from(args)
    server: ServerUnderTest
    started: HeartbeatTarget | None = None
    if args.port is not None:
        server = ExternalServer(args.port, args.pid)
    else:
        if not args.quiet:
            print(f"starting servers.heartbeat for {load.devices:,} devices ...", flush=True)
        started = HeartbeatTarget.start(load.devices, tick=args.tick, workers=args.workers)
        server = started
    try:
        with Live(enabled=not args.quiet) as live:
            result = run_devices(load, server, show=live.update)
    finally:
        if started is not None:
            started.stop()
    result["tick_s"] = args.tick
    written = write_outputs(result, args.json, args.plots or None)
    print(report(result))
    print("written                " + ", ".join(written))
    return 0 if passed(result) else 1
