"""``python -m loadtest fleet``: a fleet of heartbeat gateways sharing presence through Redis.

    python -m loadtest fleet --nodes 3 --devices 30000 --keepalive 10 --kill-node --redis-restart

It starts a throwaway ``redis-server`` on a loopback port (no persistence), then
``--nodes`` gateways, each ``servers.heartbeat --cluster redis://...`` on a port of
its own with enough workers for its share (each worker is a fleet node), a
presence log and status ports; then the generator processes, whose devices each
connect to a gateway at random. The run has phases:

1. **connect, settle**: devices ramp up at ``--rate`` and ping every keep-alive K;
2. **act** (K/2): ``--silent`` devices go silent; half the ``--reconnect`` devices
   reconnect with the same client id to *another* gateway (a cross-node takeover);
3. **detect**: 1.5 K, until every silent device is due;
4. **kill** (``--kill-node``): one gateway's workers and supervisor are SIGKILLed; its
   devices, seeing their connection end, reconnect to another gateway after a
   device's back-off (``--failover-delay``), and its sessions must end once each:
   ``node-lost`` (swept by a survivor when its lease lapses) or ``takeover``;
5. **Redis restart** (``--redis-restart``): redis-server is SIGTERMed for
   ``--outage`` seconds and started again, empty, on the same port; or a
   **failover** (``--failover``): the primary (``--sentinel``), or the primary serving
   the most presence shards (``--redis-cluster``), is SIGKILLed and a replica promoted;
6. **second wave**: the other half of the reconnects, after the faults;
7. **end**: the generators close every connection; the gateways are SIGTERMed.

A reader consumes the presence stream from id 0 throughout (through the restart)
and the gateways' presence logs are read at the end. Judged: every session has
exactly one offline event (none **lost**, none **duplicated**), no healthy device
dropped (**false expiries**), every silent device found, every session of the
killed gateway ended (and when), the cross-node takeover latency as the device sees
it (new CONNACK to the old connection's close). Measured too: Redis ops/s and RSS,
each gateway's RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from servers.heartbeat.coordination.fleet.keys import FleetKeys
from servers.heartbeat.coordination.fleet.shards import hash_slot

from ..device_results import read_presence_log
from ..generator.pool import GeneratorPool
from ..live import Live, run_progress
from ..options import (
    add_devices,
    add_json,
    add_keepalive,
    add_protocol,
    add_quiet,
    add_rate,
    add_seed,
    add_silent,
    add_tick,
    command_parser,
    fields_from,
)
from ..processes import stop
from ..redis_cluster import RedisClusterSet
from ..redis_sentinel import SentinelSet
from ..redis_server import RedisServer
from ..report import plural, write_json, written
from ..workload import generator_count
from .gateways import Gateway, start_gateways
from .load import FleetLoad, fleet_specs, plan_fleet
from .redis import KEY_PREFIX, ClusterPresenceReader, PresenceReader, stream_length
from .results import merge_fleet, passed, report

__all__ = ["load_from", "main", "parser", "run_fleet"]

_LOAD_FLAGS = (
    "nodes",
    "devices",
    "workers_per_node",
    "keepalive",
    "silent",
    "reconnect",
    "rate",
    "kill_node",
    "redis_restart",
    "outage",
    "sentinel",
    "failover",
    "redis_cluster",
    "shards",
    "migrate",
    "tick",
    "lease",
    "seed",
    "protocol",
)
"""The flags that make a :class:`~loadtest.fleet.load.FleetLoad` as they are (``--failover-delay`` is a pair)."""


def run_fleet(
    load: FleetLoad, *, show: Callable[[dict[str, Any]], None] | None = None, keep_failed: bool = False
) -> dict[str, Any]:
    """Run the fleet load test; return the merged results. ``keep_failed``: a failed run
    keeps its scratch directory (presence logs, the stream read, generator results)."""
    workdir = Path(tempfile.mkdtemp(prefix="ik-fleet-"))
    group = SentinelSet(replicas=2, sentinels=3, quorum=2, down_after=2000) if load.sentinel else None
    cluster = RedisClusterSet(primaries=3, replicas=int(load.failover)) if load.redis_cluster else None
    redis = RedisServer() if group is None else group.primary
    if cluster is not None:
        cluster.start()
        url = f"{cluster.url}/?shards={load.shards}"
    elif group is None:
        redis.start()
        url = redis.url
    else:
        group.start()
        url = group.url
    servers = [redis] if group is None and cluster is None else (group or cluster).servers  # type: ignore[union-attr]
    fault: threading.Thread | None = None  # a slot migration, or a wait for a promotion

    def primary() -> int:
        """Where the primary is now (a failover moves it)."""
        found = None if group is None else group.primary_port()
        return redis.port if found is None else found

    gateways: list[Gateway] = []
    reader: PresenceReader | None = None
    pool: GeneratorPool | None = None
    drained_s = math.nan
    kill: dict[str, Any] = {}
    outage: dict[str, float] = {}
    redis_rss: list[tuple[float, int]] = []
    online_at_settle: dict[str, float] = {}
    try:
        gateways = start_gateways(load, url, workdir)
        if cluster is not None:
            streams = [shard.stream for shard in FleetKeys(KEY_PREFIX, "-", load.shards).shards]
            reader = ClusterPresenceReader([server.port for server in cluster.servers], streams).start()
        else:
            reader = PresenceReader(primary).start()
        timeline = plan_fleet(load, generator_count(load.device_load()))
        gen_specs = fleet_specs(load, timeline, [g.port for g in gateways], workdir)
        pool = GeneratorPool(gen_specs, workdir)
        victim = gateways[-1]
        deadline = timeline.end + 60 + load.devices / 1000
        next_sample = 0.0
        while pool.running() and time.monotonic() < deadline:
            now = time.monotonic()
            if timeline.kill is not None and not kill and now >= timeline.kill:
                kill["wall"] = time.time()
                kill["mono"] = time.monotonic()
                kill["pids"] = victim.kill()
                kill["gateway"] = victim.name
                kill["port"] = victim.port
            fault_due = timeline.redis_down is not None and now >= timeline.redis_down
            if cluster is not None and fault_due and fault is None:
                if load.failover:
                    fault = start_cluster_failover(cluster, load.shards, reader, outage)
                else:
                    fault = start_migration(cluster, load.shards, outage)
            elif cluster is None and fault_due and "down" not in outage:
                # What the old Redis holds and what the reader has of it: the difference
                # is what nobody reading the stream will see.
                outage["stream_length"] = stream_length(primary())
                outage["read"] = reader.count()
                outage["down"] = time.monotonic()
                if group is not None:
                    outage["old_port"] = group.kill_primary().port  # SIGKILL: the machine is gone
                else:
                    redis.stop()
            if timeline.redis_up is not None and "up" not in outage and now >= timeline.redis_up:
                redis.restart()
                outage["up"] = time.monotonic()
            if group is not None and "old_port" in outage and "up" not in outage and primary() != outage["old_port"]:
                outage["up"] = time.monotonic()  # the Sentinels name the promoted replica
            if now >= next_sample:
                next_sample = now + 1.0
                for gw in gateways:
                    gw.sample_rss(now)
                with contextlib.suppress(psutil.Error):
                    pids = [s.pid for s in servers if s.pid is not None]
                    if pids:
                        redis_rss.append((now, sum(psutil.Process(pid).memory_info().rss for pid in pids)))
                if not online_at_settle and now >= timeline.acts - 1.5:
                    online_at_settle = {gw.name: gw.online() for gw in gateways}
            if show is not None:
                rss = sum(g.rss[-1][1] for g in gateways if g.rss and g.killed_at is None)
                show(
                    run_progress(
                        timeline,
                        now,
                        load.devices,
                        load.silent,
                        pool.totals(),
                        server_online=math.nan,
                        rss_mb=rss / 1e6,
                        fds=math.nan,
                    )
                )
            time.sleep(0.25)
        pool.stop()
        # Every connection is closed now. A gateway's SIGTERM waits a few seconds for its
        # coordinator's queue, so let the backlog of offline reports reach Redis first
        # (bounded): what is judged is the fleet's bookkeeping, not the grace period.
        drain_started = time.monotonic()
        while time.monotonic() - drain_started < 120:
            if all(gw.killed_at is not None or gw.queued() == 0 for gw in gateways):
                break
            time.sleep(0.5)
        drained_s = time.monotonic() - drain_started
        for gw in gateways:
            if gw.killed_at is None:
                began = time.monotonic()
                gw.exit_code = stop(gw.proc, timeout=60)
                gw.stop_s = time.monotonic() - began
        reader.wait_quiet(quiet=3.0, limit=60.0)
    finally:
        if pool is not None:
            pool.stop()
        for gw in gateways:
            stop(gw.proc, timeout=10)
        if reader is not None:
            reader.stop()
        if fault is not None:
            fault.join(120)
        if cluster is not None:
            cluster.stop()
        elif group is None:
            redis.stop()
        else:
            group.stop()
    results = pool.results()
    logs = [e for gw in gateways for e in read_presence_log(gw.log) or []]
    merged = merge_fleet(load, timeline, results, reader, logs, gateways, kill, outage, redis_rss, online_at_settle)
    merged["queues_drained_s"] = drained_s
    if passed(merged) or not keep_failed:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        # What a failed run leaves to look into: the presence logs and the generators' results.
        merged["workdir"] = str(workdir)
        (workdir / "stream.jsonl").write_text(
            "".join(json.dumps([e.incarnation, e.origin, e.event]) + "\n" for e in reader.events)
        )
    return merged


def start_migration(cluster: RedisClusterSet, shards: int, outage: dict[str, Any]) -> threading.Thread:
    """Move every third shard's slot and the hub's to the next primary, a few keys at a
    time, on a thread; ``outage`` gets when it began and ended and how many keys moved."""
    keys = FleetKeys(KEY_PREFIX, "-", shards)
    slots = [hash_slot(shard.stream) for shard in keys.shards[::3]] + [hash_slot(keys.members)]
    outage.update(down=time.monotonic(), migrated_slots=len(slots), migrated_keys=0)

    def move() -> None:
        for slot in slots:
            outage["migrated_keys"] += cluster.migrate_slot(slot, batch=100, pause=0.005)
        outage["up"] = time.monotonic()

    thread = threading.Thread(target=move, name="slot-migration", daemon=True)
    thread.start()
    return thread


def start_cluster_failover(
    cluster: RedisClusterSet, shards: int, reader: PresenceReader, outage: dict[str, Any]
) -> threading.Thread:
    """SIGKILL (by its PID) the primary serving the most presence shards, not the hub's if
    another serves any, so that what is lost is presence; wait on a thread until the
    cluster is ok with its replica serving them. ``outage`` gets when it was killed, what
    its shards' streams held and the reader had of them, and when the replica took over."""
    keys = FleetKeys(KEY_PREFIX, "-", shards)
    victim = cluster.busiest([hash_slot(s.stream) for s in keys.shards], spare=hash_slot(keys.members))
    held = cluster.slots_of(victim)
    lost = [s.stream for s in keys.shards if any(low <= hash_slot(s.stream) <= high for low, high in held)]
    # What it holds and what the reader has of it: the difference is what nobody
    # reading the streams will see.
    outage["stream_length"] = sum(stream_length(victim.port, stream=stream) for stream in lost)
    outage["read"] = reader.count(lost)
    outage.update(lost_shards=len(lost), old_port=victim.port, down=time.monotonic())
    cluster.kill(victim)

    def wait() -> None:
        with contextlib.suppress(RuntimeError):  # none promoted in time: the report says so
            promoted, _ = cluster.wait_failover(hash_slot(lost[0]), victim, timeout=30.0)
            outage.update(up=time.monotonic(), new_port=promoted.port)

    thread = threading.Thread(target=wait, name="cluster-failover", daemon=True)
    thread.start()
    return thread


