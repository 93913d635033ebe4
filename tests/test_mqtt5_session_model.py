"""One client id's MQTT 5 session against a model of the specification (issue 58).

Hypothesis draws a sequence of what a device and the world do: CONNECT (Clean Start,
Session Expiry, a Will and its delay), DISCONNECT (0x00 or 0x04, with or without a new
Session Expiry, 0 to non-zero included), a dropped connection, a QoS 1 message published
to the device's topic, and time passing. The server runs in-process on real loopback
sockets under ``MockClock(autojump_threshold=0)``, on either engine. After each step
the CONNACK's session-present flag and the messages the device is given must be the
model's; at the end, the times the Will was published must be the model's.

The model is the specification's text, not the server's code:

- §3.1.2.4: Clean Start 1 discards the session; 0 resumes it if there is one.
- §3.1.2.11.2: the session outlives its connection by its Session Expiry Interval (at
  most the server's cap, told in CONNACK), which a DISCONNECT may change (§3.14.2.2.2:
  not from 0, a Protocol Error that closes the connection as a network failure would).
- §3.1.2.5 and §3.1.3.2.2: a Will is published when the connection closes without a
  DISCONNECT 0x00, after its Will Delay or when the session ends, whichever is first;
  not if the client connects again (Clean Start 0) before then; at once if a Clean
  Start 1 connection ends the session first.
- QoS 1 messages for an absent client wait in its session, and reach it on resume.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, assume, example, given, settings

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt.v5.codec import pack, read_packet
from servers.heartbeat.mqtt.v5.packets import (
    PUBACK,
    Ack,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Publish,
    Suback,
    Subscribe,
    Subscription,
    Will,
)
from servers.heartbeat.mqtt.v5.properties import Properties
from servers.heartbeat.mqtt.v5.reason_codes import ReasonCode
from servers.heartbeat.worker import serve_heartbeat

CAP = 5
"""The server's --session-expiry: the longest a session is kept."""
KEEP_ALIVE = 3600
TOPIC = "dev/in"
WILL_TOPIC = "will/dev"
MARGIN = 0.05
"""A decision within this of a deadline is left out: the model's clock is the client's,
the server's is a read later (never earlier)."""
TOLERANCE = 0.25
"""A Will's publication may be this much later than due (ticks, passes)."""


# ------------------------------------------------------------------- the operations


@dataclass(frozen=True)
class DoConnect:
    clean: bool
    expiry: int | None
    will_delay: int | None  # None: no Will


@dataclass(frozen=True)
class DoDisconnect:
    with_will: bool
    expiry: int | None


@dataclass(frozen=True)
class DoDrop:
    pass


@dataclass(frozen=True)
class DoPublish:
    pass


@dataclass(frozen=True)
class DoSleep:
    seconds: float


Op = DoConnect | DoDisconnect | DoDrop | DoPublish | DoSleep

expiries = st.sampled_from([None, 0, 1, 3, 8, 0xFFFFFFFF])
ops = st.one_of(
    st.builds(DoConnect, st.booleans(), expiries, st.sampled_from([None, 0, 2, 4, 9])),
    st.builds(DoDisconnect, st.booleans(), st.sampled_from([None, 0, 2, 6])),
    st.just(DoDrop()),
    st.just(DoPublish()),
    st.builds(DoSleep, st.sampled_from([0.4, 1.3, 2.6, 5.2])),
)


# ------------------------------------------------------------------------ the model


@dataclass
class Stored:
    expiry: int
    left_at: float | None = None  # None while connected
    queue: list[bytes] = field(default_factory=list)


