"""The heartbeat server in-process, driven by raw MQTT over real loopback sockets, under MockClock."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families
from trio.testing import MockClock

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.coordination.inprocess import InProcessCoordinator
from servers.heartbeat.mqtt import encoders, packets
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.policy import LEGACY_PRESENCE_PREFIX
from servers.heartbeat.mqtt.reader import PacketReader
from servers.heartbeat.presence.event import PresenceEvent
from servers.heartbeat.security.passwords import PasswordFile
from servers.heartbeat.server.connection import SUBSCRIBED
from servers.heartbeat.server.lifecycle import HeartbeatServer
from servers.heartbeat.transports.dense import DenseConnection
from servers.heartbeat.worker import serve_heartbeat

TICK = 0.1


class Client:
    """A minimal MQTT client over a trio stream, for tests."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    @classmethod
    async def connect(
        cls, port: int, client_id: str = "", keep_alive: int = 60, expect: int | None = 0, **kw: object
    ) -> Client:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await client.stream.send_all(encoders.encode_connect(client_id, keep_alive=keep_alive, **kw))  # type: ignore[arg-type]
        if expect is not None:
            assert await client.read(4) == encoders.encode_connack(False, expect)
        return client

    async def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = await self.stream.receive_some()
            if not data:
                raise EOFError(f"closed with {self.buf!r} buffered")
            self.buf += data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def read_packet(self) -> bytes:
        head = await self.read(2)
        length, shift, byte = 0, 0, head[1]
        extra = b""
        while True:
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            b = await self.read(1)
            extra += b
            byte = b[0]
        return head + extra + await self.read(length)

    async def closed(self) -> bool:
        try:
            while True:
                data = await self.stream.receive_some()
                if not data:
                    return True
                self.buf += data
        except trio.BrokenResourceError:
            return True

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)


def publish_topic(packet: bytes) -> tuple[str, bytes]:
    reader = PacketReader()
    # Parse a server-to-client PUBLISH by reusing the client-side parser (same layout).
    (pub,) = reader.feed(packet)
    assert isinstance(pub, packets.Publish)
    return pub.topic, pub.payload


_ENGINE = ["dense"]


async def retained_topic(client: Client) -> str:
    """The topic of the next packet, which must be a retained PUBLISH (a presence a new
    subscription is owed)."""
    packet = await client.read_packet()
    assert packet[0] & 0xF1 == 0x31, packet
    return publish_topic(packet)[0]


