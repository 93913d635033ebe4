"""A fleet on a Redis Cluster whose primary is lost (issue 66): two gateways on three
primaries with a replica each, and a primary SIGKILLed after it took claims its
replica never got, as asynchronous replication loses a primary's last writes. The
gateways had read those claims back (their subscribers and logs had the onlines);
after the failover each re-claims the sessions it holds, and the promoted replica,
lacking their records, takes the claims as new. Every session still goes online
exactly once: in its gateway's presence log, and at every subscriber. The same on
Redis Sentinel, a primary and one replica: the fleet's one presence stream."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.device_results import read_presence_log
from loadtest.redis_cluster import RedisClusterSet
from loadtest.redis_sentinel import SentinelSet
from loadtest.redis_server import RedisServer, ask
from servers.heartbeat.coordination.fleet.keys import FleetKeys
from servers.heartbeat.coordination.fleet.shards import hash_slot

from .redis_server import require_binary
from .test_fleet_faults import Gateway, get, kill_gateways, start_gateways
from .test_fleet_sentinel import metric
from .test_heartbeat_clients import raw_connect, subscriber
from .test_presence_faults import Got, heard, until

SHARDS = 6
"""Two shards on each primary (``redis-cli`` gives each a third of the slots)."""
PRESENCE = "$SYS/presence/"


def _watch(port0: int, port1: int, sockets: list[socket.socket]) -> tuple[Got, Got]:
    """A presence subscriber on each gateway."""
    watch0, got0 = subscriber(port0, "dashboard-0", PRESENCE + "#")
    watch1, got1 = subscriber(port1, "dashboard-1", PRESENCE + "#")
    sockets += [watch0, watch1]
    time.sleep(0.3)
    return got0, got1


def _connect(
    port0: int, port1: int, devices: list[str], subscribers: tuple[Got, ...], sockets: list[socket.socket]
) -> list[str]:
    """Connect ``devices``, alternating gateways; return them once every subscriber heard them online."""
    for i, device in enumerate(devices):
        sockets.append(raw_connect(port0 if i % 2 else port1, device, keep_alive=60))
    for got in subscribers:
        until(lambda g=got: heard(g, "online") >= set(devices), 15, "every subscriber heard them online")
    return devices


def _resynchronised(statuses: tuple[int, ...], changes: list[float]) -> None:
    """Wait until each gateway found Redis another server (its count past ``changes``) and is ok again."""
    for status, before in zip(statuses, changes, strict=True):
        until(lambda s=status, b=before: metric(s, "heartbeat_fleet_redis_server_changes_total") > b, 20, "change")
        until(lambda s=status: get(f"http://127.0.0.1:{s}/healthz")[1] == b"ok\n", 20, "healthz ok")


@pytest.fixture
def replicated_cluster() -> Iterator[RedisClusterSet]:
    require_binary()
    if shutil.which("redis-cli") is None and not Path("/usr/bin/redis-cli").exists() and os.environ.get("CI") != "true":
        pytest.skip("redis-cli is not installed (apt-get install redis-tools); CI installs it")
    group = RedisClusterSet(primaries=3, replicas=1)
    group.start()
    yield group
    group.stop()


def _onlines_in_stream(server: RedisServer, stream: str) -> list[tuple[float, str, str]]:
    """(when written, client id, epoch) of each online event in ``stream`` on ``server``,
    oldest first; when is the entry id's time (Redis's clock, seconds)."""
    onlines, written = [], 0.0
    for line in ask(server.port, "XRANGE", stream, "-", "+"):
        if re.fullmatch(r"\d+-\d+", line):
            written = int(line.split("-")[0]) / 1000
        elif line.startswith("{") and (event := json.loads(line))["status"] == "online":
            onlines.append((written, str(event["client_id"]), str(event["epoch"])))
    return onlines


def _report(
    twice: dict[str, list[tuple[str, str]]], batch: list[str], verbatim: set[tuple[str, str]], in_stream: Counter[str]
) -> str:
    """Which sessions went online more than once, and where: the batch's (their claims
    taken by the lost primary only) apart from the others; and how many onlines of each
    the promoted replica's streams hold (``in_stream``)."""
    every = {c for found in twice.values() for c, _ in found}
    lines = [
        f"sessions online more than once after the failover: {len(every & set(batch))} of the {len(batch)} "
        f"whose claims only the lost primary took, and {len(every - set(batch))} others "
        f"{sorted(every - set(batch))}; {len(verbatim)} logged twice word for word; the promoted replica's "
        f"streams hold {sum(in_stream[c] for c in batch)} onlines of the batch (written after the kill) and "
        f"{sum(n for c, n in in_stream.items() if c not in batch)} of the others (replicated)"
    ]
    for name, found in twice.items():
        if found:
            lines.append(f"{name} ({len(found)}): " + ", ".join(f"{c} {e}" for c, e in found))
    return "\n".join(lines)