@dataclass
class Model:
    now: float = 0.0
    session: Stored | None = None
    connected: bool = False
    asked: int = 0  # the connection's CONNECT Session Expiry (absent: 0)
    will_delay: int | None = None
    will_due: float | None = None
    wills: list[float] = field(default_factory=list)

    def _expire(self) -> None:
        s = self.session
        if s is not None and s.left_at is not None:
            due = s.left_at + s.expiry
            assume(abs(self.now - due) > MARGIN)
            if self.now > due:
                self.session = None

    def _fire(self) -> None:
        if self.will_due is not None:
            assume(abs(self.now - self.will_due) > MARGIN)
            if self.will_due < self.now:
                self.wills.append(self.will_due)
                self.will_due = None

    def connect(self, op: DoConnect) -> tuple[bool, list[bytes]]:
        """session-present, and the queued messages the device is owed."""
        self._fire()
        self._expire()
        if self.will_due is not None:  # back before the Will went
            if op.clean:
                self.wills.append(self.now)  # the session ends: its Will goes now
            self.will_due = None
        if op.clean:
            self.session = None
        expiry = min(op.expiry or 0, CAP)
        present = self.session is not None
        owed: list[bytes] = []
        if self.session is None:
            self.session = Stored(expiry)
        else:
            owed, self.session.queue = self.session.queue, []
            self.session.expiry = expiry
            self.session.left_at = None
        self.connected = True
        self.asked = op.expiry or 0
        self.will_delay = op.will_delay
        return present, owed

    def _closed(self, will: bool) -> None:
        s = self.session
        assert s is not None
        if will and self.will_delay is not None:
            self.will_due = self.now + min(self.will_delay, s.expiry)
            if self.will_due == self.now:
                self.wills.append(self.now)
                self.will_due = None
        s.left_at = self.now
        if s.expiry == 0:
            self.session = None
        self.connected = False

    def disconnect(self, op: DoDisconnect) -> bool:
        """Whether the server takes it (False: a Protocol Error, 0x82)."""
        assert self.session is not None
        if op.expiry and not self.asked:
            self._closed(will=True)  # closed by the server, as a network failure
            return False
        if op.expiry is not None:
            self.session.expiry = min(op.expiry, CAP)
        self._closed(will=op.with_will)
        return True

    def drop(self) -> None:
        self._closed(will=True)

    def publish(self, payload: bytes) -> bool:
        """Whether the connected device gets it now."""
        if self.connected:
            return True
        if self.session is not None:
            self._expire()
        if self.session is not None:
            self.session.queue.append(payload)
        return False

    def at(self, now: float) -> None:
        """The clock says ``now``: a Will due by then has gone."""
        self.now = now
        self._fire()


# ------------------------------------------------------------------ the real thing