@pytest.fixture(autouse=True, params=["dense", "streams"])
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here runs on both engines: the same MQTT behaviour either way."""
    _ENGINE[0] = request.param
    yield request.param
    _ENGINE[0] = "dense"


@asynccontextmanager
async def running(config: HeartbeatConfig | None = None) -> AsyncIterator[tuple[HeartbeatServer, list[PresenceEvent]]]:
    events: list[PresenceEvent] = []
    cfg = config or HeartbeatConfig(port=0, tick=TICK, connect_timeout=5)
    cfg.port = 0
    cfg.tick = TICK
    cfg.engine = _ENGINE[0]
    cfg.extra_sinks.append(events.append)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_heartbeat, cfg))
        yield server, events
        nursery.cancel_scope.cancel()


async def test_connect_ping_publish_and_presence(clock: MockClock) -> None:
    async with running() as (server, events):
        watcher = await Client.connect(server.port, "dashboard")
        await watcher.send(encoders.encode_subscribe(1, [(f"{PRESENCE}#", 0), ("sensors/+/temp", 1)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0, 1])
        assert await retained_topic(watcher) == f"{PRESENCE}dashboard"  # its own, retained
        device = await Client.connect(server.port, "dev-1", keep_alive=10)
        topic, payload = publish_topic(await watcher.read_packet())
        assert topic == f"{PRESENCE}dev-1"
        assert json.loads(payload)["status"] == "online"
        await device.send(encoders.encode_pingreq())
        assert await device.read(2) == encoders.encode_pingresp()
        await device.send(encoders.encode_publish("sensors/dev-1/temp", b"21.5"))
        await device.send(encoders.encode_publish("sensors/dev-1/temp", b"21.6", qos=1, packet_id=7))
        assert await device.read(4) == encoders.encode_puback(7)
        assert publish_topic(await watcher.read_packet()) == ("sensors/dev-1/temp", b"21.5")
        packet = await watcher.read_packet()
        assert packet[0] == 0x32  # delivered at QoS 1
        await device.send(encoders.encode_disconnect())
        assert await device.closed()
        topic, payload = publish_topic(await watcher.read_packet())
        offline = json.loads(payload)
        assert (topic, offline["status"], offline["reason"]) == (f"{PRESENCE}dev-1", "offline", "disconnect")
        record = await server.lookup("devices", "dev-1")
        assert isinstance(record, dict) and record["status"] == "offline"
    assert [(e.client_id, e.status) for e in events][:3] == [
        ("dashboard", "online"),
        ("dev-1", "online"),
        ("dev-1", "offline"),
    ]


async def test_the_engine_answers_a_pingreq_only_where_the_session_would(clock: MockClock, engine: str) -> None:
    """A PINGREQ alone on a connected session is answered by the dense engine itself,
    and is activity and a counted packet all the same; before CONNECT, or as bytes of a
    packet that is half-read, it is not: there it is the session's to judge. (The
    streams engine's session answers every one.)"""

    def answered(server: HeartbeatServer) -> int:
        return 0 if server.engine is None else server.engine.canned

    in_engine = 1 if engine == "dense" else 0
    async with running() as (server, _events):
        watcher = await Client.connect(server.port, "watcher")
        await watcher.send(encoders.encode_subscribe(1, [("t/#", 0)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0])
        device = await Client.connect(server.port, "dev-ping", keep_alive=4)
        before = server.packets_in()
        for _ in range(3):  # at 3, 6, 9: each keeps a 6 s keep-alive deadline away
            await trio.sleep(3)
            await device.send(encoders.encode_pingreq())
            assert await device.read(2) == encoders.encode_pingresp()
        assert answered(server) == 3 * in_engine
        assert server.packets_in() == before + 3
        # A PUBLISH whose payload ends in c0 00, sent in two reads: the second, alone
        # in its read, is not a PINGREQ.
        wire = encoders.encode_publish("t/x", b"\xc0\x00")
        await device.send(wire[:-2])
        await trio.testing.wait_all_tasks_blocked()
        await device.send(wire[-2:])
        assert publish_topic(await watcher.read_packet()) == ("t/x", b"\xc0\x00")
        await device.send(encoders.encode_pingreq())
        assert await device.read(2) == encoders.encode_pingresp()  # nothing came before it
        assert answered(server) == 4 * in_engine
        assert server.packets_in() == before + 5
        # Silent from now: expired 1.5 x 4 s after its last PINGREQ, which was activity.
        last = trio.current_time()
        assert await device.closed()
        assert last + 6 <= trio.current_time() < last + 6 + TICK
    # Before CONNECT, a PINGREQ is a protocol error (MQTT-3.1.0-1), not a PINGRESP.
    async with running() as (server, _events):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(encoders.encode_pingreq())
        assert await stream.receive_some() == b""
        assert answered(server) == 0


async def test_coalesced_pings_wait_a_window_and_other_traffic_does_not(clock: MockClock, engine: str) -> None:
    """``coalesce_pings``: on the dense engine, a PINGREQ that comes alone is answered at
    once; while a fleet's PINGREQs come faster than one a window they are answered a
    window at a time (never later than the window), and a PUBLISH that comes meanwhile
    waits for the window's end, after which the QoS 1 flow is served as it comes. A
    device that falls silent is closed 1.5 keep-alives after its last PINGREQ was read,
    within a tick. The streams engine has no windows: the option changes nothing there."""
    cfg = HeartbeatConfig(port=0, tick=TICK, connect_timeout=5, coalesce_pings=0.5)
    windowed = engine == "dense"
    async with running(cfg) as (server, _events):
        watcher = await Client.connect(server.port, "watcher", keep_alive=60)
        await watcher.send(encoders.encode_subscribe(1, [("t/#", 1)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [1])
        device = await Client.connect(server.port, "dev-w", keep_alive=4)
        other = await Client.connect(server.port, "dev-v", keep_alive=60)
        fleet = [await Client.connect(server.port, f"fleet-{i}", keep_alive=60) for i in range(5)]
        alone = []
        for _ in range(3):
            await trio.sleep(1.3)  # a quiet spell: one PINGREQ, answered at once
            sent = trio.current_time()
            await device.send(encoders.encode_pingreq())
            assert await device.read(2) == encoders.encode_pingresp()
            alone.append(trio.current_time() - sent)
        assert max(alone) <= 1e-6

        async def pinging(client: Client, offset: float) -> None:
            # 5 devices, one PINGREQ each every 0.25 s: 20 a second, past one a window (2).
            await trio.sleep(offset)
            for _ in range(24):
                await client.send(encoders.encode_pingreq())
                assert await client.read(2) == encoders.encode_pingresp()
                await trio.sleep(0.25)

        async with trio.open_nursery() as nursery:
            for i, client in enumerate(fleet):
                nursery.start_soon(pinging, client, 0.05 * i)
            await trio.sleep(1.5)  # the pace is seen
            waits = []
            for _ in range(3):
                await trio.sleep(0.33)
                sent = trio.current_time()
                await other.send(encoders.encode_pingreq())
                assert await other.read(2) == encoders.encode_pingresp()
                waits.append(trio.current_time() - sent)
            assert max(waits) <= 0.5 + 1e-6  # never past the window
            assert (max(waits) >= 0.05) is windowed  # gathered
            await trio.sleep(0.1)
            sent = trio.current_time()
            await device.send(encoders.encode_publish("t/a", b"1"))
            assert publish_topic(await watcher.read_packet()) == ("t/a", b"1")
            first = trio.current_time() - sent
            assert first <= 0.5 + 1e-6 and (first > 1e-6) is windowed
            nursery.cancel_scope.cancel()
        for i in range(5):  # a QoS 1 flow, the fleet quiet: each acknowledged as it comes
            sent = trio.current_time()
            await device.send(encoders.encode_publish("t/b", b"x", qos=1, packet_id=i + 1))
            assert await device.read(4) == encoders.encode_puback(i + 1)
            assert trio.current_time() - sent <= 1e-6
            packet = await watcher.read_packet()
            assert packet[0] & 0xF6 == 0x32 and publish_topic(packet) == ("t/b", b"x")
            packet_id = int.from_bytes(packet[-3:-1], "big")
            await watcher.send(encoders.encode_puback(packet_id))
            await trio.sleep(0.2)
        await device.send(encoders.encode_pingreq())
        assert await device.read(2) == encoders.encode_pingresp()
        last = trio.current_time()  # read by now (its stamp: the mock clock has no kernel stamps)
        assert await device.closed()
        assert last + 6 <= trio.current_time() <= last + 6 + TICK + 1e-6
        assert server.engine is None or (server.engine.coalesce_canned, server.engine.canned_rate) == (0.5, 2.0)


async def test_a_window_of_acknowledgements_read_alone_is_taken_in_halves(clock: MockClock, engine: str) -> None:
    """A subscriber that answers a window of 8 with one write of 8 PUBACKs gets the
    next 8 in order, once each. On the dense engine, a read served alone in its pass is
    taken in two halves (the first half's refill leaves while the second is taken);
    two subscribers' windows read in one pass are each taken whole."""
    cfg = HeartbeatConfig(port=0, tick=TICK, connect_timeout=5, max_inflight=8)
    async with running(cfg) as (server, _events):
        calls: list[tuple[str, int]] = []
        take = server.acknowledged

        def spy(conn: Any, acks: Sequence[tuple[str, int]]) -> None:
            calls.append((conn.session.client_id, len(acks)))
            take(conn, acks)

        server.acknowledged = spy
        subs = {}
        for name in ("a", "b"):
            sub = subs[name] = await Client.connect(server.port, name)
            await sub.send(encoders.encode_subscribe(1, [(f"cmd/{name}", 1)]))
            assert await sub.read_packet() == encoders.encode_suback(1, [1])
        publisher = await Client.connect(server.port, "publisher")
        for name in subs:
            for i in range(16):
                await publisher.send(encoders.encode_publish(f"cmd/{name}", b"%d" % i, qos=1, packet_id=i + 1))
                assert await publisher.read_packet() == encoders.encode_puback(i + 1)

        async def window(name: str, first: int) -> bytes:
            """The next 8 messages, checked in order; their PUBACKs in one piece."""
            got = [PacketReader().feed(await subs[name].read_packet())[0] for _ in range(8)]
            assert [(p.topic, p.payload) for p in got] == [(f"cmd/{name}", b"%d" % i) for i in range(first, first + 8)]  # type: ignore[union-attr]
            return b"".join(encoders.encode_puback(p.packet_id) for p in got)  # type: ignore[union-attr,arg-type]

        acks = {name: await window(name, 0) for name in subs}
        await subs["a"].send(acks["a"])  # alone: nothing else is served meanwhile
        acks["a"] = await window("a", 8)
        # Both at once, with no checkpoint between: one pass serves the two.
        os.write(subs["a"].stream.socket.fileno(), acks["a"])
        os.write(subs["b"].stream.socket.fileno(), acks["b"])
        acks["b"] = await window("b", 8)
        await trio.testing.wait_all_tasks_blocked()
        if engine == "dense":
            assert calls[:2] == [("a", 4), ("a", 4)]
            assert sorted(calls[2:]) == [("a", 8), ("b", 8)]


async def test_a_persistent_session_kept_elsewhere_takes_its_acknowledgements_whole(
    clock: MockClock, engine: str
) -> None:
    """Halves help only where the refill is made in the pass: a persistent session whose
    coordinator keeps it here (in-process) is taken in halves; one whose coordinator keeps
    it in another process (the supervisor, Redis: ``refills_here`` False) whole, since
    each half would be a round trip of its own. Either way every message comes, in order."""
    cfg = HeartbeatConfig(port=0, tick=TICK, connect_timeout=5, max_inflight=8)
    async with running(cfg) as (server, _events):
        calls: list[int] = []
        take = server.acknowledged

        def spy(conn: Any, acks: Sequence[tuple[str, int]]) -> None:
            calls.append(len(acks))
            take(conn, acks)

        server.acknowledged = spy
        dev = await Client.connect(server.port, "dev", clean_session=False)
        await dev.send(encoders.encode_subscribe(1, [("cmd/dev", 1)]))
        assert await dev.read_packet() == encoders.encode_suback(1, [1])
        publisher = await Client.connect(server.port, "publisher")
        for i in range(24):
            await publisher.send(encoders.encode_publish("cmd/dev", b"%d" % i, qos=1, packet_id=i + 1))
            assert await publisher.read_packet() == encoders.encode_puback(i + 1)
        assert server.coordinator.refills_here
        for first, elsewhere in ((0, False), (8, True)):
            server.coordinator.refills_here = elsewhere is False
            got = [PacketReader().feed(await dev.read_packet())[0] for _ in range(8)]
            assert [p.payload for p in got] == [b"%d" % i for i in range(first, first + 8)]  # type: ignore[union-attr]
            del calls[:]
            await dev.send(b"".join(encoders.encode_puback(p.packet_id) for p in got))  # type: ignore[union-attr,arg-type]
            await trio.testing.wait_all_tasks_blocked()
            if engine == "dense":
                assert calls == ([8] if elsewhere else [4, 4])
        got = [PacketReader().feed(await dev.read_packet())[0] for _ in range(8)]
        assert [p.payload for p in got] == [b"%d" % i for i in range(16, 24)]  # type: ignore[union-attr]


async def test_silent_device_expires_at_one_and_a_half_keepalive_with_will(clock: MockClock) -> None:
    async with running() as (server, _events):
        watcher = await Client.connect(server.port, "watcher", keep_alive=0)
        await watcher.send(encoders.encode_subscribe(1, [(f"{PRESENCE}#", 0), ("wills/#", 0)]))
        await watcher.read_packet()
        assert await retained_topic(watcher) == f"{PRESENCE}watcher"
        device = await Client.connect(
            server.port, "dead-1", keep_alive=4, will_topic="wills/dead-1", will_message=b"gone"
        )
        await watcher.read_packet()  # its online event
        await trio.sleep(3)
        await device.send(encoders.encode_pingreq())  # last sign of life
        await device.read(2)
        last = trio.current_time()
        assert await device.closed()  # socket left open by the device, closed by the server
        closed_at = trio.current_time()
        assert last + 6 <= closed_at < last + 6 + TICK
        got = {publish_topic(await watcher.read_packet()) for _ in range(2)}
        assert ("wills/dead-1", b"gone") in got
        (offline,) = [json.loads(p) for t, p in got if t == f"{PRESENCE}dead-1"]
        assert offline["reason"] == "keepalive-timeout"
        assert 6 <= offline["silent_for"] < 6 + TICK
    assert server.offline_by_reason["keepalive-timeout"] == 1


@pytest.mark.parametrize(("vetting", "expires_after"), [(2.0, 15.0), (5.0, 17.5)])
async def test_keepalive_counts_from_the_connect_not_from_when_it_was_handled(
    clock: MockClock, monkeypatch: pytest.MonkeyPatch, vetting: float, expires_after: float
) -> None:
    """A CONNECT handled late (a password check, or a coalescing engine's window) does
    not move a silent device's deadline: 1.5 K from the CONNECT, as MQTT says. Only a
    quarter of K back, though: a client that times its first PINGREQ from a CONNACK
    delayed longer (a stall) still gets 1.25 K after it."""

    async def slow_check(self: HeartbeatServer, conn: object, request: object) -> int:
        await trio.sleep(vetting)
        return 0

    monkeypatch.setattr(HeartbeatServer, "authenticate", slow_check)
    async with running(HeartbeatConfig(auth=PasswordFile())) as (server, _):
        sent = trio.current_time()
        device = await Client.connect(server.port, "late", keep_alive=10)
        assert trio.current_time() - sent >= vetting
        assert await device.closed()
        assert sent + expires_after <= trio.current_time() < sent + expires_after + TICK


async def test_keepalive_zero_is_capped_by_max_idle(clock: MockClock) -> None:
    cfg = HeartbeatConfig(max_idle=50)
    async with running(cfg) as (server, _):
        device = await Client.connect(server.port, "lazy", keep_alive=0)
        start = trio.current_time()
        assert await device.closed()
        assert 50 <= trio.current_time() - start < 50 + TICK


async def test_keepalive_is_capped_by_server(clock: MockClock) -> None:
    cfg = HeartbeatConfig(max_keepalive=10)
    async with running(cfg) as (server, _):
        device = await Client.connect(server.port, "sleepy", keep_alive=600)
        start = trio.current_time()
        assert await device.closed()
        assert 15 <= trio.current_time() - start < 15 + TICK


async def test_connect_timeout_and_empty_client_id(clock: MockClock) -> None:
    async with running() as (server, events):
        mute = Client(await trio.open_tcp_stream("127.0.0.1", server.port))
        start = trio.current_time()
        anonymous = await Client.connect(server.port, "")  # mosquitto_pub's default
        assert len(server.online) == 1
        (assigned,) = server.online
        assert assigned.startswith("auto-")
        assert await mute.closed()
        assert 5 <= trio.current_time() - start < 5 + TICK
        await anonymous.send(encoders.encode_disconnect())
    (timed_out,) = [e for e in events if e.reason is Offline.CONNECT_TIMEOUT]
    assert timed_out.client_id is None
    assert 5 <= timed_out.silent_for < 5 + TICK  # counted from accept: it never sent a byte


async def test_takeover_closes_the_old_connection(clock: MockClock) -> None:
    async with running() as (server, events):
        first = await Client.connect(server.port, "dup", will_topic="w/dup", will_message=b"x")
        second = await Client.connect(server.port, "dup")
        assert await first.closed()
        assert server.online["dup"] is not None
        await second.send(encoders.encode_pingreq())
        assert await second.read(2) == encoders.encode_pingresp()
    offline = [e for e in events if e.status == "offline" and e.client_id == "dup"]
    assert offline[0].reason is Offline.TAKEOVER


async def test_a_connect_vetted_after_a_newer_one_of_its_id_does_not_take_the_session(
    clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A device gave up on a connection whose CONNECT was slow to vet and connected
    # again; the old CONNECT's check ends last. MQTT's takeover is by the newer
    # connection, so the old one is closed unanswered and the device's session stays.
    checks: list[str] = []
    waiting, release = trio.Event(), trio.Event()

    async def first_check_waits(self: HeartbeatServer, conn: object, request: object) -> int:
        checks.append("check")
        if len(checks) == 1:
            waiting.set()
            await release.wait()
        return 0

    monkeypatch.setattr(HeartbeatServer, "authenticate", first_check_waits)
    async with running(HeartbeatConfig(auth=PasswordFile())) as (server, events):
        abandoned = await Client.connect(server.port, "dup", expect=None, will_topic="w/dup", will_message=b"x")
        await waiting.wait()
        current = await Client.connect(server.port, "dup")
        release.set()
        assert await abandoned.closed()
        assert abandoned.buf == b""  # no CONNACK: it was never the session
        await current.send(encoders.encode_pingreq())
        assert await current.read(2) == encoders.encode_pingresp()
        assert server.offline_by_reason["superseded"] == 1
        assert server.counters["wills_published"] == 0
    mine = [(e.status, e.reason) for e in events if e.client_id == "dup"]
    assert mine[0] == ("online", None) and ("offline", Offline.TAKEOVER) not in mine
    # Logged, as refusals are: not presence (no client id), the id only claimed.
    [dropped] = [e for e in events if e.claimed_client_id == "dup"]
    assert (dropped.status, dropped.reason, dropped.client_id) == ("refused", Offline.SUPERSEDED, None)


async def test_a_connection_that_ends_while_its_connect_is_vetted_is_logged_once_and_not_as_presence(
    clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by the fuzz run (issue 29): a connection that ended between its CONNECT and
    # the CONNACK, while its password was checked, left no record at all, so the log
    # could not account for every connection. It was never the device it named: its
    # end is a record apart from presence, with the id only claimed.
    waiting = trio.Event()

    async def check_never_ends(self: HeartbeatServer, conn: object, request: object) -> int:
        waiting.set()
        await trio.sleep_forever()
        return 0

    monkeypatch.setattr(HeartbeatServer, "authenticate", check_never_ends)
    async with running(HeartbeatConfig(auth=PasswordFile())) as (server, events):
        await Client.connect(server.port, "phone", expect=None, will_topic="w/phone", will_message=b"x")
        await waiting.wait()
    # The server stopped with the check under way.
    mine = [e for e in events if "phone" in (e.client_id, e.claimed_client_id)]
    assert [(e.status, e.reason, e.client_id) for e in mine] == [("refused", Offline.SHUTDOWN, None)]
    assert server.counters["wills_published"] == 0


async def test_a_message_sent_live_while_retained_ones_are_read_is_not_sent_again_as_retained(
    clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by a loaded test run: a subscription's retained messages are read in a task
    # after the SUBACK; a device that came online (or a retained PUBLISH) in between was
    # sent live, then again from the store, and a dashboard saw it come online twice.
    reading, go_on = trio.Event(), trio.Event()
    read = InProcessCoordinator.retained

    async def slow_read(self: InProcessCoordinator, topic_filter: str, cursor: str | None) -> object:
        if topic_filter.startswith(PRESENCE) or topic_filter == "data/#":
            reading.set()
            await go_on.wait()
        return await read(self, topic_filter, cursor)

    monkeypatch.setattr(InProcessCoordinator, "retained", slow_read)
    async with running() as (server, _):
        old = await Client.connect(server.port, "old-lamp", keep_alive=60)
        await old.send(encoders.encode_publish("data/old", b"kept", retain=True))
        watcher = await Client.connect(server.port, "dashboard", keep_alive=60)
        await watcher.send(encoders.encode_subscribe(1, [(f"{PRESENCE}#", 0), ("data/#", 0)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0, 0])
        await reading.wait()
        lamp = await Client.connect(server.port, "lamp", keep_alive=60)  # online while the read waits
        await lamp.send(encoders.encode_publish("data/x", b"1", retain=True))
        await trio.sleep(1)
        go_on.set()
        got = await heard_all(watcher, 2.0)
        topics = [t for t, _ in got]
        assert topics.count(f"{PRESENCE}lamp") == 1, got  # live, and not again as retained
        assert topics.count("data/x") == 1, got
        # What was retained before the subscription still comes, once.
        assert topics.count(f"{PRESENCE}old-lamp") == 1 and topics.count("data/old") == 1, got
        assert server.broker.retained_resent_skipped == 2
        assert not server.broker.sent_live  # the window closed with the last retained page


async def heard_all(client: Client, seconds: float) -> list[tuple[str, bytes]]:
    """Every PUBLISH ``client`` reads within ``seconds`` (the clock is mocked)."""
    out: list[tuple[str, bytes]] = []
    with trio.move_on_after(seconds):
        while True:
            out.append(publish_topic(await client.read_packet()))
    return out


BAD_INPUTS = {
    "truncated packet then silence": encoders.encode_connect("t", keep_alive=5)[:-3],
    "oversized packet": b"\x30\xff\xff\xff\x7f",
    "5-byte varint": b"\x30\xff\xff\xff\xff\x01",
    "reserved flag bits": b"\x12\x00",
    "protocol level 3 named MQTT": encoders.encode_connect("old", protocol_level=3),
    "protocol level 6": encoders.encode_connect("new", protocol_level=6),
    # A 5.0 CONNECT laid out as 3.1.1's (no property length): refused as 5.0, malformed.
    "5.0 connect without properties": encoders.encode_connect("new", protocol_level=5),
    "publish before connect": encoders.encode_publish("a/b", b"x"),
    "random bytes": bytes(range(7, 250, 3)),
    "http request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "second connect": encoders.encode_connect("twice") + encoders.encode_connect("twice"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
async def test_bad_input_closes_only_that_connection(name: str, clock: MockClock) -> None:
    async with running() as (server, events):
        healthy = await Client.connect(server.port, "healthy", keep_alive=30)
        bad = Client(await trio.open_tcp_stream("127.0.0.1", server.port))
        await bad.send(BAD_INPUTS[name])
        assert await bad.closed()
        if "level" in name:
            assert bad.buf == encoders.encode_connack(False, 1)  # the spec's refusal code
        if "5.0" in name:
            assert bad.buf == b"\x20\x03\x00\x81\x00"  # 5.0's CONNACK: Malformed Packet
        for _ in range(3):
            await healthy.send(encoders.encode_pingreq())
            assert await healthy.read(2) == encoders.encode_pingresp()
            await trio.sleep(10)
        assert list(server.online) == ["healthy"]
    reasons = {e.reason for e in events if e.client_id != "healthy" and e.status == "offline"}
    assert reasons <= {Offline.PROTOCOL_ERROR, Offline.CONNECT_TIMEOUT, Offline.KEEPALIVE_TIMEOUT}
    assert reasons


async def test_packets_split_and_coalesced(clock: MockClock) -> None:
    async with running() as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        data = (
            encoders.encode_connect("splitter", keep_alive=30)
            + encoders.encode_pingreq()
            + encoders.encode_publish("x/y", b"1", qos=1, packet_id=3)
            + encoders.encode_disconnect()
        )
        for i in range(len(data)):
            await stream.send_all(data[i : i + 1])
        got = b""
        while chunk := await stream.receive_some():
            got += chunk
        assert got == encoders.encode_connack(False, 0) + encoders.encode_pingresp() + encoders.encode_puback(3)


async def test_trickled_packet_cannot_keep_a_dead_device_alive(clock: MockClock) -> None:
    async with running() as (server, events):
        device = await Client.connect(server.port, "trickler", keep_alive=2)
        start = trio.current_time()
        packet = encoders.encode_publish("t", b"x" * 100)
        with trio.move_on_after(60):
            try:
                for byte in packet:  # a byte a second: never a complete packet
                    await device.send(bytes([byte]))
                    await trio.sleep(1)
            except trio.BrokenResourceError:
                pass  # the server hung up (with our unread bytes: a reset)
        assert await device.closed()
        assert trio.current_time() - start < 3 + 1 + TICK
    assert [e.reason for e in events if e.client_id == "trickler"][-1] is Offline.KEEPALIVE_TIMEOUT


async def test_auth_and_connection_cap(clock: MockClock) -> None:
    users = PasswordFile.from_lines([])
    users.set("alice", b"s3cret", iterations=1000)
    # Credentials are checked in a worker thread; under the mock clock no deadline may
    # be pending meanwhile, or the clock would jump to it: keep-alive 0, no idle cap.
    cfg = HeartbeatConfig(auth=users, max_connections=1, max_idle=None)
    async with running(cfg) as (server, events):
        await Client.connect(server.port, "no-creds", keep_alive=0, expect=5)
        await Client.connect(server.port, "wrong", keep_alive=0, username="alice", password=b"nope", expect=4)
        ok = await Client.connect(server.port, "ok", keep_alive=0, username="alice", password=b"s3cret", expect=0)
        await Client.connect(server.port, "full", keep_alive=0, username="alice", password=b"s3cret", expect=3)
        await ok.send(encoders.encode_pingreq())
        assert await ok.read(2) == encoders.encode_pingresp()
        assert server.counters["auth_failures"] == 2
        assert server.counters["refused_capacity"] == 1
    assert sum(1 for e in events if e.reason is Offline.REFUSED) == 3


async def test_shutdown_emits_offline_for_everyone(clock: MockClock) -> None:
    events: list[PresenceEvent] = []
    cfg = HeartbeatConfig(port=0, tick=TICK, engine=_ENGINE[0])
    cfg.extra_sinks.append(events.append)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_heartbeat, cfg))
        clients = [await Client.connect(server.port, f"d{i}") for i in range(5)]
        nursery.cancel_scope.cancel()
    for client in clients:
        assert await client.closed()
    assert sorted(e.client_id or "" for e in events if e.reason is Offline.SHUTDOWN) == [f"d{i}" for i in range(5)]


async def test_graceful_shutdown_tells_subscribers_before_closing_them(clock: MockClock) -> None:
    """SIGTERM's path: devices end first, every subscriber hears each one go offline,
    then the subscribers are closed (cancelling alone would close them at once)."""
    events: list[PresenceEvent] = []
    cfg = HeartbeatConfig(port=0, tick=TICK, engine=_ENGINE[0])
    cfg.extra_sinks.append(events.append)
    n = 200
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_heartbeat, cfg))
        watchers = [await Client.connect(server.port, f"dashboard-{i}") for i in range(2)]
        for watcher in watchers:
            await watcher.send(encoders.encode_subscribe(1, [(f"{PRESENCE}+", 0)]))
            assert await watcher.read_packet() == encoders.encode_suback(1, [0])
        devices = [await Client.connect(server.port, f"d{i}") for i in range(n)]
        for watcher in watchers:  # every device's online event has arrived
            while publish_topic(await watcher.read_packet())[0] != f"{PRESENCE}d{n - 1}":
                pass
        await server.shutdown()
        heard: list[set[str]] = []
        for watcher in watchers:
            offline: set[str] = set()
            with contextlib.suppress(EOFError):
                while True:
                    topic, payload = publish_topic(await watcher.read_packet())
                    event = json.loads(payload)
                    if event["status"] == "offline" and event["reason"] == "shutdown":
                        offline.add(topic.removeprefix(PRESENCE))
            heard.append(offline)
        nursery.cancel_scope.cancel()
    expected = {f"d{i}" for i in range(n)}
    assert all(offline >= expected for offline in heard)  # each device, to each dashboard
    for device in devices:
        assert await device.closed()
    ended = [e.client_id or "" for e in events if e.status == "offline" and e.reason is Offline.SHUTDOWN]
    assert sorted(ended) == sorted([*expected, "dashboard-0", "dashboard-1"])  # exactly once each
    with pytest.raises(OSError):  # no new connections once the shutdown began
        await trio.open_tcp_stream("127.0.0.1", server.port)


async def test_metrics_text(clock: MockClock) -> None:
    async with running() as (server, _):
        await Client.connect(server.port, "m1")
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(server.metrics().decode())
            for sample in family.samples
        }
        worker = (("worker", "0"),)
        assert samples[("heartbeat_devices_online", worker)] == 1
        assert samples[("heartbeat_connections_total", worker)] == 1
        assert samples[("heartbeat_offline_total", (("reason", "keepalive-timeout"), *worker))] == 0
        assert ("idlekeeper_reaper_lag_seconds_bucket", (("le", "+Inf"), *worker)) in samples
        assert samples[("process_resident_memory_bytes", ())] > 0


async def test_device_records_are_bounded(clock: MockClock) -> None:
    cfg = HeartbeatConfig(max_device_records=3)
    async with running(cfg) as (server, _):
        keeper = await Client.connect(server.port, "stays-online")
        for i in range(6):
            c = await Client.connect(server.port, f"gone-{i}")
            await c.send(encoders.encode_disconnect())
            assert await c.closed()
        anonymous = await Client.connect(server.port, "")
        await anonymous.send(encoders.encode_disconnect())
        assert await anonymous.closed()
        await trio.testing.wait_all_tasks_blocked()
        coordinator = server.coordinator
        assert isinstance(coordinator, InProcessCoordinator)
        devices = {e.client_id for e in coordinator.registry}
        assert len(devices) <= 3
        assert "stays-online" in devices  # online devices are never forgotten
        assert "gone-5" in devices and "gone-0" not in devices
        assert not any(str(k).startswith("auto-") for k in devices)
        await keeper.send(encoders.encode_pingreq())
        assert await keeper.read(2) == encoders.encode_pingresp()


@pytest.mark.parametrize("prefix", [PRESENCE, LEGACY_PRESENCE_PREFIX, "status/"])
async def test_devices_cannot_forge_presence_under_the_configured_prefix(prefix: str, clock: MockClock) -> None:
    async with running(HeartbeatConfig(presence_prefix=prefix)) as (server, _):
        watcher = await Client.connect(server.port, "dashboard")
        await watcher.send(encoders.encode_subscribe(1, [(prefix + "#", 0)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0])
        assert await retained_topic(watcher) == prefix + "dashboard"
        victim = await Client.connect(server.port, "victim")
        assert publish_topic(await watcher.read_packet())[0] == prefix + "victim"
        forger = await Client.connect(server.port, "forger")
        assert publish_topic(await watcher.read_packet())[0] == prefix + "forger"
        forger_conn = server.online["forger"]
        forged = json.dumps({"status": "offline", "client_id": "victim", "reason": "disconnect"}).encode()
        await forger.send(encoders.encode_publish(prefix + "victim", forged, qos=1, packet_id=1))
        assert await forger.read(4) == encoders.encode_puback(1)  # acknowledged, then dropped
        await forger.send(encoders.encode_disconnect())
        assert await forger.closed()
        # What the watcher hears next is the server's own event, not the forgery.
        topic, payload = publish_topic(await watcher.read_packet())
        assert (topic, json.loads(payload)["status"]) == (prefix + "forger", "offline")
        assert forger_conn.session.denied_publishes == 1
        assert "victim" in server.online
        await victim.send(encoders.encode_disconnect())


async def test_max_qos_comes_from_the_config(clock: MockClock) -> None:
    async with running(HeartbeatConfig(max_qos=0)) as (server, _):
        watcher = await Client.connect(server.port, "dashboard")
        await watcher.send(encoders.encode_subscribe(1, [("sensors/#", 1)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0])
        device = await Client.connect(server.port, "dev-1")
        await device.send(encoders.encode_publish("sensors/dev-1", b"21.5", qos=1, packet_id=3))
        assert await device.read(4) == encoders.encode_puback(3)
        assert await watcher.read_packet() == encoders.encode_publish("sensors/dev-1", b"21.5")  # at QoS 0
        await device.send(encoders.encode_disconnect())
    with pytest.raises(ValueError, match="max_qos"):
        HeartbeatConfig(max_qos=3)


async def test_dense_devices_arm_a_send_timeout_only_while_they_lag(clock: MockClock, engine: str) -> None:
    """An armed send timeout is re-checked by the reaper every period even when idle, so
    on the dense engine a device gets one only while its queue is over the high-water
    mark; a subscriber always has one (on either engine)."""
    async with running() as (server, _):
        device = await Client.connect(server.port, "quiet-device")
        watcher = await Client.connect(server.port, "watcher")
        await watcher.send(encoders.encode_subscribe(1, [(f"{PRESENCE}#", 0)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0])
        conns = {c.session.client_id: c for c in server.connections}
        assert conns["quiet-device"].stream.send_timeout is None
        assert conns["watcher"].stream.send_timeout == server.config.send_timeout
        dense = conns["quiet-device"]
        if not isinstance(dense, DenseConnection):
            assert engine == "streams"
            return
        dense.pause_writing()  # what the transport calls when the queue passes high water
        assert dense.stream.send_timeout == server.config.send_timeout
        dense.resume_writing()
        assert dense.stream.send_timeout is None
        await device.send(encoders.encode_pingreq())
        assert await device.read(2) == encoders.encode_pingresp()


async def test_a_takeover_during_the_connack_send_still_tells_both_sessions(
    clock: MockClock, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by ``python -m loadtest fuzz`` on the streams engine: a session was made,
    its CONNACK sent and only then announced; a takeover while the send yielded ended
    it unannounced, and neither its online nor its offline event was told."""
    import socket

    if engine == "streams":
        # A send that takes a moment (a slow link, TLS): the takeover lands inside it.
        from servers.heartbeat.transports.streams import StreamConnection

        send = StreamConnection._send

        async def slow_send(self: StreamConnection, data: bytes) -> None:
            await trio.sleep(0.01)
            await send(self, data)

        monkeypatch.setattr(StreamConnection, "_send", slow_send)
    async with running() as (server, events):
        first = socket.create_connection(("127.0.0.1", server.port))
        second = socket.create_connection(("127.0.0.1", server.port))
        connect = encoders.encode_connect("twin", keep_alive=30)
        # Back to back, before the server runs: both CONNECTs are read in one pass.
        first.sendall(connect)
        second.sendall(connect)
        await trio.sleep(1)
        first.setblocking(False)
        got = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := first.recv(64):
                got += chunk
        first.close()
        second.close()
        await trio.sleep(1)
    # The first may or may not have read its CONNACK before it was taken over.
    assert got in (b"", encoders.encode_connack(False, 0)), got
    twins = [(e.status, e.reason) for e in events if e.client_id == "twin"]
    # Each session the server made is told online once and offline once.
    assert twins.count(("online", None)) == 2, twins
    assert sorted(reason.value for status, reason in twins if status == "offline" and reason) == [
        "connection-lost",
        "takeover",
    ], twins


async def test_a_subscribe_read_before_a_takeover_does_not_outlive_the_session(
    clock: MockClock, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by ``python -m loadtest fuzz`` on the streams engine: a connection taken
    over while it was sending went on with the rest of its read, and a SUBSCRIBE in it
    left a dead subscriber in the broker for good."""
    if engine == "streams":
        from servers.heartbeat.transports.streams import StreamConnection

        send = StreamConnection._send

        async def slow_send(self: StreamConnection, data: bytes) -> None:
            await send(self, data)
            if data == encoders.encode_pingresp():
                # trio's send_all ends in a shielded checkpoint: a takeover landing
                # there does not cancel the send, and the task goes on with its read.
                with trio.CancelScope(shield=True):
                    await trio.sleep(1.0)

        monkeypatch.setattr(StreamConnection, "_send", slow_send)
    async with running() as (server, _events):
        first = await Client.connect(server.port, "twin", keep_alive=30)
        taken = server.online["twin"]
        # One write: the PINGREQ's reply is being sent when the takeover comes.
        await first.send(encoders.encode_pingreq() + encoders.encode_subscribe(1, [("t/#", 0)]))
        second = await Client.connect(server.port, "twin", keep_alive=30)
        await trio.sleep(5)  # the first has gone on with its read, if it would
        assert server.online["twin"] is not taken
        assert taken.finished
        assert not server.broker.subscriptions.has(taken)
        await second.send(encoders.encode_disconnect())


def test_a_dense_connection_keeps_its_size_class_and_its_flags_apart() -> None:
    conn = DenseConnection.__new__(DenseConnection)
    # The collector's header included: a slot more is the allocator's next size class
    # for every device (a million of them: 16 MB).
    assert sys.getsizeof(conn) <= 128
    conn._flags = 0
    conn.persistent = True
    conn.finished = True
    conn.persistent = False
    assert (conn.persistent, conn.finished, conn.subscriber) == (False, True, False)
    conn._flags |= SUBSCRIBED
    conn.finished = False
    assert (conn.persistent, conn.finished, conn.subscriber) == (False, False, True)
