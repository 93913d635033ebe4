"""Several listeners at once, ours beside Mosquitto, in one run (issue 63).

    python -m benchmarks.listeners [--devices 1000] [--keepalive 5] [--seconds 20] [--json FILE]

Each target serves three listeners on loopback at once: plain MQTT, MQTT over TLS
(a fresh trustme CA and server certificate, ECDSA P-256) and MQTT over WebSockets
(path ``/mqtt``, subprotocol ``mqtt``). ``idlekeeper`` is ``servers.heartbeat
--workers 1`` on its default dense engine with three ``--listener`` URLs and a status
port; ``mosquitto`` is the Debian broker with the same three ``listener`` sections in a
generated ``mosquitto.conf`` (``allow_anonymous true``, ``set_tcp_nodelay true``: trio
sets TCP_NODELAY on every socket, so both answer without Nagle's wait).

The targets run one after the other, each alone, the server pinned to one CPU and
this process (every client) to the other. For each, ``--devices`` MQTT 3.1.1 devices
connect on each listener, interleaved (one of each kind in turn), with keep-alive
``--keepalive``; once all are online each sends a PINGREQ every keep-alive, the phases
spread at random, for ``--seconds``. Measured: devices connected per listener (all
must be), the server's RSS delta over the devices (after a warm-up, so the first
connections' one-off costs are not counted), its CPU seconds per 1,000 heartbeats
answered in the window, and PINGRESP latency p50/p99 per listener, as the client
sees it. For ours the status port's ``/metrics`` and ``/presence.json`` must both say,
per listener, that exactly the devices connected are online and were accepted, and
none refused, after connecting and again at the end of the window: the run fails
loudly otherwise. Ratios are ours over Mosquitto's.

Every phase is bounded in count and time; every server is stopped by its PID.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

from loadtest.mqtt_targets import PeerUnavailable
from loadtest.processes import load_side, split_cpus
from loadtest.report import write_json
from loadtest.sampler import cpu_seconds, processes, rss_bytes
from loadtest.stats import percentile
from loadtest.tls_load import CertFiles, make_certs

from .fleet import Fleet, client_context, connect_all
from .model import KINDS, TARGETS, ListenerResult, Load, Report, TargetResult
from .targets import Served, check_figures, listener_figures, machine, start_target

__all__ = ["main", "measure", "ratios", "render", "run"]

WARM_UP = 20
"""Devices per listener connected and closed before the RSS baseline: the first
connections of a kind pay one-off costs (a TLS context, code paths first run) that
are not a device's."""