class Client:
    """An MQTT 5.0 client over a trio socket stream (no Nagle: a reset must not eat its last bytes)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    @classmethod
    async def open(cls, port: int, connect: Connect) -> tuple[Client, Connack]:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = cls(stream)
        await client.send(connect)
        connack = await client.read()
        assert isinstance(connack, Connack) and connack.reason_code == 0, connack
        return client, connack

    async def send(self, packet: Packet) -> None:
        await self.stream.send_all(pack(packet))

    async def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = await self.stream.receive_some()
            if not data:
                raise EOFError(f"closed with {self.buf!r} buffered")
            self.buf += data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def read(self) -> Packet:
        first = (await self._take(1))[0]
        length, shift = 0, 0
        while True:
            byte = (await self._take(1))[0]
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        return read_packet(first, await self._take(length))

    async def message(self) -> bytes:
        """The next PUBLISH's payload, acknowledged (the server's PUBACKs to our own publishes are passed over)."""
        while True:
            packet = await self.read()
            if isinstance(packet, Publish):
                if packet.qos:
                    await self.send(Ack(PUBACK, packet.packet_id or 0))
                return packet.payload

    async def closed(self) -> Packet | None:
        """What the server sends before it closes (a DISCONNECT, or nothing)."""
        try:
            packet = await self.read()
        except (EOFError, trio.BrokenResourceError):
            return None
        return packet

    def reset(self) -> None:
        self.stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.stream.socket.close()


@asynccontextmanager
async def server(engine: str) -> AsyncIterator[int]:
    cfg = HeartbeatConfig(port=0, tick=0.05, connect_timeout=5, session_expiry=CAP, engine=engine)
    async with trio.open_nursery() as nursery:
        srv = await nursery.start(partial(serve_heartbeat, cfg))
        yield srv.port
        nursery.cancel_scope.cancel()


async def run(engine: str, steps: list[Op]) -> None:
    model = Model()
    wills: list[float] = []
    sent = 0
    async with server(engine) as port, trio.open_nursery() as nursery:
        observer, _ = await Client.open(port, Connect("observer", KEEP_ALIVE))
        await observer.send(Subscribe(1, (Subscription(WILL_TOPIC, 0),)))
        assert await observer.read() == Suback(1, (0,))
        publisher, _ = await Client.open(port, Connect("publisher", KEEP_ALIVE))

        async def watch() -> None:
            while True:
                if await observer.message() == b"gone":
                    wills.append(trio.current_time())

        nursery.start_soon(watch)
        start = trio.current_time()
        device: Client | None = None
        for op in steps:
            model.at(trio.current_time() - start)
            if isinstance(op, DoConnect):
                if device is not None:
                    continue  # one connection at a time: takeovers are tested elsewhere
                will = None
                if op.will_delay is not None:
                    will = Will(WILL_TOPIC, b"gone", 0, False, Properties(will_delay_interval=op.will_delay))
                props = Properties(session_expiry_interval=op.expiry)
                present, owed = model.connect(op)
                device, connack = await Client.open(port, Connect("device", KEEP_ALIVE, op.clean, props, will))
                assert connack.session_present == present, (op, model)
                assert [await device.message() for _ in owed] == owed, op
                if not present:
                    await device.send(Subscribe(1, (Subscription(TOPIC, 1),)))
                    assert await device.read() == Suback(1, (1,))
            elif isinstance(op, DoDisconnect | DoDrop):
                if device is None:
                    continue
                if isinstance(op, DoDrop):
                    model.drop()
                    device.reset()
                    await trio.testing.wait_all_tasks_blocked()  # the server has seen it
                else:
                    code = ReasonCode.DISCONNECT_WITH_WILL if op.with_will else ReasonCode.SUCCESS
                    await device.send(Disconnect(code, Properties(session_expiry_interval=op.expiry)))
                    answer = await device.closed()
                    if model.disconnect(op):
                        assert answer is None, answer
                    else:
                        assert isinstance(answer, Disconnect) and answer.reason_code == ReasonCode.PROTOCOL_ERROR
                    await device.stream.aclose()
                device = None
            elif isinstance(op, DoPublish):
                sent += 1
                payload = b"m%d" % sent
                await publisher.send(Publish(TOPIC, payload, 1, packet_id=sent))
                assert await publisher.read() == Ack(PUBACK, sent)  # taken: routed or filed
                if model.publish(payload):
                    assert device is not None
                    assert await device.message() == payload
            else:
                await trio.sleep(op.seconds)
        await trio.sleep(CAP + 10.0)  # every Will due is out
        model.at(trio.current_time() - start)
        got = [round(t - start, 2) for t in wills]
        expected = [round(t, 2) for t in model.wills]
        assert len(got) == len(expected), (got, expected)
        for g, e in zip(got, expected, strict=True):
            assert e <= g + MARGIN and g <= e + TOLERANCE, (got, expected)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("engine", ["dense", "streams"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(ops, min_size=1, max_size=14))
# The cases, always: resumed without repeating the expiry; expiry to the second;
# the Will at the session's end when that comes before its delay.
@example(steps=[DoConnect(True, 8, None), DoDisconnect(False, None), DoPublish(), DoConnect(False, None, None)])
@example(steps=[DoConnect(True, 3, None), DoDrop(), DoSleep(2.6), DoConnect(False, 3, None), DoDrop(),
                DoSleep(5.2), DoConnect(False, 3, None)])  # fmt: skip
@example(steps=[DoConnect(True, 1, 4), DoDrop(), DoSleep(5.2), DoConnect(True, 0, 0), DoDrop()])
def test_a_session_behaves_as_the_model_of_the_specification(engine: str, steps: list[Op]) -> None:
    trio.run(run, engine, steps, clock=trio.testing.MockClock(autojump_threshold=0))
