"""Topic aliases the server sets towards an MQTT 5 client (issue 28, §3.3.2.3.4):
only when the client's CONNECT allows them, a topic named once and then by alias,
the least recently used alias reused when all are taken. Pure (with a property test
against a client-side resolver) and through the server with gmqtt, a client that
takes them, and raw sockets for the bytes on the wire."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import gmqtt  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from servers.heartbeat.mqtt.encoders import encode_pingresp
from servers.heartbeat.mqtt.v5.aliases import MIN_TOPIC, OutboundAliases
from servers.heartbeat.mqtt.v5.codec import read_packets
from servers.heartbeat.mqtt.v5.outbound import forwarded, publish, subscription_identifier
from servers.heartbeat.mqtt.v5.packets import PUBACK, Ack, Publish, Suback, Subscribe, Subscription
from servers.heartbeat.mqtt.v5.properties import Properties

from .test_heartbeat_clients import Server
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name
from .test_mqtt5_server import Paho5, raw5
from .test_mqtt5_server import clients as clients  # the fixture, used by name

ENGINES = ["dense", "streams"]


def one(data: bytes) -> Publish:
    (packet,) = read_packets(data)
    assert isinstance(packet, Publish)
    return packet


class Resolver:
    """What a client does with the server's aliases (§3.3.2.3.4), kept apart from the
    code under test: a topic with an alias sets it, an empty topic looks it up."""

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.known: dict[int, str] = {}

    def topic(self, packet: Publish) -> str:
        alias = packet.properties.topic_alias
        if alias is None:
            assert packet.topic
            return packet.topic
        assert 0 < alias <= self.maximum
        if packet.topic:
            self.known[alias] = packet.topic
            return packet.topic
        return self.known[alias]


# ---------------------------------------------------------------- pure


def test_a_topic_is_named_once_then_sent_by_alias() -> None:
    aliases = OutboundAliases(4)
    first = aliases.apply(publish("tele/building-7/temperature", b"21"))
    second = aliases.apply(publish("tele/building-7/temperature", b"22"))
    a, b = one(first), one(second)
    assert (a.topic, a.properties.topic_alias, a.payload) == ("tele/building-7/temperature", 1, b"21")
    assert (b.topic, b.properties.topic_alias, b.payload) == ("", 1, b"22")
    assert len(second) == len(publish("tele/building-7/temperature", b"22")) - 27 + 3
    assert (aliases.set, aliases.used) == (1, 1)
    assert aliases.saved == 27 - 3 - 3  # the topic's bytes once, less the alias twice


def test_the_least_recently_used_alias_goes_to_a_new_topic() -> None:
    aliases = OutboundAliases(2)
    resolver = Resolver(2)
    sent = ["room/a", "room/b", "room/a", "room/c", "room/a", "room/b"]
    packets = [one(aliases.apply(publish(t, b"x"))) for t in sent]
    assert [resolver.topic(p) for p in packets] == sent
    # room/c took room/b's alias (room/a had been used since); room/b then took room/c's.
    assert [(p.topic, p.properties.topic_alias) for p in packets] == [
        ("room/a", 1),
        ("room/b", 2),
        ("", 1),
        ("room/c", 2),
        ("", 1),
        ("room/b", 2),
    ]


def test_qos_1_packet_ids_flags_and_properties_survive() -> None:
    aliases = OutboundAliases(1)
    props = Properties(content_type="text/plain", user_properties=(("k", "v"),))
    packed = forwarded(props) + subscription_identifier(7)
    aliases.apply(publish("cmd/device-1", b"on", 1, True, 5, False, packed))
    again = one(aliases.apply(publish("cmd/device-1", b"off", 1, True, 6, True, packed)))
    assert (again.topic, again.qos, again.retain, again.dup, again.packet_id) == ("", 1, True, True, 6)
    assert again.properties.content_type == "text/plain"
    assert again.properties.user_properties == (("k", "v"),)
    assert again.properties.subscription_identifiers == (7,)
    assert again.properties.topic_alias == 1 and again.payload == b"off"


def test_short_topics_other_packets_and_the_clients_packet_size_are_left_alone() -> None:
    aliases = OutboundAliases(8)
    short = publish("a/b", b"x")
    assert aliases.apply(short) == short  # shorter than MIN_TOPIC: nothing to save
    assert len("a/b") < MIN_TOPIC
    assert aliases.apply(encode_pingresp()) == encode_pingresp()
    big = publish("tele/long/topic", b"y" * 80)
    assert aliases.apply(big, max_packet_size=len(big) + 2) == big  # the alias would not fit
    assert aliases.set == 0
    assert one(aliases.apply(big, max_packet_size=len(big) + 4)).properties.topic_alias == 1
    with pytest.raises(ValueError):
        OutboundAliases(0)


@given(
    maximum=st.integers(1, 4),
    sends=st.lists(
        st.tuples(
            st.sampled_from(["t/one", "t/two", "t/three", "t/four", "t/five", "x", "long/" + "t" * 200]),
            st.integers(0, 1),
            st.binary(max_size=300),  # a remaining length of one byte, or two
            st.sampled_from([b"", forwarded(Properties(content_type="c", user_properties=(("k", "v" * 150),)))]),
        ),
        max_size=40,
    ),
)
def test_a_client_resolving_the_aliases_reads_every_topic_right(
    maximum: int, sends: list[tuple[str, int, bytes, bytes]]
) -> None:
    aliases = OutboundAliases(maximum)
    resolver = Resolver(maximum)
    for i, (topic, qos, payload, props) in enumerate(sends):
        packet = one(aliases.apply(publish(topic, payload, qos, False, i + 1 if qos else None, False, props)))
        assert resolver.topic(packet) == topic
        assert packet.payload == payload and packet.packet_id == (i + 1 if qos else None)
        assert packet.properties.user_properties == (() if not props else (("k", "v" * 150),))
        assert len(aliases._by_topic) <= maximum


# ---------------------------------------------------------------- through the server


def gmqtt_listen(
    port: int, topic_filter: str, count: int, ready: threading.Event, got: list[tuple[str, bytes]]
) -> None:
    """A gmqtt 5.0 client allowing 3 topic aliases: what it hears, until ``count`` or 10 s."""

    async def main() -> None:
        client = gmqtt.Client("aliased", topic_alias_maximum=3)
        done = asyncio.Event()

        def on_message(client: Any, topic: str, payload: bytes, qos: int, properties: Any) -> int:
            got.append((topic, payload))
            if len(got) >= count:
                done.set()
            return 0

        client.on_message = on_message
        await client.connect("127.0.0.1", port, keepalive=30)
        client.subscribe(topic_filter, qos=1)
        await asyncio.sleep(0.3)
        ready.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 10)
        await client.disconnect()

    asyncio.run(main())


@pytest.mark.parametrize("engine", ENGINES)
def test_gmqtt_hears_every_topic_through_the_servers_aliases(
    start_server: Any, clients: list[Paho5], engine: str
) -> None:
    server: Server = start_server("--engine", engine)
    topics = [f"tele/building-7/room-{i % 5}/temperature" for i in range(20)]
    got: list[tuple[str, bytes]] = []
    ready = threading.Event()
    listener = threading.Thread(target=gmqtt_listen, args=(server.port, "tele/#", len(topics), ready, got))
    listener.start()
    try:
        assert ready.wait(10)
        device = Paho5(server.port, "thermostats")
        clients.append(device.start())
        for i, topic in enumerate(topics):
            device.client.publish(topic, str(i).encode(), qos=i % 2).wait_for_publish(5)
    finally:
        listener.join(15)
    assert got == [(t, str(i).encode()) for i, t in enumerate(topics)]


@pytest.mark.parametrize("engine", ENGINES)
def test_on_the_wire_aliases_only_for_a_client_that_allows_them(start_server: Any, engine: str) -> None:
    server: Server = start_server("--engine", engine)
    allows = raw5(server.port, "allows", topic_alias_maximum=2)
    plain = raw5(server.port, "plain")
    for sub in (allows, plain):
        sub.send(Subscribe(1, (Subscription("wire/#", 1),)))
        assert sub.read() == Suback(1, (1,))
    pub = raw5(server.port, "pub")
    sent = ["wire/alpha", "wire/alpha", "wire/beta", "wire/gamma", "wire/alpha"]
    for i, topic in enumerate(sent, start=1):
        pub.send(Publish(topic, b"m%d" % i, 1, packet_id=i))
        assert pub.read() == Ack(PUBACK, i)
    heard = allows.publishes(5)
    resolver = Resolver(2)
    assert [resolver.topic(p) for p in heard] == sent
    assert [(p.topic, p.properties.topic_alias) for p in heard] == [
        ("wire/alpha", 1),
        ("", 1),
        ("wire/beta", 2),
        ("wire/gamma", 1),  # alpha was least recently used: its alias goes to gamma
        ("wire/alpha", 2),
    ]
    for p in heard:
        allows.send(Ack(PUBACK, p.packet_id or 0))
    assert [(p.topic, p.properties.topic_alias) for p in plain.publishes(5)] == [(t, None) for t in sent]


def test_outbound_aliases_can_be_turned_off(start_server: Any) -> None:
    server: Server = start_server("--outbound-topic-aliases", "off")
    allows = raw5(server.port, "allows", topic_alias_maximum=5)
    allows.send(Subscribe(1, (Subscription("off/#", 0),)))
    assert allows.read() == Suback(1, (0,))
    pub = raw5(server.port, "pub")
    for _ in range(3):
        pub.send(Publish("off/topic", b"x"))
    time.sleep(0.1)
    assert [(p.topic, p.properties.topic_alias) for p in allows.publishes(3)] == [("off/topic", None)] * 3
