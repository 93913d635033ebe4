"""``python -m loadtest qos``: QoS 1 throughput and memory per queued message, ours beside Mosquitto.

    python -m loadtest qos [--publishers 4] [--duration 10] [--queued 50000] [--targets idlekeeper,mosquitto,...]

**Throughput**: P publisher connections publish QoS 1 messages to ``bench/<n>``, each
keeping at most ``--window`` PUBLISHes unacknowledged by the server; one subscriber
on ``bench/#`` at QoS 1 acknowledges every delivery. Every payload carries its
publisher, its sequence number and its send time, so the subscriber counts each
message (exactly once: no loss, no duplicate), its order per publisher, and its
publish-to-deliver latency. The rate is counted at the subscriber after a warm-up.
Publishers also wait while ``--outstanding`` messages (by default P x window) are
published and not yet delivered: a broker acknowledges a PUBLISH on receipt, so
publishers faster than the subscriber would fill its queue (1,000 at both
brokers) and messages would be dropped by design. The cap keeps the run closed-loop
and loss-free, and bounds what can wait in the server: the latency is that of a
saturated server with at most that many messages in it (Little's law: cap =
rate x latency). A larger cap lets a server that takes PUBLISHes faster than it
delivers them build a queue, and the latency grows with it.

All clients run in this one process: raw non-blocking sockets on one ``epoll``,
packets framed with :mod:`servers.heartbeat.mqtt.encoders`, several packets per read
and one write per batch of acknowledgements. Its CPU over the measured window is
reported beside the server's: a client near 100% of a core is the bottleneck, and
the rate is then a lower bound for that target.

**Queued messages**: a persistent session (CleanSession=0) subscribes to ``q/#`` at
QoS 1 and disconnects; N QoS 1 messages are published while it is away, and the
server's RSS (psutil, every process) before and after gives bytes per queued
message. The client then reconnects with CleanSession=0, must see session-present
1, and must receive all N, in order, exactly once.

Targets: ``idlekeeper`` is ``servers.heartbeat`` on its dense engine, with
``--workers 1`` (``--workers N`` to measure N, whose persistent sessions live in the
supervisor); ``idlekeeper-fleet`` is the same server as a one-gateway fleet
(``--cluster``) on a ``redis-server`` of its own, started on a free loopback port and
stopped with it, so its persistent sessions and their queues live in Redis (not in the
default targets: it needs Debian's ``redis-server``); ``mosquitto`` is the Debian
broker with a minimal configuration (``max_inflight_messages 20``,
``max_queued_messages`` 1,000, or N for the queued part). Each part gets a fresh
server, so the RSS baseline is a clean one.

Mosquitto 2.0.11 (Debian's, and the version measured here) reorders QoS 1 messages
once some wait in its queue behind a full in-flight window: a new message is sent
as soon as the window has room (``db__ready_for_flight`` checks the quota, not the
queue), ahead of those queued; with several publishers, some queued ones were still
unsent seconds after the last publish. The run reports them as out of order and
lost rather than hiding them, and since they count as undelivered, they also eat
into ``--outstanding``. ``mosquitto-inflight0`` is the same broker with
``max_inflight_messages 0`` (no bound, so a connected subscriber's messages never
queue): it delivers exactly once and in order, and gives a throughput untouched by
the defect. Later releases reworked the in-flight quota code; only the installed
2.0.11 is measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

from ..mqtt_targets import MqttTarget, PeerUnavailable, start_mosquitto
from ..options import add_json, add_quiet, add_targets, command_parser
from ..processes import free_port, start_heartbeat
from ..redis_server import redis_server_binary, running_redis
from ..report import show_table, skip_reason, write_json
from .load import QosLoad
from .queued import run_queued
from .report import describe, headline, qos_row, qos_table
from .throughput import run_throughput

__all__ = ["PARTS", "QOS_TARGETS", "main", "run_qos", "start_qos_target"]

QOS_TARGETS = ("idlekeeper", "mosquitto", "mosquitto-inflight0")
FLEET = "idlekeeper-fleet"
"""Ours as a one-gateway fleet on a redis-server of its own (asked for by name only)."""
PARTS = ("throughput", "queued")


def start_qos_target(
    name: str,
    queued: int,
    inflight: int = 20,
    queued_bytes: int = 0,
    workers: int = 1,
    redis_url: str | None = None,
) -> MqttTarget:
    """Start ``name`` on a free loopback port with ``queued`` messages allowed per client
    and ``inflight`` in flight to each (``mosquitto-inflight0``: no in-flight bound).

    ``queued_bytes`` is our server's per-client byte bound (0: our default of 16 MiB);
    Mosquitto's ``max_queued_bytes`` is left unbounded, as it is by default.
    ``workers``: our server's worker processes (Mosquitto has one).
    """
    port = free_port()
    if name in ("idlekeeper", FLEET):
        extra = ["--engine", "dense", "--max-inflight", str(inflight), "--max-queued", str(queued)]
        if queued_bytes:
            extra += ["--max-queued-bytes", str(queued_bytes)]
        if name == FLEET:
            if redis_url is None:
                raise PeerUnavailable(f"{FLEET} needs a Redis (its redis_url)")
            extra += ["--cluster", redis_url, "--node", "qos-gw0"]
        return MqttTarget(name, start_heartbeat(port, workers, extra), port)
    if name not in ("mosquitto", "mosquitto-inflight0"):
        raise PeerUnavailable(f"unknown QoS target {name!r} (known: {', '.join((*QOS_TARGETS, FLEET))})")
    if name == "mosquitto-inflight0":
        # 0 is "no maximum": a connected subscriber's messages never wait in Mosquitto's
        # queue, whose 2.0.11 code reorders and strands QoS 1 messages (see the module doc).
        inflight = 0
    return start_mosquitto(name, port, f"max_inflight_messages {inflight}\nmax_queued_messages {queued}\n")


@contextlib.contextmanager
def _target(name: str, queued: int, inflight: int, queued_bytes: int = 0, workers: int = 1) -> Iterator[MqttTarget]:
    with contextlib.ExitStack() as stack:
        redis_url = None
        if name == FLEET:
            if redis_server_binary() is None:
                raise PeerUnavailable("redis-server is not installed (apt-get install redis-server)")
            redis_url = stack.enter_context(running_redis()).url
        started = start_qos_target(name, queued, inflight, queued_bytes, workers, redis_url)
        stack.callback(started.stop)
        yield started


def run_qos(
    load: QosLoad, targets: Sequence[str] = QOS_TARGETS, parts: Sequence[str] = PARTS, quiet: bool = False
) -> dict[str, Any]:
    """Both parts against each target in turn; runs, table rows, targets not run, and the table."""
    runs: dict[str, dict[str, Any]] = {}
    missing: dict[str, str] = {}
    # Room for every queued message's topic and payload, whatever the payload size.
    queued_bytes = max(16 * 1024 * 1024, 2 * load.queued * (load.payload + 8))
    for name in targets:
        run: dict[str, Any] = {}
        try:
            if "throughput" in parts:
                print(f"\n== qos throughput: {name} ==", flush=True)
                with _target(name, load.max_queued, load.inflight, workers=load.workers) as t:
                    show = None if quiet else (lambda line: print(line, flush=True))
                    run["throughput"] = run_throughput(t.port, t.pids(), load, tag=name, show=show)
            if "queued" in parts:
                print(f"\n== qos queued: {name} ==", flush=True)
                with _target(name, max(load.queued, load.max_queued), load.inflight, queued_bytes, load.workers) as t:
                    run["queued"] = run_queued(t.port, t.pids(), load, tag=name)
        except (RuntimeError, OSError) as exc:
            # One target that cannot run (or fails on the way) leaves the others' figures.
            missing[name] = skip_reason(exc)
            print(f"   skipped: {exc}", flush=True)
            continue
        run["target"] = name
        print(describe(run), flush=True)
        runs[name] = run
    rows = {name: qos_row(r) for name, r in runs.items()}
    return {"load": asdict(load), "runs": runs, "rows": rows, "missing": missing, "table": qos_table(rows, missing)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest qos``; exit 0 only if our server delivered exactly once (and in order when
    queued). A peer's failures are reported, not fatal: the run measures them."""
    p = command_parser("python -m loadtest qos", __doc__)
    add_targets(p, QOS_TARGETS)
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: throughput, queued (default: both)")
    QosLoad.add_arguments(p)
    add_json(p, "results/qos.json", table=True)
    add_quiet(p, live=False)
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        p.error(f"--parts: choose from {', '.join(PARTS)}")
    try:
        load = QosLoad.from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    out = run_qos(load, args.targets.split(","), parts, args.quiet)
    path = write_json(args.json, out)
    text = headline(load) + "\n\n" + out["table"]
    show_table(path, text)
    if not out["runs"] or any(name in out["missing"] for name in ("idlekeeper", FLEET)):
        return 1
    for name in ("idlekeeper", FLEET):
        ours = out["runs"].get(name, {})
        if not (ours.get("throughput", {}).get("exactly_once", True) and ours.get("queued", {}).get("ok", True)):
            return 1
    return 0
