"""MQTT 5 retained messages (issue 28): a retained message keeps its publisher's
properties and its Message Expiry Interval, which ends its retention and is sent
counted down (§3.3.2.3.3); retained offline presence tells a 5.0 subscriber, as a
Message Expiry, when the server stops retaining it. In the pure stores, in the Redis
fleet's script, and through the server with paho-mqtt on every coordinator."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import coredis
import paho.mqtt.client as mqtt
import pytest
import trio

from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.broker.retained import RetainedStore
from servers.heartbeat.coordination.fleet.retained import retained_head, retained_message
from servers.heartbeat.coordination.registry import Registry
from servers.heartbeat.coordination.retention import Retention, presence_properties
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.v5.outbound import forwarded, message_expiry
from servers.heartbeat.mqtt.v5.properties import Carrier, Properties, read_properties
from servers.heartbeat.mqtt.v5.wire import pack_varint
from servers.heartbeat.presence.event import PresenceEvent

from .redis_server import RedisServer
from .test_fleet import PREFIX, drain, fleet
from .test_fleet import redis_server as redis_server  # the fixture, used by name
from .test_heartbeat_clients import ROOT, Server
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name
from .test_mqtt5_server import Paho5, by_topic, prop, publish_properties, user_properties
from .test_mqtt5_server import clients as clients  # the fixture, used by name


def props(**values: Any) -> bytes:
    """A publisher's properties as they reach subscribers (and the stores)."""
    return forwarded(Properties(**values))


def read(packed: bytes) -> Properties:
    whole = pack_varint(len(packed)) + packed
    value, _ = read_properties(whole, 0, len(whole), Carrier.PUBLISH)
    return value


def event(status: str, client_id: str, at: float, epoch: str) -> PresenceEvent:
    reason = Offline.KEEPALIVE_TIMEOUT if status == "offline" else None
    return PresenceEvent(status, client_id, "127.0.0.1:1", reason, 0.0, at, epoch=epoch)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- the pure stores


def test_the_store_keeps_properties_and_counts_their_bytes() -> None:
    store = RetainedStore(max_bytes=40)
    packed = props(content_type="text/plain", user_properties=(("k", "v"),))
    assert store.store("a", b"xy", 1, 0.0, properties=packed)
    (got,) = store.matching("a", 0.0)
    assert got.properties == packed
    assert store.bytes == 1 + 2 + len(packed)
    assert not store.store("b", b"z" * 10, 0, 0.0, properties=b"\x03" * 30)  # past max_bytes with them
    assert store.store("a", b"", 0, 0.0)  # clearing frees them too
    assert store.bytes == 0


def test_retention_ends_at_the_message_expiry_and_sends_what_is_left() -> None:
    clock = Clock()
    retention = Retention(Registry(), presence_prefix=PRESENCE, presence=False, clock=clock)
    packed = props(message_expiry_interval=10, user_properties=(("unit", "C"),))
    assert retention.retain("cfg/a", b"on", 1, "dev", packed)
    assert retention.retain("cfg/b", b"for ever", 0, "dev", props(content_type="text/plain"))
    clock.now += 3.5
    messages, cursor = retention.page("cfg/#", None)
    assert cursor is None
    first, second = messages
    assert (first.topic, first.payload, first.qos) == ("cfg/a", b"on", 1)
    assert read(first.properties).message_expiry_interval == 7  # 6.5 s left, rounded up
    assert read(first.properties).user_properties == (("unit", "C"),)
    assert read(second.properties) == Properties(content_type="text/plain")
    clock.now += 6.5
    assert [m.topic for m in retention.page("cfg/#", None)[0]] == ["cfg/b"]  # expired at 10 s
    assert retention.store.prune(clock.now) == 1


def test_a_retained_message_already_expired_clears_the_topic() -> None:
    clock = Clock()
    retention = Retention(Registry(), presence_prefix=PRESENCE, presence=False, clock=clock)
    retention.retain("t", b"old", 0)
    retention.retain("t", b"new", 0, "", props(message_expiry_interval=0))
    assert retention.page("t", None) == ([], None)


def test_retained_offline_presence_carries_the_expiry_of_its_retention() -> None:
    clock = Clock()
    registry = Registry()
    registry.online(event("online", "up", clock.now, "e1"))
    registry.online(event("online", "down", clock.now, "e2"))
    registry.offline(event("offline", "down", clock.now, "e2"))
    retention = Retention(registry, presence_prefix=PRESENCE, offline_ttl=3600.0, clock=clock)
    clock.now += 100.2
    down = read(retention.page(PRESENCE + "down", None)[0][0].properties)
    up = read(retention.page(PRESENCE + "up", None)[0][0].properties)
    assert down.message_expiry_interval == 3500  # 3499.8 s left, rounded up
    assert (down.payload_format_indicator, down.content_type) == (1, "application/json")
    assert up.message_expiry_interval is None  # an online device's presence does not run out
    assert (up.payload_format_indicator, up.content_type) == (1, "application/json")
    # Without a TTL, offline presence is retained as long as the registry keeps it.
    forever = presence_properties(event("offline", "x", 0.0, "e3"), None, 1e9)
    assert message_expiry(forever) is None


