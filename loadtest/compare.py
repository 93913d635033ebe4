"""``python -m loadtest compare``: the same workloads against idlekeeper's servers and their peers.

    python -m loadtest compare [--devices 10000] [--keepalive 10] [--only devices|http|qos]
        [--mqtt-protocols 3.1.1,5]

**Devices**, one server process each, in turn: ``servers.heartbeat`` (idlekeeper) on
its default dense engine, on the same with ``--coalesce`` (``idlekeeper-coalesced``)
and on the streams engine (a task per connection), the
trio-native baseline in :mod:`loadtest.baseline` (one ``move_on_after`` per
read), amqtt (its own virtualenv) and Mosquitto (when installed). Every target gets
the same fleet: keep-alive K, a share going silent, and a SIGSTOP stall of 2 x K.
The fleet runs once per MQTT version of ``--mqtt-protocols`` (default: 3.1.1 and 5):
its 5.0 rows, named ``<target> (5.0)``, stand beside the 3.1.1 rows for the targets
that serve 5.0 (ours and Mosquitto; the baseline and amqtt speak 3.1.1 only), their
ratios taken to ours on 5.0. ``--mqtt-protocols 3.1.1`` gives the 3.1.1 rows alone,
``--mqtt-protocols 5`` the 5.0 rows alone.

**HTTP**: ``servers.http`` against hypercorn (trio worker) and uvicorn serving a
trivial ASGI app, each under keep-alive load alone and then with slowloris
attackers and slow readers (:mod:`loadtest.http.load`).

**QoS**: ``servers.heartbeat`` (one worker, dense engine) against Mosquitto: QoS 1
throughput from several publishers to one acknowledging subscriber, exactly once,
and server memory per message queued for an absent persistent session
(:mod:`loadtest.qos`).

The result is one table (Markdown, also written to ``--out``): each figure with its
unit and its ratio to idlekeeper's. The machine is shared and noisy, so only ratios
from one run are compared.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .device_results import report
from .devices import run_devices
from .http.load import describe, run_http, start_target
from .http.loadgen import median_round, rounds_in_turn, run_load
from .http.targets import ALL_HTTP_TARGETS, HTTP_TARGETS
from .http.workload import HttpLoad
from .live import Live
from .mqtt_targets import HeartbeatTarget, PeerUnavailable, start_mqtt_target
from .mqtt_versions import NAMES, V311, parse_mix
from .options import (
    add_devices,
    add_json,
    add_keepalive,
    add_quiet,
    add_silent,
    add_steady,
    add_targets,
    add_tick,
    command_parser,
)
from .processes import free_port, load_side, split_cpus, stop
from .qos import QOS_TARGETS, run_qos
from .qos.load import QosLoad
from .qos.report import headline, qos_row, qos_table
from .report import Column, number, plural, show_table, skip_reason, table, write_json
from .workload import DeviceLoad

__all__ = ["compare_devices", "compare_http", "main"]

MQTT_TARGETS = (
    "idlekeeper",
    "idlekeeper-pings",
    "idlekeeper-coalesced",
    "idlekeeper-streams",
    "baseline",
    "amqtt",
    "mosquitto",
)
V5_TARGETS = ("idlekeeper", "idlekeeper-pings", "idlekeeper-coalesced", "idlekeeper-streams", "mosquitto")
"""The MQTT targets that serve 5.0 (the baseline and amqtt 0.12 speak 3.1.1 only)."""
MQTT_PROTOCOLS = ("3.1.1", "5")


def row_name(target: str, protocol: str) -> str:
    """A device row's name: the target's for 3.1.1 (as before there were 5.0 rows), else with
    the version: ``mosquitto (5.0)``."""
    level = next(iter(parse_mix(protocol)))
    return target if level == V311 else f"{target} ({NAMES[level]})"


def versions(text: str) -> list[str]:
    """``--mqtt-protocols``: each version's name (``3.1.1``, ``5.0``); ValueError for a mix."""
    out = []
    for item in text.split(","):
        mix = parse_mix(item)
        if len(mix) != 1:
            raise ValueError(f"--mqtt-protocols: {item!r} is a mix; a row is one version (3.1, 3.1.1 or 5)")
        out.append(NAMES[next(iter(mix))])
    return out


