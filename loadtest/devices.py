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

The devices speak MQTT 3.1.1 unless ``--protocol`` says otherwise: ``3.1``, ``3.1.1``
or ``5`` for all of them, ``mixed`` for half 5.0 and half 3.1.1, or shares such as
``5:0.5`` or ``3.1:0.1,5:0.3`` (the rest 3.1.1; :mod:`loadtest.mqtt_versions`). A 5.0
device asks for no session (Session Expiry 0) and a Receive Maximum, pings at the
server's keep-alive when its CONNACK gives one (Server Keep Alive), and counts the
server's DISCONNECTs by reason code; the report gives the protocol mix, the refusals by
the server's answer and those reason codes.

Measured: connect rate; false expiries (healthy devices the server dropped: the
required figure is 0); detection lateness of every silent device (its close, seen
by the device, minus its last packet + 1.5 K: never negative); takeovers; server
RSS, CPU and open files over time (psutil, every process); reaper lag and stall
saves from the workers' ``/metrics``. Results go to JSON, and PNG plots next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .device_results import merge, passed, report, server_view, write_outputs
from .generator.pool import GeneratorPool
from .live import Live, run_progress
from .mqtt_targets import ExternalServer, HeartbeatTarget, ServerUnderTest
from .options import (
    add_devices,
    add_json,
    add_keepalive,
    add_protocol,
    add_quiet,
    add_rate,
    add_running_server,
    add_seed,
    add_silent,
    add_steady,
    add_tick,
    command_parser,
    fields_from,
)
from .report import written
from .sampler import Metrics, Sampler, histogram_quantile
from .workload import DeviceLoad, generator_count, plan, specs

__all__ = ["load_from", "main", "main_with", "parser", "run_devices", "signal_all"]

_LOAD_FLAGS = (
    "devices",
    "keepalive",
    "steady",
    "jitter",
    "ping_batch",
    "silent",
    "vanish",
    "reconnect",
    "stall",
    "rate",
    "per_generator",
    "seed",
    "protocol",
)
"""The flags that make a :class:`~loadtest.workload.DeviceLoad`, by its field names."""


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
    stall_length = 0.0 if timeline.stall is None or timeline.stall_end is None else timeline.stall_end - timeline.stall
    final_metrics: Metrics | None = None
    with Sampler(server.pids, server.metrics_urls, interval=1.0) as sampler:
        base = sampler.take()
        pool = GeneratorPool(gen_specs, workdir)
        try:
            deadline = timeline.end + 60 + load.devices / 1000
            while pool.running() and time.monotonic() < deadline:
                now = time.monotonic()
                if timeline.stall is not None and not stalled and not stall_at and now >= timeline.stall:
                    stalled = server.pids()
                    sampler.stalled = True
                    signal_all(stalled, signal.SIGSTOP)
                    stall_at["from"] = time.monotonic()
                # The stall lasts its planned length from when it began, however late this
                # loop came to it (a busy machine, a slow scrape).
                if stalled and timeline.stall_end is not None and now >= stall_at["from"] + stall_length:
                    signal_all(stalled, signal.SIGCONT)
                    stall_at["to"] = time.monotonic()
                    stalled = []
                    sampler.stalled = False
                if final_metrics is None and server.metrics_urls and now >= timeline.end - 2.0:
                    # Read before the generators leave: then every worker is busy closing.
                    final_metrics = sampler.scrape(timeout=5.0)
                totals = pool.totals()
                progress.append((now, totals))
                if show is not None:
                    last = sampler.samples[-1] if sampler.samples else base
                    show(
                        run_progress(
                            timeline,
                            now,
                            load.devices,
                            load.silent,
                            totals,
                            server_online=last.online,
                            rss_mb=last.rss / 1e6,
                            fds=last.fds,
                        )
                    )
                pause = 0.25
                if timeline.stall is not None and not stall_at:
                    pause = min(pause, max(0.0, timeline.stall - time.monotonic()))
                elif stalled:
                    pause = min(pause, max(0.0, stall_at["from"] + stall_length - time.monotonic()))
                time.sleep(pause)
        finally:
            if stalled:
                signal_all(stalled, signal.SIGCONT)
            pool.stop()
        if final_metrics is None and server.metrics_urls:
            final_metrics = sampler.scrape(timeout=5.0)
    results = pool.results()
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
        windows = {cid: w for r in results for cid, w in r.get("silent_window", {}).items()}
        merged["server_view"] = server_view(server.presence_log, silent_last, gen_specs, load, windows)
    return merged


def parser(prog: str = "python -m loadtest devices") -> argparse.ArgumentParser:
    """The command line."""
    d = DeviceLoad()
    p = command_parser(prog, __doc__)
    a = p.add_argument
    add_devices(p, d.devices)
    add_keepalive(p, d.keepalive)
    add_steady(p)
    a(
        "--jitter",
        type=float,
        default=d.jitter,
        help="pings come (1 - jitter*U) x K after the last packet (default 0.2)",
    )
    a(
        "--ping-batch",
        type=float,
        default=d.ping_batch,
        help="seconds a ping may wait to share its generator's wake-up with others (default 0.2)",
    )
    add_silent(p, d.silent)
    a("--vanish", type=float, default=d.vanish, help="share of devices that reset their connection (default: 0)")
    a("--reconnect", type=float, default=d.reconnect, help="share that reconnect with the same client id (default: 0)")
    a("--stall", action="store_true", help="SIGSTOP the server for 2 x K, then SIGCONT")
    add_protocol(p, d.protocol)
    add_rate(p, d.rate)
    a("--per-generator", type=int, default=d.per_generator, help="devices per generator process (default: 15000)")
    a("--workers", type=int, default=None, help="server workers (default: enough for the devices, at least 2)")
    add_tick(p, 0.1, "server keeper")
    a(
        "--engine",
        choices=("dense", "streams"),
        default="dense",
        help="the server's engine: dense (no task per connection) or streams (default: dense)",
    )
    a(
        "--coalesce",
        type=float,
        default=0.0,
        help="the server's --coalesce: seconds the dense engine gathers packets per pass (default: 0)",
    )
    a(
        "--coalesce-pings",
        type=float,
        default=0.0,
        help="the server's --coalesce-pings: seconds the dense engine gathers PINGREQs per pass while "
        "nothing else comes (default: 0, the server's own: 0.04 while they come faster than one a window)",
    )
    add_running_server(
        p,
        port_help="drive an already running server on this port instead of starting one",
        pid_help="with --port: a server PID to sample (and to stall)",
    )
    add_json(p, "results/devices.json")
    a("--plots", default="results/plots", help="directory for the PNG plots ('' for none)")
    add_quiet(p)
    add_seed(p, d.seed, help="random seed for roles and jitter")
    return p


def load_from(args: argparse.Namespace) -> DeviceLoad:
    """The workload from parsed arguments."""
    return DeviceLoad(**fields_from(args, _LOAD_FLAGS))


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
        started = HeartbeatTarget.start(
            load.devices,
            tick=args.tick,
            workers=args.workers,
            engine=args.engine,
            coalesce=args.coalesce,
            coalesce_pings=args.coalesce_pings,
        )
        server = started
    try:
        with Live(enabled=not args.quiet) as live:
            result = run_devices(load, server, show=live.update)
    finally:
        if started is not None:
            started.stop()
    result["tick_s"] = args.tick
    paths = write_outputs(result, args.json, args.plots or None)
    print(report(result))
    print(written(paths))
    return 0 if passed(result) else 1
