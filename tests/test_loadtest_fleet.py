"""The fleet load test: its judging of the presence feed (pure), and a CI-sized run of
real gateways on a real redis-server (3 gateways, 600 devices, a killed gateway,
a Redis restart): no event lost or duplicated, no false expiry, every session of
the killed gateway ended, cross-node takeovers fast. On Redis Cluster: which primary
a failover kills, and the stream reader's view of who serves a shard, through a
real primary's loss."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from coredis.response.types import ClusterNodeDetail

from loadtest.fleet import run_fleet
from loadtest.fleet.cli import load_from, parser
from loadtest.fleet.judge import classify_drops, judge_sessions, killed_node_view, node_of, sessions_of
from loadtest.fleet.load import FleetLoad, fleet_specs, plan_fleet
from loadtest.fleet.redis import KEY_PREFIX, ClusterPresenceReader, slot_owners
from loadtest.fleet.results import passed, report
from loadtest.redis_cluster import ClusterNode, RedisClusterSet, busiest_primary
from loadtest.redis_server import ask, redis_server_binary
from servers.heartbeat.coordination.fleet.keys import FleetKeys
from servers.heartbeat.coordination.fleet.shards import hash_slot


def _ev(status: str, epoch: str, reason: str | None = None, node: str = "gw0/w0/1", t: float = 100.0) -> dict[str, Any]:
    return {"status": status, "epoch": epoch, "client_id": f"dev-{epoch}", "reason": reason, "node": node, "time": t}


def test_a_session_without_offline_is_lost_and_one_with_two_is_duplicated() -> None:
    stream = [
        (0, _ev("online", "a")),
        (0, _ev("offline", "a", "connection-lost")),
        (0, _ev("online", "b")),  # never ends: lost
        (0, _ev("online", "c")),
        (0, _ev("offline", "c", "takeover")),
        (0, _ev("offline", "c", "connection-lost")),  # ended twice: duplicated
    ]
    verdict = judge_sessions(sessions_of(stream, []))
    assert verdict["sessions"] == 3
    assert verdict["lost"] == 1 and verdict["lost_examples"][0][0] == "b"
    assert verdict["duplicated"] == 1 and verdict["duplicated_examples"][0][0] == "c"
    assert verdict["offline_by_reason"] == {"connection-lost": 1, "takeover": 1}


def test_the_logs_fill_what_the_stream_reader_missed_and_count_duplicates_too() -> None:
    # Redis died before the reader saw a's offline; the node's log has it.
    stream = [(0, _ev("online", "a")), (0, _ev("online", "b")), (0, _ev("offline", "b", "keepalive-timeout"))]
    logs = [_ev("online", "a"), _ev("offline", "a", "disconnect"), _ev("offline", "b", "keepalive-timeout")]
    verdict = judge_sessions(sessions_of(stream, logs))
    assert verdict["lost"] == 0 and verdict["duplicated"] == 0
    assert verdict["offline_seen_in_logs_only"] == 1
    twice_logged = [*logs, _ev("offline", "a", "disconnect", t=101.0)]
    assert judge_sessions(sessions_of(stream, twice_logged))["duplicated"] == 1


def test_online_again_after_a_redis_restart_is_a_reannouncement_not_a_duplicate() -> None:
    stream = [(0, _ev("online", "a")), (1, _ev("online", "a")), (1, _ev("offline", "a", "connection-lost"))]
    verdict = judge_sessions(sessions_of(stream, []))
    assert verdict["online_duplicated"] == 0 and verdict["reannounced_after_restart"] == 1
    same_run = [(0, _ev("online", "a")), (0, _ev("online", "a")), (0, _ev("offline", "a", "connection-lost"))]
    assert judge_sessions(sessions_of(same_run, []))["online_duplicated"] == 1


def test_events_without_an_epoch_are_no_session() -> None:
    verdict = judge_sessions(sessions_of([(0, {"status": "offline", "reason": "connect-timeout"})], []))
    assert verdict["sessions"] == 0 and verdict["lost"] == 0


def test_a_killed_gateways_sessions_are_accounted_for() -> None:
    kill = 200.0
    stream = [
        (0, _ev("online", "before", node="gw2/w0/9")),
        (0, _ev("offline", "before", "connection-lost", node="gw2/w0/9", t=150.0)),  # ended before the kill
        (0, _ev("online", "swept", node="gw2/w1/10")),
        (0, _ev("offline", "swept", "node-lost", node="gw2/w1/10", t=203.5)),
        (0, _ev("online", "moved", node="gw2/w0/9")),
        (0, _ev("offline", "moved", "takeover", node="gw2/w0/9", t=201.0)),
        (0, _ev("online", "elsewhere", node="gw1/w0/3")),
    ]
    view = killed_node_view(sessions_of(stream, []), "gw2", kill)
    assert view["held"] == 2 and view["node_lost"] == 1 and view["taken_over"] == 1
    assert view["accounted"] and view["last_node_lost_s"] == pytest.approx(3.5)
    stream.append((0, _ev("online", "forgotten", node="gw2/w0/9")))
    view = killed_node_view(sessions_of(stream, []), "gw2", kill)
    assert view["unended"] == 1 and not view["accounted"]
    assert node_of("gw2/w0/9") == "gw2" and node_of("") == ""


def test_drops_by_the_killed_gateway_are_no_false_expiries() -> None:
    def drop(port: int, at: float, silent_for: float = 1.0, max_gap: float = 3.0) -> dict[str, Any]:
        return {"client_id": "d", "port": port, "at": at, "silent_for": silent_for, "max_gap": max_gap}

    drops = [
        drop(7000, 50.0),  # the killed gateway, after the kill
        drop(7000, 40.0),  # the same gateway before the kill: false
        drop(7001, 50.0),  # a live gateway: false
        drop(7001, 50.0, silent_for=20.0),  # its own generator was late
    ]
    out = classify_drops(drops, 7000, 45.0, window=15.0)
    assert out["by_kill"] == 1 and out["false_expiries"] == 2 and out["generator_late"] == 1
    assert classify_drops(drops[:1], None, None, 15.0)["false_expiries"] == 1


def test_fleet_specs_give_every_generator_the_gateways_and_two_waves_of_reconnects(tmp_path: Path) -> None:
    load = FleetLoad(devices=1000, keepalive=4, reconnect=0.1, kill_node=True, redis_restart=True)
    tl = plan_fleet(load, 1)
    assert tl.kill is not None and tl.redis_down is not None and tl.redis_up is not None
    assert tl.start < tl.acts < tl.detect_by <= tl.kill < tl.redis_down < tl.redis_up < tl.wave2 < tl.end
    out = fleet_specs(load, tl, [7000, 7001, 7002], tmp_path)
    assert all(s.ports == [7000, 7001, 7002] and s.failover for s in out)
    times = sorted(at for s in out for _, at in s.reconnect)
    assert len(times) == 100
    assert sum(1 for t in times if t < tl.detect_by) == 50 and sum(1 for t in times if t >= tl.wave2) == 50
    assert FleetLoad(devices=30_000, kill_node=True).workers() == 2
    assert FleetLoad(devices=3_000).workers() == 1


def test_the_fleets_devices_speak_the_protocol_asked(tmp_path: Path) -> None:
    def load(*args: str) -> FleetLoad:
        return load_from(parser().parse_args(list(args)))

    mixed = load("--devices", "1000", "--protocol", "5:0.3")
    assert mixed.protocol == "3.1.1:0.7,5.0:0.3"  # the option normalised
    versions = "".join(s.versions for s in fleet_specs(mixed, plan_fleet(mixed, 1), [7000], tmp_path))
    assert len(versions) == 1000 and versions.count("5") == 300 and versions.count("4") == 700
    plain = load("--devices", "100")
    assert plain.protocol == "3.1.1"
    assert all(not s.versions for s in fleet_specs(plain, plan_fleet(plain, 1), [7000], tmp_path))


def test_a_cluster_failover_kills_the_primary_of_the_most_shards_but_not_the_hubs() -> None:
    def primary(name: str, first: int, last: int) -> ClusterNode:
        return ClusterNode(name, 0, frozenset({"master"}), "-", ((first, last),))

    nodes = [
        primary("a", 0, 5460),
        primary("b", 5461, 10922),
        primary("c", 10923, 16383),
        ClusterNode("r", 0, frozenset({"slave"}), "a", ()),
    ]
    shards = [1, 2, 3, 6000, 6001, 12000]
    assert busiest_primary(nodes, shards).id == "a"
    assert busiest_primary(nodes, shards, spare=100).id == "b"  # a holds the hub: the next busiest
    assert busiest_primary(nodes, [1, 2], spare=100).id == "a"  # only the hub's primary serves any


def _node(node_id: str, flags: str, slots: list[int]) -> ClusterNodeDetail:
    return {
        "id": node_id,
        "flags": tuple(flags.split(",")),
        "host": "127.0.0.1",
        "port": 0,
        "master": None,
        "ping_sent": 0,
        "pong_recv": 0,
        "link_state": "connected",
        "slots": slots,
        "migrations": [],
    }


def test_a_shards_server_is_the_primary_every_view_names_and_none_suspects() -> None:
    before = [_node("a", "master", [1]), _node("r", "slave", [])]
    assert slot_owners([before, before], [1, 2]) == ({1: "a", 2: None}, frozenset({"a"}))
    suspected = [_node("a", "master,fail?", [1]), _node("r", "slave", [])]
    assert slot_owners([before, suspected], [1])[0] == {1: None}  # lost, maybe: read nothing yet
    after = [_node("a", "master,fail", []), _node("r", "master", [1])]
    assert slot_owners([after, after], [1]) == ({1: "r"}, frozenset({"r"}))
    assert slot_owners([before, after], [1])[0] == {1: None}  # the servers do not agree yet
    assert slot_owners([], [1]) == ({1: None}, frozenset())


needs_redis = pytest.mark.skipif(
    redis_server_binary() is None and os.environ.get("CI") != "true",
    reason="redis-server is not installed (apt-get install redis-server); CI installs it",
)


@pytest.mark.bench
@pytest.mark.slow
@needs_redis
def test_ci_fleet_run_with_a_killed_gateway_and_a_redis_restart() -> None:
    load = FleetLoad(
        nodes=3,
        devices=600,
        keepalive=3,
        silent=0.05,
        reconnect=0.08,
        kill_node=True,
        redis_restart=True,
        lease=3.0,  # short, so the run stays short (the gateways are not overloaded here)
        failover_delay=(0.5, 6.0),  # some devices come back before the lease lapses, some after
    )
    r = run_fleet(load)
    text = report(r)
    assert r["connected"] == 600, text
    assert r["feed"]["lost"] == 0 and r["feed"]["duplicated"] == 0, text
    assert r["feed"]["online_duplicated"] == 0, text
    assert r["history"]["stream"]["ok"] and r["history"]["logs"]["ok"], text
    assert r["history"]["stream"]["sessions"] >= 600, text
    assert r["false_expiries"] == 0, text
    assert r["detected"] == r["silent"] == 30, text
    kill = r["kill"]
    assert kill["held"] > 0 and kill["accounted"] and not kill["other"], text
    assert kill["node_lost"] > 0, text  # the devices that waited past the lease were swept
    assert r["drops"]["by_kill"] > 0, text
    assert r["redis_incarnations"] == 2, text
    t = r["takeover_ms"]
    assert t["n"] == r["reconnected"] == 48 and r["takeover_missed"] == 0, text
    assert t["p99"] <= 500, text  # the target is 50 ms; a loaded CI machine gets ten times that
    assert passed(r), text


@pytest.mark.bench
@pytest.mark.slow
@needs_redis
def test_ci_fleet_run_through_a_sentinel_failover() -> None:
    load = FleetLoad(
        nodes=2, devices=400, keepalive=3, silent=0.05, reconnect=0.08, sentinel=True, failover=True, lease=3.0
    )
    r = run_fleet(load)
    text = report(r)
    assert r["connected"] == 400, text
    assert r["history"]["stream"]["ok"] and r["history"]["logs"]["ok"], text
    assert r["feed"]["lost"] == 0 and r["feed"]["duplicated"] == 0, text
    assert r["false_expiries"] == 0 and r["node_lost_on_live_gateways"] == 0, text
    assert r["detected"] == r["silent"] == 20, text
    outage = r["redis_outage"]
    assert outage is not None and 0 < outage["down_for_s"] < 15, text  # the replica was promoted
    assert "redis failover" in text, text
    assert passed(r), text


@pytest.mark.bench
@pytest.mark.slow
@needs_redis
def test_ci_fleet_run_on_a_redis_cluster_through_a_slot_migration_and_a_killed_gateway() -> None:
    load = FleetLoad(
        nodes=3,
        devices=600,
        keepalive=3,
        silent=0.05,
        reconnect=0.08,
        kill_node=True,
        redis_cluster=True,
        shards=8,
        migrate=True,
        lease=3.0,
        failover_delay=(0.5, 6.0),
    )
    r = run_fleet(load)
    text = report(r)
    assert r["connected"] == 600, text
    assert r["feed"]["lost"] == 0 and r["feed"]["duplicated"] == 0, text
    assert r["history"]["stream"]["ok"] and r["history"]["logs"]["ok"], text
    assert r["false_expiries"] == 0 and r["node_lost_on_live_gateways"] == 0, text
    assert r["detected"] == r["silent"] == 30, text
    kill = r["kill"]
    assert kill["held"] > 0 and kill["accounted"] and not kill["other"], text
    migration = r["redis_outage"]
    assert migration["migrated_slots"] == 4 and migration["migrated_keys"] > 0, text  # shards 0, 3, 6 and the hub
    assert r["redis"]["ops_per_s_run"] > 0, text  # summed over the three primaries
    assert passed(r), text


@pytest.mark.slow
@needs_redis
def test_the_cluster_reader_starts_a_run_for_the_shards_a_promoted_replica_took_over() -> None:
    if shutil.which("redis-cli") is None and not Path("/usr/bin/redis-cli").exists() and os.environ.get("CI") != "true":
        pytest.skip("redis-cli is not installed (apt-get install redis-tools); CI installs it")
    keys = FleetKeys(KEY_PREFIX, "-", 8)
    streams = [shard.stream for shard in keys.shards]
    cluster = RedisClusterSet(primaries=3, replicas=1)
    cluster.start()
    reader = ClusterPresenceReader([server.port for server in cluster.servers], streams)
    try:

        def write(stream: str, epoch: str) -> None:
            event = {"status": "online", "epoch": epoch, "client_id": epoch, "time": time.time()}
            ask(cluster.owner_of(hash_slot(stream)).port, "XADD", stream, "*", "event", json.dumps(event))

        reader.start()
        for stream in streams:
            write(stream, f"before-{stream}")
        victim = cluster.busiest([hash_slot(s) for s in streams], spare=hash_slot(keys.members))
        lost = [s for s in streams if cluster.owner_of(hash_slot(s)) is victim]
        deadline = time.monotonic() + 10
        while reader.count() < len(streams) and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.kill(victim)  # by PID
        cluster.wait_failover(hash_slot(lost[0]), victim, timeout=20)
        for stream in streams:
            write(stream, f"after-{stream}")
        deadline = time.monotonic() + 15
        while reader.count() < 2 * len(streams) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        reader.stop()
        cluster.stop()
    runs = {e.event["epoch"]: e.incarnation for e in reader.events}
    assert len(runs) == 2 * len(streams), runs
    assert reader.incarnation == 1 and reader.count(lost) == 2 * len(lost), runs
    # The promoted replica's copy of a lost shard is a run of its own; the others go on.
    assert all(runs[f"after-{s}"] == (1 if s in lost else 0) for s in streams), runs
    assert all(runs[f"before-{s}"] == 0 for s in streams), runs
