"""``--retain-available false`` and ``--message-size-limit`` in the running server, on
both engines (MockClock, loopback sockets): what 3.1.1 and 5.0 clients get, that
subscribers and the retained store get nothing refused, and that presence stays
retained."""

from __future__ import annotations

import trio
from trio.testing import MockClock

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.v5.codec import pack, read_packets
from servers.heartbeat.mqtt.v5.packets import PUBACK, PUBREC, Ack, Connack, Connect, Disconnect, Publish, Will
from servers.heartbeat.mqtt.v5.reason_codes import ReasonCode

from .test_heartbeat import Client, engine, publish_topic, retained_topic, running

__all__ = ["engine"]  # the fixture: every test here runs on both engines

R = ReasonCode


async def connect5(port: int, connect: Connect) -> tuple[Client, object]:
    """A 5.0 client and what the server first answered (its CONNACK)."""
    client = Client(await trio.open_tcp_stream("127.0.0.1", port))
    await client.send(pack(connect))
    (answer,) = read_packets(await client.read_packet())
    return client, answer


async def watching(port: int, client_id: str = "dashboard") -> Client:
    """A subscriber to ``t/#``, which has heard nothing yet."""
    watcher = await Client.connect(port, client_id)
    await watcher.send(encoders.encode_subscribe(1, [("t/#", 1)]))
    assert await watcher.read_packet() == encoders.encode_suback(1, [1])
    return watcher


async def next_topic(watcher: Client) -> tuple[str, bool]:
    """The topic of the next PUBLISH the watcher gets, and whether it came retained."""
    packet = await watcher.read_packet()
    return publish_topic(packet)[0], bool(packet[0] & 0x01)


async def test_retain_unavailable_refuses_retained_publishes_and_wills(clock: MockClock) -> None:
    async with running(HeartbeatConfig(retain_available=False)) as (server, _):
        watcher = await watching(server.port)
        old = await Client.connect(server.port, "old")
        await old.send(encoders.encode_publish("t/r", b"x", qos=1, retain=True, packet_id=1))
        assert await old.closed()  # 3.1.1: closed unanswered, as Mosquitto
        new, connack = await connect5(server.port, Connect("new", 30))
        assert isinstance(connack, Connack) and connack.properties.retain_available == 0
        await new.send(pack(Publish("t/r", b"x", retain=True)))
        (goodbye,) = read_packets(await new.read_packet())
        assert isinstance(goodbye, Disconnect) and goodbye.reason_code == R.RETAIN_NOT_SUPPORTED
        assert await new.closed()
        willing = await Client.connect(
            server.port, "willing", expect=None, will_topic="t/w", will_message=b"bye", will_retain=True
        )
        assert await willing.closed() and not willing.buf
        _, refused = await connect5(server.port, Connect("willing5", 30, will=Will("t/w", b"bye", retain=True)))
        assert isinstance(refused, Connack) and refused.reason_code == R.RETAIN_NOT_SUPPORTED
        assert "willing" not in server.online and "willing5" not in server.online
        # An unretained PUBLISH goes; it is the first thing the watcher hears.
        plain = await Client.connect(server.port, "plain")
        await plain.send(encoders.encode_publish("t/ok", b"1"))
        assert await next_topic(watcher) == ("t/ok", False)
        # Nothing was retained: a new subscriber's first message is a live one ...
        late = await watching(server.port, "late")
        await plain.send(encoders.encode_publish("t/marker", b"2"))
        assert await next_topic(late) == ("t/marker", False)
        # ... but presence, the server's own, still is.
        await late.send(encoders.encode_subscribe(2, [(f"{PRESENCE}plain", 0)]))
        assert await late.read_packet() == encoders.encode_suback(2, [0])
        assert await retained_topic(late) == f"{PRESENCE}plain"


async def test_a_payload_over_the_limit_is_acknowledged_counted_and_dropped(clock: MockClock) -> None:
    async with running(HeartbeatConfig(message_size_limit=10)) as (server, _):
        watcher = await watching(server.port)
        big = b"y" * 11
        old = await Client.connect(server.port, "old")
        await old.send(encoders.encode_publish("t/big", big, retain=True))
        await old.send(encoders.encode_publish("t/big", big, qos=1, packet_id=1, retain=True))
        assert await old.read_packet() == encoders.encode_puback(1)
        await old.send(encoders.encode_publish("t/big", big, qos=2, packet_id=2))
        assert await old.read_packet() == encoders.encode_pubrec(2)
        await old.send(encoders.encode_pubrel(2))
        assert await old.read_packet() == encoders.encode_pubcomp(2)
        new, connack = await connect5(server.port, Connect("new", 30))
        assert isinstance(connack, Connack) and connack.reason_code == 0
        await new.send(pack(Publish("t/big", big, qos=1, packet_id=3)))
        assert await new.read_packet() == pack(Ack(PUBACK, 3, R.QUOTA_EXCEEDED))  # Mosquitto: 0x95, no PUBACK code
        await new.send(pack(Publish("t/big", big, qos=2, packet_id=4, retain=True)))
        assert await new.read_packet() == pack(Ack(PUBREC, 4, R.QUOTA_EXCEEDED))  # the exchange ends
        # At the limit it goes: the first thing the watcher hears.
        await old.send(encoders.encode_publish("t/fits", b"y" * 10, qos=1, packet_id=5))
        assert await old.read_packet() == encoders.encode_puback(5)
        assert await next_topic(watcher) == ("t/fits", False)
        assert server.counters["dropped_too_large"] == 5
        # Nothing retained: a new subscriber's first message is a live one.
        late = await watching(server.port, "late")
        await old.send(encoders.encode_publish("t/marker", b"2"))
        assert await next_topic(late) == ("t/marker", False)
        # A Will over the limit refuses the CONNECT: 5 in 3.1.1, 0x95 in 5.0, as Mosquitto.
        await Client.connect(server.port, "w", expect=5, will_topic="t/w", will_message=big)
        _, refused = await connect5(server.port, Connect("w5", 30, will=Will("t/w", big)))
        assert isinstance(refused, Connack) and refused.reason_code == R.PACKET_TOO_LARGE
        assert server.counters["dropped_too_large"] == 5