def ours_for(row: str) -> str:
    """The row a device row's ratios are taken to: idlekeeper on the same MQTT version."""
    return "idlekeeper" + row[row.index(" (") :] if " (" in row else "idlekeeper"


def device_row(r: dict[str, Any]) -> dict[str, float]:
    """The figures of one device run that go into the table."""
    late = r.get("lateness_ms", {})
    steady = r.get("steady", {})
    return {
        "connected_pct": 100 * r["connected"] / r["devices"] if r.get("devices") else math.nan,
        "detected_pct": 100 * r["detected"] / r["silent"] if r.get("silent") else math.nan,
        "lateness_p50_ms": number(late.get("p50")),
        "lateness_p99_ms": number(late.get("p99")),
        "lateness_max_ms": number(late.get("max")),
        "false_expiries": float(r["false_expiries"]),
        "rss_per_conn_bytes": number(steady.get("rss_per_device_bytes")),
        "cpu_pct_per_1k_hbps": number(steady.get("cpu_pct_per_1k_heartbeats_per_s")),
        "connect_rate_per_s": number(r.get("connect_rate_per_s")),
    }


DEVICE_COLUMNS: tuple[Column, ...] = (
    ("connected_pct", "connected", "%", True),
    ("detected_pct", "silent detected", "%", True),
    ("lateness_p50_ms", "lateness p50", "ms", False),
    ("lateness_p99_ms", "lateness p99", "ms", False),
    ("lateness_max_ms", "lateness max", "ms", False),
    ("false_expiries", "false expiries", "", False),
    ("rss_per_conn_bytes", "RSS per connection", "B", False),
    ("cpu_pct_per_1k_hbps", "CPU per 1k heartbeats/s", "% core", False),
)

HTTP_COLUMNS: tuple[Column, ...] = (
    ("rps", "req/s", "", True),
    ("cpu_us", "server CPU a request", "µs", False),
    ("rps_attack", "req/s under attack", "", True),
    ("p99_ms_attack", "p99 latency under attack", "ms", False),
    ("slowloris_hold_p50_s", "slowloris hold p50", "s", False),
    ("slowloris_hold_max_s", "slowloris hold max", "s", False),
    ("slowloris_still_held", "slowloris never cut", "", False),
    ("slow_reader_hold_p50_s", "slow reader hold p50", "s", False),
    ("slow_readers_still_held", "slow readers never cut", "", False),
    ("idle_rss_per_conn", "RSS per idle connection", "B", False),
)


def compare_devices(
    load: DeviceLoad,
    targets: Sequence[str],
    tick: float,
    quiet: bool,
    coalesce: float = 1.0,
    protocols: Sequence[str] = ("3.1.1",),
    coalesce_pings: float = 0.1,
) -> dict[str, Any]:
    """Run ``load`` against each MQTT target in turn (``idlekeeper-coalesced`` at ``coalesce``,
    ``idlekeeper-pings`` at ``coalesce_pings``),
    once per MQTT version of ``protocols`` (each a version the devices all speak): a row per
    target and version (:func:`row_name`); a target that does not serve 5.0 has none for it."""
    results: dict[str, Any] = {}
    missing: dict[str, str] = {}
    for protocol in protocols:
        level = next(iter(parse_mix(protocol)))
        for target in targets:
            name = row_name(target, protocol)
            if level == 5 and target not in V5_TARGETS:
                missing[name] = "speaks MQTT 3.1.1 only"
                continue
            device_load = dataclasses.replace(load, protocol=NAMES[level])
            r = _device_run(target, name, device_load, tick, quiet, (coalesce, coalesce_pings))
            if isinstance(r, str):
                missing[name] = r
            else:
                results[name] = r
    rows = {name: device_row(r) for name, r in results.items()}
    return {
        "runs": results,
        "rows": rows,
        "missing": missing,
        "table": table(rows, DEVICE_COLUMNS, missing, ours_for),
    }


