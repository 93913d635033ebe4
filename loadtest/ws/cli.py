"""``python -m loadtest ws``: WebSockets on our HTTP server beside uvicorn[standard] and
hypercorn, all serving the same ASGI app, and MQTT over WebSockets beside Mosquitto.

    python -m loadtest ws [--quick] [--only idle,echo,dead,slow,mqtt] [--targets ...]
        [--connections 2000] [--dead 100] [--json results/ws.json]

Servers (:mod:`loadtest.ws.targets`): ``idlekeeper`` (``servers.http``, dense engine),
``idlekeeper-streams`` (its streams engine), ``uvicorn-standard`` (httptools, uvloop,
``websockets``) and ``hypercorn`` (trio worker), each serving :mod:`loadtest.asgi_app`,
one process each, on a core of its own with the load on the others (``--no-pin``: not).

1. **idle**: ``--connections`` WebSockets opened and left alone; the server's RSS added
   per connection (:mod:`.idle`).
2. **echo**: ``--echo-clients`` clients each send a small message and wait for its echo,
   for ``--echo-duration`` s; every server in turn, ``--rounds`` times, as ``compare``
   measures HTTP; the median round is the figure (:mod:`.echo`).
3. **dead**: pings every ``--ping-interval`` s and a ``--ping-timeout`` s pong timeout
   for every server that has them; ``--dead`` peers that never read after the
   handshake and as many that answer every ping: the dead closed, from their last
   byte to the close, and the healthy closed (must be 0) (:mod:`.dead`).
4. **slow**: ``--slow-readers`` peers open ``/flood`` and stop reading: whether and when
   the server lets go of them, and its RSS per reader meanwhile (:mod:`.slow`).
5. **mqtt**: ``servers.heartbeat --ws-port`` beside Mosquitto's ``protocol websockets``
   listener: ``--mqtt-devices`` devices with a ``--mqtt-keepalive`` s keep-alive,
   ``--mqtt-silent`` of them going silent: close lateness past 1.5 x keep-alive, false
   expiries, and RSS per device (:mod:`.mqtt`).

Parts 1-2 share one start of each server (its defaults: pings every 20 s, none for
hypercorn); parts 3-5 start each afresh. Every loop is bounded in count and time, and
every process started is stopped by its PID. Ratios are to ours (``idlekeeper``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..http.loadgen import median_round, rounds_in_turn
from ..mqtt_targets import PeerUnavailable, mosquitto_binary
from ..options import add_json, add_quiet, add_targets, command_parser
from ..processes import CpuSplit, load_side, split_cpus, stop
from ..report import figure, skip_reason, write_json, write_table, written
from ..sampler import cpu_model
from .dead import dead_peers
from .echo import EchoFigures, run_echo
from .idle import idle_memory
from .mqtt import MQTT_WS_TARGETS, mosquitto_has_websockets, run_mqtt_devices, start_mqtt_ws_target
from .report import headlines, mqtt_table, ws_table
from .slow import slow_readers
from .targets import WS_TARGETS, Pings, WsServer, start_ws_target
from .workload import PARTS, WsLoad

__all__ = ["main", "run_mqtt", "run_ws"]

Say = Callable[[str], None]
_ERRORS = (RuntimeError, OSError, ValueError)


def _started(
    names: Sequence[str], pings: Pings, load: WsLoad, split: CpuSplit | None, missing: dict[str, str], say: Say
) -> dict[str, WsServer]:
    """Each server of ``names`` started (those that would not, in ``missing``)."""
    out: dict[str, WsServer] = {}
    for name in names:
        try:
            out[name] = start_ws_target(name, pings, load.timeout, split)
        except _ERRORS as exc:
            missing[name] = skip_reason(exc)
            say(f"   {name}: not started: {missing[name]}")
    return out


def run_ws(
    load: WsLoad, targets: Sequence[str], parts: Sequence[str], pinned: bool = True, say: Say = print
) -> dict[str, Any]:
    """The WebSocket parts of ``parts`` against each of ``targets``: every figure by server."""
    split = split_cpus() if pinned else None
    runs: dict[str, dict[str, Any]] = {name: {} for name in targets}
    missing: dict[str, str] = {}
    if "idle" in parts or "echo" in parts:
        say("\n== ws: idle and echo (the servers' default pings) ==")
        servers = _started(targets, Pings(), load, split, missing, say)
        try:
            with load_side(split):
                for name, server in servers.items() if "idle" in parts else ():
                    idle = idle_memory(server.port, server.pids, load.connections)
                    runs[name]["idle"] = dataclasses.asdict(idle)
                    say(
                        f"   {name:<20} {idle.connections:,} idle ({idle.errors} failed): "
                        f"{figure(idle.per_connection, ',.0f', ' B')} of RSS each"
                    )
                if "echo" in parts:

                    def echo(name: str) -> EchoFigures:
                        return run_echo(servers[name].port, load.echo_clients, load.echo_duration, load.echo_size)

                    rounds = rounds_in_turn(list(servers), load.rounds, echo, "ws: echo", unit="msg/s")
                    for name, figures in rounds.items():
                        runs[name]["echo"] = dataclasses.asdict(median_round(figures))
                        runs[name]["echo_rounds"] = [dataclasses.asdict(f) for f in figures]
        finally:
            for server in servers.values():
                stop(server.proc)
    for part in ("dead", "slow"):
        if part not in parts:
            continue
        pings = Pings(load.ping_interval, load.ping_timeout) if part == "dead" else Pings()
        say(f"\n== ws: {part} ==")
        for name in targets:
            if name in missing:
                continue
            servers = _started([name], pings, load, split, missing, say)
            if name not in servers:
                continue
            server = servers[name]
            try:
                with load_side(split):
                    if part == "dead":
                        dead = dead_peers(server.port, load.dead, load.dead, load.dead_window)
                        runs[name]["dead"] = dataclasses.asdict(dead)
                        say(
                            f"   {name:<20} closed {dead.dead_closed}/{dead.dead} dead peers "
                            f"(p50 {figure(dead.close_p50_s, '.2f', ' s')}, "
                            f"max {figure(dead.close_max_s, '.2f', ' s')} after their last byte), "
                            f"{dead.healthy_closed}/{dead.healthy} healthy"
                        )
                    else:
                        slow = slow_readers(server.port, server.pids, load.slow_readers, load.slow_window)
                        runs[name]["slow"] = dataclasses.asdict(slow)
                        say(
                            f"   {name:<20} cut {slow.cut}/{slow.readers} slow readers "
                            f"(p50 {figure(slow.cut_p50_s, '.2f', ' s')}), "
                            f"peak {figure(slow.per_reader / 1024, ',.0f', ' KiB')} of RSS each"
                        )
            finally:
                stop(server.proc)
    for name in missing:
        runs.pop(name, None)
    return {"runs": runs, "missing": missing, "cpus": "" if split is None else repr(split)}


def run_mqtt(load: WsLoad, targets: Sequence[str], pinned: bool = True, say: Say = print) -> dict[str, Any]:
    """The MQTT-over-WebSocket devices against each of ``targets``, one at a time."""
    split = split_cpus() if pinned else None
    runs: dict[str, dict[str, Any]] = {}
    missing: dict[str, str] = {}
    say("\n== ws: MQTT devices over WebSockets ==")
    for name in targets:
        if name == "mosquitto" and not mosquitto_has_websockets(mosquitto_binary()):
            missing[name] = "this Mosquitto was built without WebSockets (libwebsockets)"
            continue
        try:
            server = start_mqtt_ws_target(name, load.tick, split)
        except (PeerUnavailable, *_ERRORS) as exc:
            missing[name] = skip_reason(exc)
            say(f"   {name}: not started: {missing[name]}")
            continue
        try:
            with load_side(split):
                r = run_mqtt_devices(server.ws_port, server.pids(), load.mqtt)
        finally:
            server.stop()
        runs[name] = r
        late = r["lateness_ms"]
        say(
            f"   {name:<20} {r['connected']}/{r['devices']} connected, {r['detected']}/{r['silent']} silent closed "
            f"(lateness p50 {figure(late.get('p50'), '.0f')} / max {figure(late.get('max'), '.0f')} ms), "
            f"{r['false_expiries']} false; "
            f"{figure(r['steady']['rss_per_device_bytes'], ',.0f', ' B')} of RSS per device"
            + (f"; {r['generator_late']} closed after the client itself pinged late" if r["generator_late"] else "")
        )
    return {"runs": runs, "missing": missing}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest ws``; exit 1 if our server could not be measured."""
    p = command_parser("python -m loadtest ws", __doc__)
    a = p.add_argument
    a("--quick", action="store_true", help="a small, short run (about two minutes): the --quick defaults below")
    a("--only", default=",".join(PARTS), help=f"comma-separated parts to run (default: {','.join(PARTS)})")
    add_targets(p, WS_TARGETS)
    add_targets(p, MQTT_WS_TARGETS, prefix="mqtt-")
    a("--no-pin", action="store_true", help="let the servers and the load share every CPU")
    WsLoad.add_arguments(p)
    add_json(p, None, table=True)
    add_quiet(p, live=False)
    args = p.parse_args(argv)
    parts = [part for part in args.only.split(",") if part]
    if not parts or set(parts) - set(PARTS):
        p.error(f"--only takes parts of {','.join(PARTS)}")
    try:
        load = WsLoad.from_args(args, quick=args.quick)
    except ValueError as exc:
        p.error(str(exc))
    say: Say = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    started = time.time()
    out: dict[str, Any] = {"load": dataclasses.asdict(load), "machine": cpu_model(), "started": started}
    tables = []
    ws_head, mqtt_head = headlines(load, not args.no_pin, parts)
    ws_parts = [part for part in parts if part != "mqtt"]
    if ws_parts:
        out["ws"] = run_ws(load, args.targets.split(","), ws_parts, pinned=not args.no_pin, say=say)
        tables.append(ws_head + "\n\n" + ws_table(out["ws"]["runs"], out["ws"]["missing"], ws_parts))
    if "mqtt" in parts:
        out["mqtt"] = run_mqtt(load, args.mqtt_targets.split(","), pinned=not args.no_pin, say=say)
        tables.append(mqtt_head + "\n\n" + mqtt_table(out["mqtt"]["runs"], out["mqtt"]["missing"]))
    text = "\n\n".join(tables)
    print("\n" + text)
    if args.json:
        path = write_json(args.json, out)
        print("\n" + written([path, write_table(path, text)]))
    asked = [key for key in ("ws", "mqtt") if key in out]
    ours_missing = any("idlekeeper" in out[key]["missing"] for key in asked)
    return 1 if ours_missing else 0


if __name__ == "__main__":
    sys.exit(main())