def test_the_fleets_stored_head_round_trips_and_old_values_still_read() -> None:
    packed = props(message_expiry_interval=60, correlation_data=b"\x00\x01")
    value = retained_head(2, packed, 1_060.0) + b"payload"  # stored at 1,000 s
    got = retained_message("t", value, 1_010.25)
    assert got is not None
    assert (got.topic, got.payload, got.qos) == ("t", b"payload", 2)
    assert read(got.properties).message_expiry_interval == 50
    assert read(got.properties).correlation_data == b"\x00\x01"
    assert retained_message("t", value, 1_060.0) is None  # expired
    plain = retained_message("t", b"1old", 0.0)  # a value stored before MQTT 5: digit, payload
    assert plain is not None and (plain.payload, plain.qos, plain.properties) == (b"old", 1, b"")
    assert retained_head(1, b"", None) == b"1"  # what a 3.1.1 publisher's message still is


async def test_the_fleet_keeps_properties_expires_and_frees_expired_when_full(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", max_retained_bytes=200, retain_presence=False) as (a, b):
        a.coord.retain("cfg/short", b"s", 1, "dev", props(message_expiry_interval=1))
        a.coord.retain("cfg/long", b"l", 0, "dev", props(message_expiry_interval=600, content_type="x/y"))
        a.coord.retain("cfg/plain", b"p", 0, "dev")
        await drain(a)
        page, _ = await b.coord.retained("cfg/#", None)
        by = {m.topic: m for m in page}
        assert set(by) == {"cfg/short", "cfg/long", "cfg/plain"}
        assert read(by["cfg/long"].properties).content_type == "x/y"
        assert read(by["cfg/long"].properties).message_expiry_interval in (599, 600)
        assert by["cfg/plain"].properties == b""
        await trio.sleep(1.1)
        page, _ = await b.coord.retained("cfg/#", None)
        assert {m.topic for m in page} == {"cfg/long", "cfg/plain"}  # skipped once expired
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert await r.hexists(PREFIX + "retained", "cfg/short")  # still held...
            a.coord.retain("big", b"x" * 140, 0, "other")  # ...until the store needs its room
            await drain(a)
            assert not await r.hexists(PREFIX + "retained", "cfg/short")
            assert list(await r.zrange(PREFIX + "retained-expiry", 0, -1)) == [b"cfg/long"]
        page, _ = await b.coord.retained("big", None)
        assert [m.topic for m in page] == ["big"]


# ---------------------------------------------------------------- through the server


def fleet_gateway(redis_server: RedisServer, tmp_path: Path, extra: list[str]) -> Server:
    port = free_port()
    log = tmp_path / "gw.jsonl"
    args = ["--cluster", redis_server.url, "--node", "gw0", "--tick", "0.05", "--presence-log", str(log), *extra]
    return Server(start_heartbeat(port, 1, args, cwd=str(ROOT)), port, log, None)


@pytest.mark.parametrize("coordinator", ["one", "workers", "fleet"])
def test_a_retained_message_keeps_its_properties_and_expiry_on_every_coordinator(
    start_server: Any, clients: list[Paho5], redis_server: RedisServer, tmp_path: Path, coordinator: str
) -> None:
    extra = ["--presence-offline-ttl", "3600"]
    if coordinator == "fleet":
        server = fleet_gateway(redis_server, tmp_path, extra)
    else:
        server = start_server(*extra, workers=2 if coordinator == "workers" else 1)
    try:
        device = Paho5(server.port, "thermo")
        clients.append(device.start())
        user = [("unit", "C"), ("site", "b7")]
        long = publish_properties(MessageExpiryInterval=600, ContentType="application/json", UserProperty=user)
        device.client.publish("state/t", b'{"t":21}', qos=1, retain=True, properties=long).wait_for_publish(5)
        short = publish_properties(MessageExpiryInterval=1)
        device.client.publish("state/blip", b"gone soon", qos=1, retain=True, properties=short).wait_for_publish(5)
        gone = Paho5(server.port, "gone")
        clients.append(gone.start())
        gone.client.disconnect()
        time.sleep(1.2)  # the blip's second runs out; the server has the rest

        late = Paho5(server.port, "late5")
        clients.append(late.start())
        late.subscribe(("state/#", 1), (PRESENCE + "gone", 0))
        old = Paho5(server.port, "late311", protocol=mqtt.MQTTv311)
        clients.append(old.start())
        old.subscribe(("state/#", 1))
        late.wait(lambda ms: bool(by_topic(ms, "state/t")) and bool(by_topic(ms, PRESENCE + "gone")))
        old.wait(lambda ms: bool(by_topic(ms, "state/t")))
        time.sleep(0.2)

        (got,) = by_topic(late.messages, "state/t")
        assert got.retain and got.payload == b'{"t":21}'
        assert prop(got, "ContentType") == "application/json" and user_properties(got) == user
        assert 590 <= prop(got, "MessageExpiryInterval") <= 599  # what is left of its 600 s
        assert by_topic(late.messages, "state/blip") == []  # expired: no longer retained
        (plain,) = by_topic(old.messages, "state/t")
        assert plain.retain and plain.payload == b'{"t":21}' and plain.properties is None
        (offline,) = by_topic(late.messages, PRESENCE + "gone")
        assert offline.retain and json.loads(offline.payload)["status"] == "offline"
        assert 3590 <= prop(offline, "MessageExpiryInterval") <= 3600
        assert prop(offline, "ContentType") == "application/json" and prop(offline, "PayloadFormatIndicator") == 1
    finally:
        if coordinator == "fleet":
            server.proc.kill()  # by PID
            server.proc.wait()
