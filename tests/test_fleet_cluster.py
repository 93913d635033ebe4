"""A fleet on Redis Cluster (issue 32): gateways on a 3-primary cluster of real
``redis-server`` processes, presence split into shards by client id (hash tags), and
slots moved between primaries while devices connect, leave and roam; a gateway
SIGKILLed and its sessions ended once in every shard. Presence stays exactly once
per session: checked per device over the gateways' logs (:mod:`loadtest.history`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.device_results import read_presence_log
from loadtest.history import check_history, merged_by_time
from loadtest.redis_cluster import RedisClusterSet
from servers.heartbeat.coordination.fleet.keys import FleetKeys
from servers.heartbeat.coordination.fleet.shards import HASH_SLOTS, hash_slot, shard_index, spread_tags
from servers.heartbeat.coordination.fleet.target import parse_target
from servers.heartbeat.mqtt import encoders

from .conftest import wait_closed
from .redis_server import require_binary
from .test_fleet_faults import get, kill_gateways, start_gateways
from .test_fleet_sentinel import metric
from .test_heartbeat_clients import raw_connect, subscriber
from .test_presence_faults import heard, until


def test_hash_slots_are_redis_clusters() -> None:
    # The values Redis's own documentation and CLUSTER KEYSLOT give.
    assert hash_slot("foo") == 12182
    assert hash_slot("123456789") == 0x31C3 % HASH_SLOTS
    assert hash_slot("{user1000}.following") == hash_slot("{user1000}.followers") == hash_slot("user1000")
    assert hash_slot("foo{}{bar}") != hash_slot("bar")  # an empty tag: the whole key is hashed
    assert hash_slot("foo{{bar}}zap") == hash_slot("{bar")


@pytest.mark.parametrize("count", [1, 3, 16, 64])
def test_shard_tags_are_spread_evenly_over_the_slots(count: int) -> None:
    tags = spread_tags(count)
    slots = [hash_slot("{" + tag + "}") for tag in tags]
    assert len(set(slots)) == count + 1, "each shard and the hub in a slot of its own"
    width = HASH_SLOTS / count
    for k, slot in enumerate(slots[:count]):
        assert k * width <= slot < (k + 1) * width, (k, slot)


def test_a_devices_keys_share_a_slot_and_devices_spread_over_the_shards() -> None:
    keys = FleetKeys("idlekeeper:", "gw0", shards=16)
    for client_id in ("sensor-1", "ü-🙂", "x" * 300):
        shard = keys.shard(client_id)
        names = [shard.dev_prefix + client_id, shard.stream, shard.owned, shard.owned_prefix + "gw9", shard.lease]
        assert len({hash_slot(n) for n in names}) == 1, names
    hub = [keys.members, keys.lease, keys.routes, keys.filters, keys.changed, keys.pchanged, keys.psessions]
    hub += [keys.retained, keys.retained_index, keys.held, keys.sweep_prefix + "gw1"]
    assert len({hash_slot(n) for n in hub}) == 1, "everything else is in the hub's slot"
    assert hash_slot(keys.members) not in {hash_slot(s.stream) for s in keys.shards}
    counts = Counter(shard_index(f"device-{i}", 16) for i in range(16_000))
    assert len(counts) == 16 and max(counts.values()) < 1.1 * 1000, counts
    plain = FleetKeys("idlekeeper:", "gw0")
    assert plain.shard("sensor-1").dev_prefix == "idlekeeper:dev:", "one Redis keeps its names"
    assert plain.shards[0].stream == "idlekeeper:presence" and plain.lease == plain.shards[0].lease


def test_cluster_urls_are_read_or_refused_with_the_reason() -> None:
    target = parse_target("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001")
    assert target.cluster and target.cluster_nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert target.shards == 16 and target.password == "pw" and "pw" not in target.describe()
    assert parse_target("redis+cluster://127.0.0.1:7000/?shards=64").shards == 64
    for url, reason in (
        ("redis+cluster://127.0.0.1:7000/?shards=0", "from 1 to 1024"),
        ("redis+cluster://127.0.0.1:7000/?shards=x", "from 1 to 1024"),
        ("redis+cluster://127.0.0.1:7000/?replicas=2", "unknown option"),
        ("redis+cluster://127.0.0.1:7000/3", "no databases"),
        ("redis+cluster://127.0.0.1", "host:port"),
    ):
        with pytest.raises(ValueError, match=reason):
            parse_target(url)


@pytest.fixture
def cluster() -> Iterator[RedisClusterSet]:
    require_binary()
    if shutil.which("redis-cli") is None and not Path("/usr/bin/redis-cli").exists() and os.environ.get("CI") != "true":
        pytest.skip("redis-cli is not installed (apt-get install redis-tools); CI installs it")
    group = RedisClusterSet(primaries=3)
    group.start()
    yield group
    group.stop()


def _stop_and_check(gateways: list, logs: list[Path], at_least: int) -> None:  # type: ignore[type-arg]
    for proc, *_ in gateways:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, *_ in gateways:
        proc.wait(timeout=20)
    merged = merged_by_time(*(read_presence_log(log) or [] for log in logs))
    history = check_history(merged, lease=6)  # strict: no online twice, not even a copy
    assert history.ok, history.summary()
    assert history.devices >= at_least, history.summary()


@pytest.mark.slow
def test_presence_stays_exactly_once_while_slots_move_between_primaries(
    cluster: RedisClusterSet, tmp_path: Path
) -> None:
    url = cluster.url + "/?shards=6"
    keys = FleetKeys("idlekeeper:", "gw0", shards=6)
    gateways = start_gateways(url, tmp_path)
    try:
        (_, port0, status0, log0), (_, port1, status1, log1) = gateways
        watch, got = subscriber(port1, "dashboard", "$SYS/presence/#")
        time.sleep(0.3)
        on0 = {f"a-{i}": raw_connect(port0, f"a-{i}", keep_alive=60, v5=i % 2 == 1) for i in range(30)}
        on1 = {f"b-{i}": raw_connect(port1, f"b-{i}", keep_alive=60) for i in range(30)}
        until(lambda: heard(got, "online") >= set(on0) | set(on1), 15, "the dashboard hears both gateways")
        assert {keys.shard(c).index for c in [*on0, *on1]} == set(range(6)), "every shard holds devices"

        # Three shards' slots and the hub's move to another primary, a few keys at a
        # time, while devices leave, arrive and roam.
        moving = [hash_slot(keys.shards[k].stream) for k in (0, 2, 4)] + [hash_slot(keys.members)]
        before = {slot: cluster.owner_of(slot).port for slot in moving}
        moved: list[int] = []
        mover = threading.Thread(target=lambda: moved.extend(cluster.migrate_slot(s, batch=3) for s in moving))
        mover.start()
        late: dict[str, object] = {}
        left, roamed = set(), set()
        for i in range(30):  # for as long as the slots move (at least 10 rounds, at most 30)
            if i >= 10 and not mover.is_alive():
                break
            if i < 15:
                on0.pop(f"a-{15 + i}").sendall(encoders.encode_disconnect())
                left.add(f"a-{15 + i}")
                late[f"a-{i}"] = raw_connect(port1, f"a-{i}", keep_alive=60)  # roams from gw0 to gw1
                roamed.add(f"a-{i}")
            late[f"late-{i}"] = raw_connect(port0 if i % 2 else port1, f"late-{i}", keep_alive=60)
            time.sleep(0.05)
        mover.join(60)
        assert not mover.is_alive() and sum(moved) > 0
        assert all(cluster.owner_of(slot).port != port for slot, port in before.items()), "the slots moved"

        until(lambda: heard(got, "offline") >= left, 15, "the offlines")
        until(lambda: heard(got, "online") >= {c for c in late if c.startswith("late")}, 15, "the new onlines")
        for device in roamed:
            wait_closed(on0.pop(device), 10)  # taken over by its new connection, across gateways
        for device, where in (("b-5", status0), ("late-3", status1), ("a-4", status0)):
            status, body = get(f"http://127.0.0.1:{where}/devices/{device}")
            assert status == 200 and json.loads(body)["status"] == "online", (device, body)
        healthy = set(on0) | set(on1)
        assert not heard(got, "offline") & healthy, "a healthy device went offline"
        assert metric(status0, "heartbeat_fleet_redis_server_changes_total") == 0, "a slot moved, no server changed"

        # A dashboard that subscribes now is given every device's retained presence,
        # from every shard, wherever its slot went.
        _, fresh = subscriber(port0, "late-dashboard", "$SYS/presence/#")
        online = set(on0) | set(on1) | set(late)
        until(lambda: heard(fresh, "online") >= online, 15, "the retained presence of every shard")
        for sock in [*on0.values(), *on1.values(), *late.values(), watch]:
            sock.close()  # type: ignore[attr-defined]
        _stop_and_check(gateways, [log0, log1], 70)
    finally:
        kill_gateways(gateways)


@pytest.mark.slow
def test_a_gateway_killed_on_a_cluster_has_its_sessions_ended_once_in_every_shard(
    cluster: RedisClusterSet, tmp_path: Path
) -> None:
    gateways = start_gateways(cluster.url + "/?shards=8", tmp_path)
    try:
        (gw0, port0, _, log0), (_, port1, status1, log1) = gateways
        watch, got = subscriber(port1, "dashboard", "$SYS/presence/#")
        time.sleep(0.3)
        on0 = {f"a-{i}": raw_connect(port0, f"a-{i}", keep_alive=60) for i in range(40)}
        on1 = {f"b-{i}": raw_connect(port1, f"b-{i}", keep_alive=60) for i in range(20)}
        until(lambda: heard(got, "online") >= set(on0) | set(on1), 15, "the dashboard hears both gateways")
        gw0.kill()  # by PID
        gw0.wait()
        until(lambda: heard(got, "offline", "node-lost") >= set(on0), 20, "every session of gw0 ended, node-lost")
        time.sleep(1.0)  # a second sweeper, or a sweep resumed, would add to them now
        ends = Counter(t for t, e in list(got) if e["status"] == "offline")
        assert all(n == 1 for n in ends.values()), ends
        assert not heard(got, "offline") & set(on1), "a healthy device went offline"
        status, body = get(f"http://127.0.0.1:{status1}/devices/a-7")
        assert status == 200 and json.loads(body)["reason"] == "node-lost", body
        for sock in [*on0.values(), *on1.values(), watch]:
            sock.close()
        _stop_and_check(gateways, [log0, log1], 60)
    finally:
        kill_gateways(gateways)