def measure(served: Served, load: Load, certs: CertFiles) -> TargetResult:
    """Run ``load`` against a target serving three listeners; its figures and problems."""
    result = TargetResult(served.target.name)
    ctx = client_context(certs)
    procs = processes(served.target.pids(), trees=True)
    warm = Fleet(load, ctx)
    try:
        connect_all(warm, served.ports, min(WARM_UP, load.devices), "warm")
    finally:
        warm.close()
    time.sleep(1.5)  # the server has seen every warm-up connection close
    before = listener_figures(served.status_port) if served.status_port is not None else None
    result.rss_before = rss_bytes(procs)
    fleet = Fleet(load, ctx)
    try:
        connect_all(fleet, served.ports, load.devices, "dev")
        settle = time.monotonic() + 1.0  # the server's memory after the burst, not during it
        while time.monotonic() < settle:
            fleet.serve(0.05)
        result.rss_after = rss_bytes(procs)
        connected = {kind: fleet.online(kind) for kind in KINDS}
        result.devices = sum(connected.values())
        if before is not None and served.status_port is not None:
            seen = listener_figures(served.status_port)
            result.figures["connected"] = seen
            result.problems += check_figures(served, seen, before, connected, "after connecting")
        cpu0, client0 = cpu_seconds(procs), time.process_time()
        fleet.recording = True
        start = time.monotonic()
        end = start + load.seconds
        while time.monotonic() < end:
            fleet.serve(0.02)
        fleet.recording = False
        result.window_s = time.monotonic() - start
        result.cpu_seconds = cpu_seconds(procs) - cpu0
        result.client_cpu = (time.process_time() - client0) / result.window_s
        still = {kind: fleet.online(kind) for kind in KINDS}
        if before is not None and served.status_port is not None:
            seen = listener_figures(served.status_port)
            result.figures["end"] = seen
            result.problems += check_figures(served, seen, before, still, "at the end")
        # The last answers (no new beats meanwhile), bounded.
        fleet.pinging = False
        drain = time.monotonic() + 2.0
        while any(d.sent for d in fleet.by_fd.values()) and time.monotonic() < drain:
            fleet.serve(0.05)
        for kind in KINDS:
            lat = [x * 1000 for x in fleet.latencies[kind]]
            opened = [x * 1000 for x in fleet.connect_times[kind]]
            result.listeners[kind] = ListenerResult(
                served.listener_name(kind),
                connected=connected[kind],
                open_errors=fleet.open_errors[kind],
                closed_by_server=connected[kind] - still[kind],
                heartbeats=fleet.heartbeats[kind],
                unanswered=sum(len(d.sent) for d in fleet.by_fd.values() if d.kind == kind),
                p50_ms=percentile(lat, 50),
                p99_ms=percentile(lat, 99),
                max_ms=max(lat, default=math.nan),
                connect_p50_ms=percentile(opened, 50),
                connect_p99_ms=percentile(opened, 99),
            )
    finally:
        fleet.close()
    result.heartbeats = sum(r.heartbeats for r in result.listeners.values())
    if result.devices:
        result.rss_per_device = (result.rss_after - result.rss_before) / result.devices
    if result.heartbeats:
        result.cpu_per_1000_heartbeats = result.cpu_seconds * 1000 / result.heartbeats
    for kind, r in result.listeners.items():
        if r.connected != load.devices:
            result.problems.append(
                f"{r.name}: {r.connected} of {load.devices} devices connected ({r.open_errors} failed)"
            )
        if r.closed_by_server:
            result.problems.append(f"{r.name}: the server closed {r.closed_by_server} devices in the window")
        if r.unanswered:
            result.problems.append(f"{r.name}: {r.unanswered} PINGREQs never answered")
        if not r.heartbeats:
            result.problems.append(f"{r.name}: no heartbeat answered in the window ({kind})")
    return result


def run(load: Load, targets: tuple[str, ...] = TARGETS, pinned: bool = True) -> Report:
    """Measure each of ``targets`` in turn (a target that cannot run here gets a note)."""
    report = Report(load, machine())
    split = split_cpus() if pinned else None
    with tempfile.TemporaryDirectory(prefix="ik-listeners-") as where:
        certs = make_certs(Path(where))
        for name in targets:
            try:
                served = start_target(name, certs, split)
            except (PeerUnavailable, RuntimeError) as exc:
                report.targets[name] = TargetResult(name, note=str(exc).splitlines()[0])
                continue
            try:
                with load_side(split):
                    report.targets[name] = measure(served, load, certs)
            finally:
                served.target.stop()  # by PID
    ours, theirs = report.targets.get("idlekeeper"), report.targets.get("mosquitto")
    if ours is not None and theirs is not None and not ours.note and not theirs.note:
        report.ratios = ratios(ours, theirs)
    return report


def ratios(ours: TargetResult, theirs: TargetResult) -> dict[str, float]:
    """Ours over Mosquitto's, figure by figure (NaN where Mosquitto's is 0 or missing)."""

    def over(a: float, b: float) -> float:
        return a / b if b and b == b and a == a else math.nan

    out = {
        "rss_per_device": over(ours.rss_per_device, theirs.rss_per_device),
        "cpu_per_1000_heartbeats": over(ours.cpu_per_1000_heartbeats, theirs.cpu_per_1000_heartbeats),
    }
    for kind in KINDS:
        a, b = ours.listeners.get(kind), theirs.listeners.get(kind)
        if a is not None and b is not None:
            out[f"{kind}_p50"] = over(a.p50_ms, b.p50_ms)
            out[f"{kind}_p99"] = over(a.p99_ms, b.p99_ms)
    return out


