"""The heartbeat server on the dense engine: no task per connection.

Each connection is a :class:`DenseConnection`, an ``idlekeeper.Protocol`` whose
callbacks feed the same sans-IO reader and session as the streams engine and carry
out the same effects through the same :class:`~..server.lifecycle.HeartbeatServer` steps;
only the I/O differs. Writes go to the transport's queue (one queue, so replies and
routed messages keep their order); the password check, which is slow on purpose,
runs in a thread while reading is paused, and the packets that came behind CONNECT
wait for its verdict.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

import idlekeeper

from ..broker.budget import CONGESTED_BYTES
from ..broker.reports import Opened
from ..mqtt.effects import Accept, Acknowledged, AddSubscription, Effect, RemoveSubscription, Send
from ..mqtt.encoders import encode_pingresp
from ..mqtt.endings import Offline
from ..mqtt.packets import PINGREQ_WIRE, ProtocolError
from ..mqtt.publication import Publication
from ..mqtt.reader import AnyPacket, idle_reader
from ..mqtt.session import State
from ..mqtt.v5.packets import Connect as V5Connect
from ..server.connection import GOODBYE_TIMEOUT, SUBSCRIBED, Connection
from ..server.doors import Door
from ..server.fanout import Exchange
from ..server.lifecycle import HeartbeatServer
from ..server.sys_tree import count_out

__all__ = ["DenseConnection", "serve_dense"]

_PINGRESP = encode_pingresp()
_CONNECTED = State.CONNECTED  # a global: one look-up on the heartbeat's path, not two
_PUBACK_ID = struct.Struct("!2xH")
# What a read of nothing but PUBACKs has at every fourth byte, for up to 4,096 of them
# (a longer read is parsed).
_PUBACK_FIRSTS = b"\x40" * 4096
_PUBACK_LENGTHS = b"\x02" * 4096
_SPLIT_ACKS = 4
"""Acknowledgements read together that are worth taking in halves (see
DenseConnection._acknowledged): two at least in each."""

T = TypeVar("T")


class DenseConnection(Connection, idlekeeper.Protocol):
    """One client connection served by the dense engine's callbacks."""

    # Twelve slots with the base class's: 128 bytes, one of the allocator's size
    # classes; a thirteenth would take every connection to 144.
    __slots__ = ("server", "reader", "waiting", "violation")
    stream: idlekeeper.Transport
    ANSWERS_IN_ENGINE = True
    """Whether the engine may answer a PINGREQ itself (see :meth:`_offer_pings`): the
    transport carries MQTT's own bytes (not WebSocket frames)."""

    def __init__(self, server: HeartbeatServer, door: Door) -> None:
        self.server = server
        self.door = door
        self.waiting: list[AnyPacket] | None = None
        """Packets that arrived behind CONNECT while its password is checked."""
        self.violation: str | None = None
        """What the client broke, if a protocol error ends the connection."""

    # -- the engine's callbacks ------------------------------------------------------

    def connection_made(self, transport: idlekeeper.Transport) -> None:
        """Accepted: start the CONNECT deadline."""
        server = self.server
        Connection.__init__(self, transport, self.door)
        self.reader = idle_reader(server.config.max_packet_size)
        server.opened(self)

    def data_received(self, data: bytes) -> None:
        """Parse what arrived and act on each packet."""
        self.server.counters["bytes_in"] += len(data)  # $SYS/broker/bytes/received
        # A shared reader holds no unfinished packet that these bytes could belong to.
        if data == PINGREQ_WIRE:
            if self.reader.shared and self.session.state is _CONNECTED:
                # Answered without parsing (the session's reply to a PINGREQ is always a
                # PINGRESP). Over plain TCP the engine answers most before they get here
                # (_offer_pings); these are TLS connections' and any the engine could not.
                counters = self.server.counters
                counters["packets_in"] += 1
                counters["packets_out"] += 1
                counters["bytes_out"] += 2
                self.stream.write(_PINGRESP)
                return
        elif (
            data[0] == 0x40
            and not len(data) & 3
            and self.reader.shared
            and self.session.state is _CONNECTED
            and self._pubacks(data)
        ):
            return
        self._received(data)

    def _pubacks(self, data: bytes) -> bool:
        """Take a read of nothing but plain PUBACKs (``40 02`` and a packet id: a 5.0
        one with no reason code is the same) as the session would, without parsing:
        most of what a subscriber sends. False, and nothing done, for anything else,
        a packet id of 0 included (the reader refuses it)."""
        n = len(data) >> 2
        if data[0::4] != _PUBACK_FIRSTS[:n] or data[1::4] != _PUBACK_LENGTHS[:n]:
            return False
        acks = [("puback", packet_id) for (packet_id,) in _PUBACK_ID.iter_unpack(data) if packet_id]
        if len(acks) != n:
            return False
        self.server.counters["packets_in"] += n
        self._acknowledged(acks)
        return True

    def _acknowledged(self, acks: list[tuple[str, int]]) -> None:
        """Take acknowledgements read together; with the engine otherwise idle, in two
        halves, each written as it is taken.

        A subscriber draining a window answers it whole, then waits for the refill.
        Made whole, the refill would reach it only once every place is refilled; in
        halves, the first half's messages leave (the pass's first write goes at once)
        while the second half is taken, so the client reads as we work. Measured on a
        stored-queue drain: 1.6-1.9x the messages a second, for one more send a read.
        In a busy pass that send would come out of other connections' time, so the
        window is then taken whole (QoS 1 forwarding lost 9 % to halves); so it is
        when a persistent session lives in another process, whose refill comes back
        later whatever we do (halves there cost a second round trip: 0.7x the drain).
        """
        n = len(acks)
        if (
            n >= _SPLIT_ACKS
            and self.stream.alone_in_pass
            and (not self.persistent or self.server.coordinator.refills_here)
        ):
            half = n >> 1
            self.server.acknowledged(self, acks[:half])
            self.server.acknowledged(self, acks[half:])
        else:
            self.server.acknowledged(self, acks)

    def _received(self, data: bytes) -> None:
        reader = self.reader
        try:
            packets = reader.feed(data)
        except ProtocolError as exc:
            self.reader = reader.settled()  # the failure stays with this connection
            self._violation(exc)
            return
        self.reader = reader.settled()
        if self.waiting is not None:  # pragma: no cover - reading is paused meanwhile
            self.waiting.extend(packets)
            return
        self._handle(packets)
        self._offer_pings()

    def _offer_pings(self) -> None:
        """Let the engine answer a PINGREQ that comes alone with a PINGRESP, without a
        call into this protocol, while that is all the session would do with it:
        connected, with no packet half-read (a shared reader) and nothing waiting.
        Most of a fleet's traffic is that pair; the read is activity all the same."""
        if self.ANSWERS_IN_ENGINE:
            self.stream.canned_replies = (
                self.reader.shared and self.session.state is _CONNECTED and self.waiting is None
            )

    def connection_lost(self, exc: BaseException | None) -> None:
        """Report the end, with its reason, exactly once."""
        violation = self.violation
        if violation is not None:
            outcome = Offline.PROTOCOL_ERROR
        elif self.session.state is State.CLOSED:
            outcome = Offline.DISCONNECT  # unless refused: ended_by says so
        elif isinstance(exc, idlekeeper.EngineClosedError):
            outcome = Offline.SHUTDOWN
        else:
            outcome = Offline.CONNECTION_LOST
        server = self.server
        server.ended(self, self.end_reason(outcome), violation or "")

    # -- the protocol ----------------------------------------------------------------

    def _handle(self, packets: list[AnyPacket]) -> None:
        server = self.server
        session = self.session
        # Acknowledgements read together are taken together, when something else comes
        # or the packets end: a subscriber's window then refills once, in one write,
        # and nothing it sent after them is acted on before them.
        acks: list[tuple[str, int]] = []
        # Replies that wait for the durable store's commit of what their packets changed,
        # in order (and every reply after them): the packets read with them are still
        # handled, so a burst of PUBLISHes waits for one commit, not one each.
        replies: list[bytes] = []
        commits = server.fanout.commits
        try:
            for i, packet in enumerate(packets):
                server.counters["packets_in"] += 1
                if type(packet) is V5Connect:
                    session = self.speak_v5()
                effects = session.receive(packet)
                for j, effect in enumerate(effects):
                    if type(effect) is Acknowledged:
                        acks.append((effect.kind, effect.packet_id))
                        continue
                    if acks:
                        self._acknowledged(acks)
                        acks = []
                    if type(effect) is Send:
                        if self in server.unsettled:
                            self._settle(replies, effects[j:], packets[i + 1 :])  # the SUBACK waits
                            return
                        if replies or self in commits:
                            replies.append(effect.data)
                            continue
                    self._apply(effect)
                if self.waiting is not None:  # a password check began: the rest waits for it
                    self.waiting.extend(packets[i + 1 :])
                    return
                if session.state is State.CLOSED:
                    if acks:
                        self._acknowledged(acks)
                    # Its end is reported before the socket closes, as the streams engine
                    # does: a client that reconnects at once (on another worker, say)
                    # must find its DISCONNECT applied, a Session Expiry of 0 included.
                    server.ended(self, self.end_reason(Offline.DISCONNECT), "")
                    self.close()
                    return
        except ProtocolError as exc:
            if acks:
                self._acknowledged(acks)
            self._violation(exc)
            return
        if acks:
            self._acknowledged(acks)
        if replies:
            self._pause_for(self._release, replies, [])
        if session.state is State.CONNECTED:
            self.packet_deadline(self.reader.buffered > 0)

    def _apply(self, effect: object) -> None:
        server = self.server
        if isinstance(effect, Send):
            self.write(effect.data)
        elif isinstance(effect, Publication):
            server.published(self, effect)
        elif isinstance(effect, Accept):
            self._accept(effect)
        elif isinstance(effect, AddSubscription):
            self._flags |= SUBSCRIBED
            server.subscribed(self, effect)
        elif isinstance(effect, RemoveSubscription):
            server.unsubscribed(self, effect)
        elif isinstance(effect, Exchange):
            server.exchanged(self, effect)

    def _accept(self, request: Accept) -> None:
        server = self.server
        arrived = server.connect_received(self)
        if not server.waits(self, request):
            self._admit(request, server.admission(self, request, 0), None, arrived)
            return
        self._pause_for(self._vet, (request, arrived), [])

    async def _vet(self, connect: tuple[Accept, float]) -> bool:
        request, arrived = connect
        refusal, opened = await self.server.vet(self, request)
        if self.finished:
            return False  # the connection ended while its password or session was looked up
        self._admit(request, refusal, opened, arrived)
        return self.session.state is State.CONNECTED

    def _settle(self, replies: list[bytes], effects: list[Effect], rest: list[AnyPacket]) -> None:
        """Hold ``effects`` (a SUBACK first) and what follows until the server has settled
        the subscription with the other workers, after ``replies`` (held for a commit)."""
        self._pause_for(self._settled, (replies, effects), rest)

    async def _release(self, replies: list[bytes]) -> bool:
        """Send ``replies`` once the durable store has committed what they acknowledge."""
        replies = await self.server.fanout.committed(self, replies)
        if self.finished:
            return False
        for data in replies:
            self.write(data)
        return True

    async def _settled(self, held: tuple[list[bytes], list[Effect]]) -> bool:
        replies, effects = held
        if replies and not await self._release(replies):
            return False
        await self.server.settle(self)
        if self.finished:
            return False
        for effect in effects:
            self._apply(effect)
        return True

    def _pause_for(self, work: Callable[[T], Awaitable[bool]], arg: T, rest: list[AnyPacket]) -> None:
        """Stop reading while ``work(arg)`` runs in a task (it awaits, the engine must not).
        ``rest``, the packets read after the one that began it, wait; if it returns True,
        reading resumes and they are handled."""
        self.stream.pause_reading()
        self.waiting = list(rest)
        self.server.nursery.start_soon(self._resume_after, work, arg)

    async def _resume_after(self, work: Callable[[T], Awaitable[bool]], arg: T) -> None:
        go_on = await work(arg)
        waiting, self.waiting = self.waiting, None
        if go_on:
            self.stream.resume_reading()
            self._handle(waiting or [])
            self._offer_pings()

    def _admit(self, request: Accept, refusal: bytes | None, opened: Opened | None, arrived: float) -> None:
        server = self.server
        if refusal is not None:
            self._goodbye(refusal)
            return
        connack = server.admit(self, request, opened, arrived)
        if connack is None:
            return  # superseded: closed unanswered
        self.write(connack)
        for effect in server.restored(opened):
            self._apply(effect)
        server.announce(self)

    def _violation(self, exc: ProtocolError) -> None:
        self.violation = exc.reason
        refusal = self.server.protocol_error(self, exc)
        if refusal is None:
            self.stream.abort()
        else:
            self._goodbye(refusal)

    def _goodbye(self, connack: bytes) -> None:
        """Send a refusal and close, briefly: a refused client must not hold its connection open."""
        stream = self.stream
        stream.pause_reading()
        stream.send_timeout = GOODBYE_TIMEOUT
        self.write(connack)
        self.close()

    def write(self, data: bytes) -> None:
        """Queue MQTT bytes on the transport (:mod:`.dense_ws` frames them)."""
        count_out(self.server.counters, data)
        self.stream.write(data)

    def close(self) -> None:
        """Close once what is queued is sent."""
        self.stream.close()

    def say(self, data: bytes) -> None:
        """Write ``data`` if nothing is queued but this pass's own writes (see
        :meth:`Connection.say`): the close that follows offers it all to the kernel."""
        stream = self.stream
        if not stream.is_closing() and stream.get_write_buffer_size() == stream.gathered:
            self.write(data)  # behind this pass's writes, if any: they go out together

    def pause_writing(self) -> None:
        """The client is not reading what it is sent (its queue passed the high-water
        mark, and it is no longer read): it has ``send_timeout`` to catch up."""
        if self.stream.send_timeout is None:
            self.stream.send_timeout = self.server.config.send_timeout

    def resume_writing(self) -> None:
        """It caught up. A device's send timeout is armed only while it lags: an armed
        one is re-checked by the reaper every ``send_timeout`` even when nothing is
        pending, which for every idle device of a million is a cost for nothing."""
        if not self._flags & SUBSCRIBED:
            self.stream.send_timeout = None
        else:
            # The transport drained without a push: the worker's byte total learns it now.
            self.server.broker.budget.settle(self, self.stream.get_write_buffer_size())

    # -- as a subscriber -------------------------------------------------------------

    @property
    def subscriber(self) -> bool:
        """Whether the client has subscribed."""
        return bool(self._flags & SUBSCRIBED)

    def flushed(self) -> bool:
        """Whether the transport's queue is empty."""
        return self.stream.get_write_buffer_size() == 0

    def congested(self) -> bool:
        """More than the transport's high-water mark is queued."""
        return self.stream.get_write_buffer_size() > CONGESTED_BYTES

    def push(self, data: bytes, *, held: bool = False) -> None:
        """Queue on the transport, behind the replies already there (the broker's
        budget bounds what is queued)."""
        if not self.stream.is_closing():
            self.write(data)

    def queued(self) -> int:
        """Bytes on the transport's queue (replies included), not yet taken by the kernel."""
        return self.stream.get_write_buffer_size()