def _stop_and_count_onlines(
    gateways: list[Gateway],
    tmp_path: Path,
    subscribers: dict[str, Got],
    healthy: set[str],
    batch: list[str],
    in_stream: Counter[str],
) -> None:
    """SIGTERM the gateways, then check that each session went online exactly once: in
    the log of the gateway that holds it, and at each subscriber (by the gateway it is
    on). No tolerance for copies, not even word-for-word ones."""
    for proc, *_ in gateways:
        proc.send_signal(signal.SIGTERM)
    for i, (proc, *_) in enumerate(gateways):
        assert proc.wait(timeout=20) == 0
        assert "redis is another server" in (tmp_path / f"gw{i}.stderr").read_text(), "no resynchronisation"
    where: dict[str, Counter[tuple[str, str]]] = {}
    verbatim: set[tuple[str, str]] = set()
    logged: set[str] = set()
    for i, (*_, log) in enumerate(gateways):
        onlines = [e for e in read_presence_log(log) or [] if e["status"] == "online"]
        where[f"gw{i}'s presence log"] = Counter((str(e["client_id"]), str(e["epoch"])) for e in onlines)
        logged |= {str(e["client_id"]) for e in onlines}
        copies = Counter(json.dumps(e, sort_keys=True) for e in onlines)
        verbatim |= {
            (str(e["client_id"]), str(e["epoch"])) for e in onlines if copies[json.dumps(e, sort_keys=True)] > 1
        }
    for name, got in subscribers.items():
        where[f"the subscriber on {name}"] = Counter(
            (t.removeprefix(PRESENCE), str(e["epoch"])) for t, e in list(got) if e["status"] == "online"
        )
    assert logged >= healthy, f"never logged online: {sorted(healthy - logged)}"
    twice = {name: sorted(s for s, n in counts.items() if n > 1) for name, counts in where.items()}
    if any(twice.values()):
        pytest.fail(_report(twice, batch, verbatim, in_stream))