def _device_run(
    name: str, row: str, load: DeviceLoad, tick: float, quiet: bool, windows: tuple[float, float]
) -> dict[str, Any] | str:
    """One target's device run (its results), or why it could not run. ``windows``: the
    ``--coalesce`` of ``idlekeeper-coalesced`` and the ``--coalesce-pings`` of ``idlekeeper-pings``."""
    print(f"\n== devices: {row} ==", flush=True)
    stop_server: Callable[[], None]
    try:
        if name.startswith("idlekeeper"):
            engine = "streams" if name == "idlekeeper-streams" else "dense"
            coalesce, pings = windows
            ours = HeartbeatTarget.start(
                load.devices,
                tick=tick,
                workers=1,
                engine=engine,
                coalesce=coalesce if name == "idlekeeper-coalesced" else 0.0,
                coalesce_pings=pings if name == "idlekeeper-pings" else 0.0,
            )
            ours.name = row
            server: Any = ours
            stop_server = ours.stop
        else:
            peer = start_mqtt_target(name, free_port())
            peer.name = row
            server = peer
            stop_server = peer.stop
    except (PeerUnavailable, RuntimeError, OSError) as exc:
        why = skip_reason(exc)
        print(f"   skipped: {why}", flush=True)
        return why
    try:
        with Live(enabled=not quiet) as live:
            r = run_devices(load, server, show=live.update)
    finally:
        stop_server()
    r["tick_s"] = tick
    print(report(r), flush=True)
    r.pop("lateness_s", None)
    r.pop("timeline", None)
    return r


def compare_http(load: HttpLoad, targets: Sequence[str], rounds: int = 3, pinned: bool = True) -> dict[str, Any]:
    """Run the HTTP workload against each target, the unattacked load in interleaved rounds.

    Every server is started first (pinned to a core of its own with ``pinned``, the
    load on the others), then each round loads each server in turn, starting from the
    next one each round, so that a disturbance of the shared machine falls on all of
    them alike; a server's figure is its median round. The attack phases follow, one
    server at a time, each between two unattacked loads of its own (what the attack
    costs is read against those, not against rounds minutes old).
    """
    split = split_cpus() if pinned else None
    results: dict[str, Any] = {}
    missing: dict[str, str] = {}
    started: dict[str, tuple[Any, int, list[int]]] = {}
    try:
        for name in targets:
            try:
                started[name] = start_target(name, load, split)
            except (RuntimeError, OSError, ValueError) as exc:
                missing[name] = skip_reason(exc)
                print(f"\n== http: {name} ==\n   skipped: {missing[name]}", flush=True)
        names = list(started)
        with load_side(split):
            alone = rounds_in_turn(
                names,
                rounds,
                lambda name: run_load(started[name][1], load.connections, load.duration, pids=started[name][2]),
                "http: unattacked",
            )
        for name in names:
            print(f"\n== http: {name} ==", flush=True)
            _proc, port, pids = started[name]
            try:
                result = run_http(
                    name, load, port=port, pids=pids, alone=median_round(alone[name]), split=split, beside=True
                )
            except (RuntimeError, OSError) as exc:
                missing[name] = skip_reason(exc)
                print(f"   skipped: {missing[name]}", flush=True)
                continue
            result.alone_rounds = alone[name]
            results[name] = result.to_json()
            print(describe(results[name]), flush=True)
    finally:
        for proc, _port, _pids in started.values():
            stop(proc)
    rows = {name: http_row(r) for name, r in results.items()}
    return {"runs": results, "rows": rows, "missing": missing, "table": table(rows, HTTP_COLUMNS, missing)}