async def serve_dense(
    server: HeartbeatServer,
    doors: list[Door],
    task_status: trio.TaskStatus[idlekeeper.Engine] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the MQTT listeners ``doors`` with one dense engine until cancelled;
    ``nursery.start`` returns the engine (WebSocket listeners may join it:
    :func:`.dense_ws.serve_websockets_dense`).

    A door with TLS speaks MQTT over TLS (8883): the engine runs each handshake under
    its own deadline, then the connection as over TCP."""
    cfg = server.config
    pings = cfg.coalesce_pings
    opening = idlekeeper.open_engine(
        server.keeper,
        coalesce=cfg.coalesce,
        coalesce_canned=pings,
        # Windows only while pings come faster than one a window: a lone one is
        # answered at once, a fleet's stream costs a wake-up a window.
        canned_rate=1 / pings if pings else 0.0,
        direct_wait=cfg.direct_wait,
    )
    async with opening as engine:
        engine.add_canned_reply(PINGREQ_WIRE, _PINGRESP)  # for DenseConnection._offer_pings
        for door in doors:
            serve_door(server, engine, door)
        server.closers.append(engine.close_listeners)
        server.engine = engine
        task_status.started(engine)
        await trio.sleep_forever()


def serve_door(server: HeartbeatServer, engine: idlekeeper.Engine, door: Door) -> None:
    """Accept MQTT over TCP (or TLS) on ``door``'s sockets with ``engine``."""
    tls = door.listener.tls
    if tls is None:
        engine.serve(door.sockets, lambda: DenseConnection(server, door))
    else:
        engine.serve(
            door.sockets,
            lambda: DenseConnection(server, door),
            ssl_context=tls.context(),
            handshake_timeout=tls.handshake_timeout,
        )