@pytest.mark.slow
def test_a_session_goes_online_once_through_a_cluster_primarys_loss(
    replicated_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    cluster = replicated_cluster
    keys = FleetKeys("idlekeeper:", "gw0", shards=SHARDS)
    gateways = start_gateways(cluster.url + f"/?shards={SHARDS}", tmp_path, stderr=True)
    sockets: list[socket.socket] = []
    try:
        (_, port0, status0, _), (_, port1, status1, _) = gateways
        got0, got1 = _watch(port0, port1, sockets)
        earlier = _connect(port0, port1, [f"a-{i}" for i in range(24)], (got0, got1), sockets)

        # The primary to lose serves shards but not the hub, so the leases and filters
        # outlive it: what it takes with it is presence only.
        hub = cluster.owner_of(hash_slot(keys.members))
        victim = cluster.owner_of(hash_slot(keys.shards[-1].stream))
        assert victim is not hub, "the last shard's slot and the hub's are on different primaries"
        lost_shards = [s for s in keys.shards if cluster.owner_of(hash_slot(s.stream)) is victim]
        lost = {s.index for s in lost_shards}
        (replica,) = cluster.replicas_of(victim)
        assert int(ask(victim.port, "WAIT", "1", "2000")[0].lstrip(":")) == 1, "the earlier claims replicated"

        # The replica hangs and its link is cut: the victim's writes from now on are its own.
        cluster.pause(replica)
        assert cluster.cut_replicas(victim) == 1
        candidates = (f"late-{i}" for i in range(10_000))
        batch = [c for c in candidates if keys.shard(c).index in lost][:20]
        _connect(port0, port1, batch, (got0, got1), sockets)
        changes = [metric(s, "heartbeat_fleet_redis_server_changes_total") for s in (status0, status1)]

        killed = time.time()
        cluster.kill(victim)  # by PID
        cluster.resume(replica)
        promoted, took = cluster.wait_failover(hash_slot(lost_shards[0].stream), victim, timeout=20)
        assert promoted is replica and took < 15, (promoted.port, took)

        def stream_onlines() -> list[tuple[float, str, str]]:
            return [o for shard in lost_shards for o in _onlines_in_stream(replica, shard.stream)]

        # What the promoted replica has of the batch was written after the kill (a re-claim).
        kept = {c for when, c, _ in stream_onlines() if when < killed}
        assert not kept & set(batch), "the failover lost the batch's claims"

        # Both gateways find the promoted replica another server, re-claim what they hold
        # (the batch's claims are written again), and their readers read it.
        _resynchronised((status0, status1), changes)

        until(lambda: {c for _, c, _ in stream_onlines()} >= set(batch), 15, "the batch re-claimed on the replica")
        time.sleep(1.5)  # for both readers to read what the re-claims wrote
        in_stream = Counter(c for _, c, _ in stream_onlines())
        healthy = set(earlier) | set(batch)
        assert not (heard(got0, "offline") | heard(got1, "offline")) & healthy, "a healthy device went offline"

        _stop_and_count_onlines(gateways, tmp_path, {"gw0": got0, "gw1": got1}, healthy, batch, in_stream)
    finally:
        kill_gateways(gateways)
        for sock in sockets:
            sock.close()


@pytest.fixture
def one_replica_sentinels() -> Iterator[SentinelSet]:
    require_binary()
    # One replica: no min-replicas-to-write, so the primary takes writes it cannot pass on.
    group = SentinelSet(replicas=1, sentinels=3, quorum=2, down_after=1000)
    group.start()
    yield group
    group.stop()


@pytest.mark.slow
def test_a_session_goes_online_once_through_a_sentinel_failover_that_lost_writes(
    one_replica_sentinels: SentinelSet, tmp_path: Path
) -> None:
    sentinels = one_replica_sentinels
    stream = FleetKeys("idlekeeper:", "gw0").shards[0].stream
    gateways = start_gateways(sentinels.url, tmp_path, stderr=True)
    sockets: list[socket.socket] = []
    try:
        (_, port0, status0, _), (_, port1, status1, _) = gateways
        got0, got1 = _watch(port0, port1, sockets)
        earlier = _connect(port0, port1, [f"a-{i}" for i in range(12)], (got0, got1), sockets)
        old, (replica,) = sentinels.primary, sentinels.replicas
        assert int(ask(old.port, "WAIT", "1", "2000")[0].lstrip(":")) == 1, "the earlier claims replicated"

        # As on the cluster: the replica hangs, its link cut, and the primary takes claims alone.
        assert replica.pid is not None
        os.kill(replica.pid, signal.SIGSTOP)
        assert int(ask(old.port, "CLIENT", "KILL", "TYPE", "replica")[0].lstrip(":")) == 1
        batch = [f"late-{i}" for i in range(10)]
        _connect(port0, port1, batch, (got0, got1), sockets)
        changes = [metric(s, "heartbeat_fleet_redis_server_changes_total") for s in (status0, status1)]

        killed = time.time()
        old.kill()  # by PID
        sentinels.resume(replica)
        assert sentinels.wait_failover(old.port, timeout=20) < 15
        assert sentinels.primary_port() == replica.port
        kept = {c for when, c, _ in _onlines_in_stream(replica, stream) if when < killed}
        assert not kept & set(batch), "the failover lost the batch's claims"

        _resynchronised((status0, status1), changes)
        until(lambda: {c for _, c, _ in _onlines_in_stream(replica, stream)} >= set(batch), 15, "the batch re-claimed")
        time.sleep(1.5)  # for both readers to read what the re-claims wrote
        in_stream = Counter(c for _, c, _ in _onlines_in_stream(replica, stream))
        healthy = set(earlier) | set(batch)
        assert not (heard(got0, "offline") | heard(got1, "offline")) & healthy, "a healthy device went offline"

        _stop_and_count_onlines(gateways, tmp_path, {"gw0": got0, "gw1": got1}, healthy, batch, in_stream)
    finally:
        kill_gateways(gateways)
        for sock in sockets:
            sock.close()
