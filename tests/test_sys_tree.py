"""``$SYS/broker/...``: Mosquitto's statistics topics, their formats and timing (sans-IO),
the box's totals, and the worker's task under MockClock."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
from trio.testing import MockClock

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.coordination import frames
from servers.heartbeat.coordination.inprocess import InProcessCoordinator
from servers.heartbeat.coordination.sys_figures import BoxTotals, BrokerCounts
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.security.acl import AclFile
from servers.heartbeat.server.lifecycle import HeartbeatServer
from servers.heartbeat.server.sys_tree import LOAD_KINDS, PREFIX, VERSION, SysTree
from servers.heartbeat.worker import serve_heartbeat
from tests.test_heartbeat import Client, publish_topic

INTEGER = re.compile(rb"\d+")
FLOAT = re.compile(rb"\d+\.\d\d")


def _shape(topic: str) -> re.Pattern[bytes]:
    """The payload format of each topic, as Mosquitto 2.0 writes it."""
    if topic.endswith("/version"):
        return re.compile(rb"idlekeeper version \S+")
    if topic.endswith("/uptime"):
        return re.compile(rb"\d+ seconds")
    if "/load/" in topic:
        return FLOAT
    return INTEGER


def test_the_first_update_sends_every_topic_in_its_format_the_version_only_retained() -> None:
    tree = SysTree(start=100.0)
    counts = BrokerCounts(connected=3, away=2, messages_received=7, subscriptions=4, heap_current=10, heap_maximum=12)
    sent = dict(tree.update(counts, 100.0))
    assert f"{PREFIX}version" not in sent  # Mosquitto sends it once, at start: only new subscribers see it
    assert tree.current[f"{PREFIX}version"] == VERSION.encode()
    loads = [f"{PREFIX}load/{kind}/{window}" for window in ("1min", "5min", "15min") for kind, _ in LOAD_KINDS]
    others = [
        *("uptime", "clients/total", "clients/maximum", "clients/inactive", "clients/disconnected"),
        *("clients/active", "clients/connected", "clients/expired", "messages/stored", "store/messages/count"),
        *("store/messages/bytes", "subscriptions/count", "shared_subscriptions/count", "retained messages/count"),
        *("heap/current", "heap/maximum", "messages/received", "messages/sent", "publish/messages/dropped"),
        *("publish/messages/received", "publish/messages/sent", "bytes/received", "bytes/sent"),
        *("publish/bytes/received", "publish/bytes/sent"),
    ]
    assert set(sent) == {PREFIX + t for t in others} | set(loads)
    for topic, payload in sent.items():
        assert _shape(topic).fullmatch(payload), (topic, payload)
    assert all(sent[t] == b"0.00" for t in loads)
    assert sent[f"{PREFIX}uptime"] == b"0 seconds"
    assert (sent[f"{PREFIX}clients/total"], sent[f"{PREFIX}clients/maximum"]) == (b"5", b"5")
    assert sent[f"{PREFIX}clients/connected"] == sent[f"{PREFIX}clients/active"] == b"3"
    assert sent[f"{PREFIX}clients/disconnected"] == sent[f"{PREFIX}clients/inactive"] == b"2"
    assert sent[f"{PREFIX}messages/received"] == b"7"


def test_later_updates_send_the_uptime_and_what_changed_only() -> None:
    tree = SysTree(start=0.0)
    counts = BrokerCounts(connected=1)
    tree.update(counts, 0.0)
    # The second counts the first's values among those stored, as Mosquitto's store holds its own.
    assert dict(tree.update(counts, 10.0))[f"{PREFIX}retained messages/count"] == str(len(tree.current)).encode()
    assert [t for t, _ in tree.update(counts, 20.0)] == [f"{PREFIX}uptime"]
    assert tree.current[f"{PREFIX}uptime"] == b"20 seconds"
    sent = dict(tree.update(BrokerCounts(connected=0, away=1), 30.5))
    assert sent == {
        f"{PREFIX}uptime": b"30 seconds",
        f"{PREFIX}clients/inactive": b"1",
        f"{PREFIX}clients/disconnected": b"1",
        f"{PREFIX}clients/active": b"0",
        f"{PREFIX}clients/connected": b"0",
    }  # the total stayed 1: neither it nor the maximum is sent


def test_the_maximum_is_sent_only_when_the_total_passes_it() -> None:
    tree = SysTree(start=0.0)
    assert f"{PREFIX}clients/maximum" not in dict(tree.update(BrokerCounts(), 0.0))  # 0 clients: none yet
    assert dict(tree.update(BrokerCounts(connected=2), 1.0))[f"{PREFIX}clients/maximum"] == b"2"
    assert f"{PREFIX}clients/maximum" not in dict(tree.update(BrokerCounts(connected=1), 2.0))
    assert tree.current[f"{PREFIX}clients/maximum"] == b"2"


def test_load_averages_follow_mosquittos_formula() -> None:
    """100 messages in 10 s is 600 a minute; each average moves from 0 by 600 x (1 - e^(-10/T)):
    by hand, 1 - e^(-1/6) = 0.153518, 1 - e^(-1/30) = 0.032784, 1 - e^(-1/90) = 0.011050."""
    tree = SysTree(start=0.0)
    tree.update(BrokerCounts(messages_received=50), 0.0)  # the base: what came before is not a rate
    sent = dict(tree.update(BrokerCounts(messages_received=150), 10.0))
    assert sent[f"{PREFIX}load/messages/received/1min"] == b"92.11"
    assert sent[f"{PREFIX}load/messages/received/5min"] == b"19.67"
    assert sent[f"{PREFIX}load/messages/received/15min"] == b"6.63"
    assert f"{PREFIX}load/messages/sent/1min" not in sent  # unchanged at 0.00
    # Then nothing comes: 92.11 x e^(-1/6) = 77.97 (and so on down).
    sent = dict(tree.update(BrokerCounts(messages_received=150), 20.0))
    assert sent[f"{PREFIX}load/messages/received/1min"] == b"77.97"


def test_an_average_that_moves_less_than_a_hundredth_is_not_sent_but_kept() -> None:
    tree = SysTree(start=0.0)
    tree.update(BrokerCounts(), 0.0)
    # One socket in 600 s is 0.1 a minute: the 15-minute average moves 0.1 x (1 - e^(-2/3)) = 0.0487.
    sent = dict(tree.update(BrokerCounts(sockets=1), 600.0))
    assert sent[f"{PREFIX}load/sockets/15min"] == b"0.05"
    # One in the next 60 s: 1/min, 15-min average 0.0487 + (1 - 0.0487) x (1 - e^(-1/15)) = 0.110: sent;
    # nothing in the next 1 s: it moves 0.110 x (1 - e^(-1/900)) = 0.0001, not sent, yet kept.
    tree.update(BrokerCounts(sockets=2), 660.0)
    kept = tree._loads[f"{PREFIX}load/sockets/15min"]
    assert f"{PREFIX}load/sockets/15min" not in dict(tree.update(BrokerCounts(sockets=2), 661.0))
    assert tree._loads[f"{PREFIX}load/sockets/15min"] < kept


def test_a_filter_sees_the_values_it_matches_and_a_wildcard_first_none() -> None:
    tree = SysTree(start=0.0)
    tree.update(BrokerCounts(connected=1), 0.0)
    assert {t for t, _ in tree.matching("$SYS/broker/#")} == set(tree.current)
    assert sorted(t for t, _ in tree.matching("$SYS/broker/clients/+")) == sorted(
        PREFIX + f"clients/{n}"
        for n in ("total", "maximum", "inactive", "disconnected", "active", "connected", "expired")
    )
    assert list(tree.matching("#")) == list(tree.matching("+/broker/uptime")) == []
    assert list(tree.matching("$SYS/broker/version")) == [(f"{PREFIX}version", VERSION.encode())]


def test_a_box_sums_its_workers_latest_and_forgets_a_gone_one() -> None:
    box = BoxTotals()
    assert box.report(1, BrokerCounts(connected=2, bytes_sent=10)) == BrokerCounts(connected=2, bytes_sent=10)
    assert box.report(2, BrokerCounts(connected=3, bytes_sent=5)) == BrokerCounts(connected=5, bytes_sent=15)
    assert box.report(1, BrokerCounts(connected=1, bytes_sent=20)) == BrokerCounts(connected=4, bytes_sent=25)
    box.forget(2)
    assert box.report(1, BrokerCounts(connected=1)) == BrokerCounts(connected=1)


def test_the_counts_cross_the_bus_in_one_frame_and_a_shorter_one_is_read() -> None:
    counts = BrokerCounts(connected=7, heap_maximum=1 << 40, connects=3)
    line = frames.encode(frames.BoxFigures(4, counts.values()))
    decoded = frames.decode(line)
    assert isinstance(decoded, frames.BoxFigures) and decoded.request == 4
    assert BrokerCounts.from_values(decoded.values) == counts
    assert BrokerCounts.from_values((1, 2)) == BrokerCounts(connected=1, away=2)  # an older sender's
    assert BrokerCounts.from_values((*counts.values(), 99)) == counts  # a newer one's


async def test_a_lone_worker_adds_its_retained_messages_and_away_sessions() -> None:
    coordinator = InProcessCoordinator()
    coordinator.retain("a/b", b"xyz", 0, "c1")
    counts = await coordinator.broker_counts(BrokerCounts(connected=1))
    assert (counts.connected, counts.retained, counts.away) == (1, 1, 0)
    assert counts.stored == 1 and counts.stored_bytes > 0


# -- the worker's task, in-process, under MockClock --------------------------------------


@asynccontextmanager
async def running(engine: str, **kw: object) -> AsyncIterator[HeartbeatServer]:
    cfg = HeartbeatConfig(port=0, tick=0.1, connect_timeout=5, engine=engine, **kw)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_heartbeat, cfg))
        yield server
        nursery.cancel_scope.cancel()


async def _publishes(client: Client, count: int) -> list[tuple[str, bytes, bool]]:
    out = []
    for _ in range(count):
        packet = await client.read_packet()
        assert packet[0] & 0xF0 == 0x30, packet
        topic, payload = publish_topic(packet)
        out.append((topic, payload, bool(packet[0] & 1)))
    return out


@pytest.mark.parametrize("engine", ["dense", "streams"])
async def test_a_subscriber_gets_the_values_retained_then_each_interval_what_changed(
    clock: MockClock, engine: str
) -> None:
    async with running(engine, sys_interval=10.0) as server:
        start = trio.current_time()
        watcher = await Client.connect(server.port, "dash")
        await watcher.send(encoders.encode_subscribe(1, [("$SYS/broker/#", 0)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0])
        own = server.fanout.retained.own
        assert own is not None
        first = await _publishes(watcher, len(list(own("$SYS/broker/#"))))  # the update at start's, the version's
        assert all(retain for _, _, retain in first)
        values = {topic: payload for topic, payload, _ in first}
        assert values[f"{PREFIX}version"] == VERSION.encode()
        assert values[f"{PREFIX}clients/connected"] == b"0"  # as at the start
        device = await Client.connect(server.port, "dev-1")
        await device.send(encoders.encode_publish("a/b", b"hello"))
        await trio.sleep_until(start + 10.5)
        assert trio.current_time() - start < 11  # no wall clock: MockClock jumped
        with trio.move_on_after(0.5):
            live = []
            while True:
                live += await _publishes(watcher, 1)
        changed = {topic: payload for topic, payload, retain in live if not retain}
        assert len(changed) == len(live)  # live copies go without the flag, as Mosquitto's
        assert changed[f"{PREFIX}uptime"] == b"10 seconds"
        assert changed[f"{PREFIX}clients/connected"] == b"2"
        assert changed[f"{PREFIX}clients/maximum"] == b"2"
        assert changed[f"{PREFIX}publish/messages/received"] == b"1"
        assert changed[f"{PREFIX}publish/bytes/received"] == b"5"
        assert int(changed[f"{PREFIX}bytes/received"]) > 0 and int(changed[f"{PREFIX}bytes/sent"]) > 0
        assert f"{PREFIX}clients/expired" not in changed  # unchanged: not sent again
        assert server.coordinator.retained is not None
        stored, _ = await server.coordinator.retained("$SYS/broker/#", None)
        assert stored == []  # never in the retained store (nor a durable file, nor Redis)


async def test_an_acl_lets_a_client_read_only_the_values_it_allows(clock: MockClock) -> None:
    acl = AclFile.parse("topic read $SYS/broker/clients/#\ntopic readwrite devices/#\n")
    async with running("dense", sys_interval=10.0, acl=acl) as server:
        reader = await Client.connect(server.port, "dash")
        await reader.send(encoders.encode_subscribe(1, [("$SYS/broker/#", 0)]))
        suback = await reader.read_packet()
        assert suback[:4] == b"\x90\x03\x00\x01", suback
        topics = set()
        if suback[4] != 0x80:  # granted: each value is checked against the ACL as it goes
            with trio.move_on_after(10.5):
                while True:
                    topics.add((await _publishes(reader, 1))[0][0])
            assert topics and server.broker.denied > 0
        assert topics <= {t for t, _ in server.fanout.retained.own("$SYS/broker/clients/#")}  # type: ignore[misc]
        await reader.send(encoders.encode_pingreq())
        assert await reader.read(2) == encoders.encode_pingresp()


async def test_interval_zero_publishes_nothing(clock: MockClock) -> None:
    async with running("dense", sys_interval=0.0) as server:
        watcher = await Client.connect(server.port, "dash")
        await watcher.send(encoders.encode_subscribe(1, [("$SYS/broker/#", 0)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0])
        await trio.sleep(25)
        await watcher.send(encoders.encode_pingreq())
        assert await watcher.read(2) == encoders.encode_pingresp()
        assert server.fanout.retained.own is None