# -- the report --------------------------------------------------------------------------


def _num(value: float, spec: str) -> str:
    return "—" if value != value else format(value, spec)


def render(report: Report) -> str:
    """The run as Markdown tables: per listener, per target, and the ratios."""
    load = report.load
    lines = [
        f"{load.devices:,} devices on each of 3 listeners, keep-alive {load.keepalive} s, "
        f"a PINGREQ each keep-alive for {load.seconds:g} s",
        "",
        "| target | listener | connected | connect p50 / p99 | heartbeats | PINGRESP p50 | p99 | max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in report.targets.values():
        if t.note:
            lines.append(f"| {t.name} | not run: {t.note} | | | | | | |")
            continue
        for kind, r in t.listeners.items():
            lines.append(
                f"| {t.name} | {kind} | {r.connected:,}/{load.devices:,} | "
                f"{_num(r.connect_p50_ms, '.1f')} / {_num(r.connect_p99_ms, '.1f')} ms | {r.heartbeats:,} | "
                f"{_num(r.p50_ms, '.2f')} ms | {_num(r.p99_ms, '.2f')} ms | {_num(r.max_ms, '.1f')} ms |"
            )
    lines += [
        "",
        "| target | devices | RSS per device | server CPU per 1,000 heartbeats | heartbeats | client CPU |",
        "|---|---|---|---|---|---|",
    ]
    for t in report.targets.values():
        if not t.note:
            lines.append(
                f"| {t.name} | {t.devices:,} | {_num(t.rss_per_device / 1024, ',.1f')} KiB | "
                f"{_num(t.cpu_per_1000_heartbeats * 1000, '.1f')} ms | {t.heartbeats:,} | "
                f"{_num(t.client_cpu, '.2f')} cores |"
            )
    if report.ratios:
        q = report.ratios
        lines += [
            "",
            f"Ours / Mosquitto: RSS per device {_num(q['rss_per_device'], '.2f')}×, "
            f"CPU per 1,000 heartbeats {_num(q['cpu_per_1000_heartbeats'], '.2f')}×; "
            "PINGRESP p50/p99 "
            + ", ".join(
                f"{kind} {_num(q.get(f'{kind}_p50', math.nan), '.2f')}×/{_num(q.get(f'{kind}_p99', math.nan), '.2f')}×"
                for kind in KINDS
            ),
        ]
    ours = report.targets.get("idlekeeper")
    if ours is not None and not ours.note and ours.figures:
        lines += ["", "Ours' status port, per listener (online/accepted/refused, /metrics = /presence.json):"]
        for when, seen in ours.figures.items():
            shown = ", ".join(
                f"{name.split(':')[0]} {f['online']}/{f['accepted']}/{f['refused']}"
                for name, f in seen["metrics"].items()
            )
            lines.append(f"- {when.replace('_', ' ')}: {shown}")
    for t in report.targets.values():
        for problem in t.problems:
            lines.append(f"PROBLEM {t.name}: {problem}")
    lines.append(f"\nresult                 {'PASS' if report.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; 0 if every target that ran passed."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.listeners", description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--devices", type=int, default=Load.devices, help="devices on each listener (default: %(default)s)")
    p.add_argument("--keepalive", type=int, default=Load.keepalive, help="seconds (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=Load.seconds, help="the measured window (default: %(default)s)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, of: " + ", ".join(TARGETS))
    p.add_argument("--no-pin", action="store_true", help="leave the server and the clients on any CPU")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    args = p.parse_args(argv)
    targets = tuple(t for t in args.targets.split(",") if t)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        p.error(f"--targets: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(TARGETS)}")
    try:
        load = Load(devices=args.devices, keepalive=args.keepalive, seconds=args.seconds)
    except ValueError as exc:
        p.error(str(exc))
    report = run(load, targets, pinned=not args.no_pin)
    print(render(report))
    if args.json:
        print("written                " + str(write_json(args.json, report.as_json())))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