def parser(prog: str = "python -m loadtest fleet") -> argparse.ArgumentParser:
    """The command line."""
    d = FleetLoad()
    p = command_parser(prog, __doc__)
    a = p.add_argument
    a("--nodes", type=int, default=d.nodes, help=f"gateways (default: {d.nodes})")
    add_devices(p, d.devices)
    a("--workers-per-node", type=int, default=None, help="workers per gateway (default: enough for its share)")
    add_keepalive(p, d.keepalive)
    add_silent(p, d.silent)
    add_protocol(p, d.protocol)
    a("--reconnect", type=float, default=d.reconnect, help=f"share that reconnect elsewhere (default: {d.reconnect})")
    add_rate(p, d.rate)
    a("--kill-node", action="store_true", help="SIGKILL one gateway (supervisor and workers) mid-run")
    a("--redis-restart", action="store_true", help="stop redis-server mid-run and start it again, empty")
    a("--outage", type=float, default=d.outage, help=f"seconds Redis stays down (default: {d.outage})")
    a(
        "--sentinel",
        action="store_true",
        help="Redis as a primary, two replicas and three Sentinels (redis-server --sentinel); the gateways are "
        "given redis+sentinel://...",
    )
    a(
        "--failover",
        action="store_true",
        help="with --sentinel: SIGKILL the primary mid-run (a replica is promoted); with --redis-cluster: each "
        "primary gets a replica, and the one serving the most presence shards is SIGKILLed mid-run",
    )
    a(
        "--redis-cluster",
        action="store_true",
        help="Redis as a Redis Cluster of three primaries (a replica each with --failover); the gateways are "
        "given redis+cluster://...",
    )
    a("--shards", type=int, default=d.shards, help=f"with --redis-cluster: presence shards (default: {d.shards})")
    a(
        "--migrate",
        action="store_true",
        help="with --redis-cluster: move a third of the shards' slots and the hub's to another primary mid-run",
    )
    a(
        "--failover-delay",
        type=float,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="a device's back-off before reconnecting elsewhere, uniform (default: 0.5 K)",
    )
    add_tick(p, d.tick, "gateway keeper")
    a("--lease", type=float, default=d.lease, help=f"the gateways' --lease in seconds (default: {d.lease:g})")
    add_json(p, None)
    add_quiet(p)
    add_seed(p, d.seed)
    return p