def http_row(r: dict[str, Any]) -> dict[str, float]:
    """The figures of one HTTP run that go into the table."""
    return {key: number(r.get(key)) for key, _, _, _ in HTTP_COLUMNS}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest compare``."""
    p = command_parser("python -m loadtest compare", __doc__)
    a = p.add_argument
    a("--only", choices=("devices", "http", "qos"), default=None, help="run one part only")
    a("--mqtt-targets", default=",".join(MQTT_TARGETS), help="comma-separated (default: all six)")
    a(
        "--mqtt-protocols",
        default=",".join(MQTT_PROTOCOLS),
        help="comma-separated MQTT versions the device fleet runs in, each a row per target: 3.1, 3.1.1, 5 "
        "(default: 3.1.1,5; 5.0 rows only for targets that serve it, named '<target> (5.0)')",
    )
    a(
        "--http-targets",
        default=",".join(HTTP_TARGETS),
        help="comma-separated, of " + ", ".join(ALL_HTTP_TARGETS) + " (default: " + ",".join(HTTP_TARGETS) + ")",
    )
    add_devices(p, 10_000, help="devices per target: one process each")
    add_keepalive(p, 10)
    add_steady(p)
    add_silent(p, 0.05)
    a("--no-stall", action="store_true", help="skip the 2 x K SIGSTOP of each server")
    a(
        "--ping-batch",
        type=float,
        default=DeviceLoad.ping_batch,
        help="seconds a device's ping may wait to share its generator's wake-up with others "
        "(default 0.2; near 0, pings arrive spread out, as independent devices send them)",
    )
    add_tick(p, 0.1, "idlekeeper's")
    a("--coalesce", type=float, default=1.0, help="idlekeeper-coalesced's --coalesce, seconds (default: 1)")
    a(
        "--coalesce-pings",
        type=float,
        default=0.1,
        help="idlekeeper-pings's --coalesce-pings, seconds (default: 0.1)",
    )
    HttpLoad.add_arguments(p, prefix="http-")
    a("--http-rounds", type=int, default=3, help="interleaved unattacked rounds per HTTP server (default: 3)")
    a(
        "--no-pin",
        action="store_true",
        help="let the HTTP servers and their load share every CPU (default: each server on the last CPU, "
        "the load on the others)",
    )
    add_targets(p, QOS_TARGETS, prefix="qos-")
    QosLoad.add_arguments(p, prefix="qos-")
    add_json(p, "results/compare.json", table=True, flag="--out")
    add_quiet(p)
    a("--render", default=None, metavar="JSON", help="only print the tables of an earlier run's JSON")
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    if args.render:
        out = json.loads(Path(args.render).read_text())
        for half, row, columns in (("devices", device_row, DEVICE_COLUMNS), ("http", http_row, HTTP_COLUMNS)):
            if half in out:
                rows = {name: row(r) for name, r in out[half]["runs"].items()}
                print(table(rows, columns, out[half]["missing"], ours_for) + "\n")
        if "qos" in out:
            rows = {name: qos_row(r) for name, r in out["qos"]["runs"].items()}
            print(qos_table(rows, out["qos"]["missing"]) + "\n")
        return 0
    try:
        # Checked before the other parts run for many minutes.
        qos_load = QosLoad.from_args(args, prefix="qos-")
        protocols = versions(args.mqtt_protocols)
    except ValueError as exc:
        p.error(str(exc))
    if args.only in (None, "devices"):
        load = DeviceLoad(
            devices=args.devices,
            keepalive=args.keepalive,
            silent=args.silent,
            stall=not args.no_stall,
            ping_batch=args.ping_batch,
            steady=args.steady,
        )
        out["devices"] = compare_devices(
            load,
            args.mqtt_targets.split(","),
            args.tick,
            args.quiet,
            args.coalesce,
            protocols,
            coalesce_pings=args.coalesce_pings,
        )
    if args.only in (None, "http"):
        out["http"] = compare_http(
            HttpLoad.from_args(args, prefix="http-"),
            args.http_targets.split(","),
            rounds=args.http_rounds,
            pinned=not args.no_pin,
        )
    if args.only in (None, "qos"):
        out["qos"] = run_qos(qos_load, args.qos_targets.split(","), quiet=args.quiet)
    path = write_json(args.out, out)
    tables = []
    if "devices" in out:
        tables.append(
            f"Devices: {args.devices:,} per target, keep-alive {args.keepalive} s, {args.silent:.0%} silent"
            + f", MQTT {' and '.join(protocols)}"
            + ("" if args.no_stall else ", SIGSTOP for 2 x K")
            + "\n\n"
            + out["devices"]["table"]
        )
    if "http" in out:
        tables.append(
            f"HTTP: {args.http_connections} keep-alive connections for {args.http_duration:g} s "
            f"(the median of {plural(args.http_rounds, 'interleaved round')}"
            + ("" if args.no_pin else ", each server pinned to a core of its own and the load to the others")
            + f"), then the same with {args.slowloris} slowloris and {args.slow_readers} slow readers\n\n"
            + out["http"]["table"]
        )
    if "qos" in out:
        tables.append(headline(qos_load) + "\n\n" + out["qos"]["table"])
    text = "\n\n".join(tables)
    show_table(path, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