def load_from(args: argparse.Namespace) -> FleetLoad:
    """The workload from parsed arguments."""
    delay = None if args.failover_delay is None else (args.failover_delay[0], args.failover_delay[1])
    return FleetLoad(**fields_from(args, _LOAD_FLAGS), failover_delay=delay)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest fleet``: run, print the report, write the JSON; 0 if it passed."""
    args = parser().parse_args(argv)
    load = load_from(args)
    if load.kill_node and load.nodes < 2:
        print("--kill-node needs at least 2 gateways", flush=True)
        return 2
    if load.failover and (not (load.sentinel or load.redis_cluster) or load.redis_restart or load.migrate):
        print(
            "--failover needs --sentinel or --redis-cluster, and neither --redis-restart (the primary is killed, "
            "not restarted) nor --migrate (one fault to Redis a run)",
            flush=True,
        )
        return 2
    if load.migrate and not load.redis_cluster:
        print("--migrate needs --redis-cluster", flush=True)
        return 2
    if load.redis_cluster and (load.sentinel or load.redis_restart):
        print("--redis-cluster goes with neither --sentinel nor --redis-restart", flush=True)
        return 2
    if not args.quiet:
        print(
            f"starting redis-server and {plural(load.nodes, 'gateway')} x {plural(load.workers(), 'worker')} "
            f"for {load.devices:,} devices ...",
            flush=True,
        )
    with Live(enabled=not args.quiet) as live:
        result = run_fleet(load, show=live.update, keep_failed=True)
    print(report(result))
    if args.json:
        print(written([write_json(args.json, result)]))
    return 0 if passed(result) else 1
