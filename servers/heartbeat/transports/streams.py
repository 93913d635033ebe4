"""The heartbeat server on the streams engine: a trio task per connection.

Each connection is one short trio loop over a watched stream: receive, feed the
reader, hand packets to the session, carry out its effects, awaiting each send; a
subscriber also gets a writer task that sends its queue. This is how the keeper is
embedded in ordinary trio code (``idlekeeper.serve_listeners``); it costs a task,
its cancel scopes and stream objects per connection, which is why the dense
engine (:mod:`.dense`) is the default.
"""

from __future__ import annotations

import collections
import contextlib
import os

import trio

import idlekeeper

from ...ws.handshake import WsPolicy
from ...ws.mqtt_transport import MqttOverWs
from ..broker.budget import CONGESTED_BYTES
from ..mqtt.effects import Accept, AddSubscription, RemoveSubscription, Send
from ..mqtt.endings import Offline
from ..mqtt.packets import ProtocolError
from ..mqtt.publication import Publication
from ..mqtt.reader import PacketReader
from ..mqtt.session import State
from ..mqtt.v5.packets import Connect as V5Connect
from ..server.connection import GOODBYE_TIMEOUT, Connection
from ..server.doors import Door
from ..server.fanout import Exchange
from ..server.lifecycle import HeartbeatServer
from ..server.sys_tree import count_out
from .websocket import WsMqttStream

__all__ = ["StreamConnection", "serve_streams", "serve_websockets"]

# The writer joins queued packets into sends of up to this many bytes: one system call
# for many small packets, and the budget learns what was sent after each.
_WRITE_BATCH = 64 * 1024

FAREWELL_TIMEOUT = 0.25
"""Seconds a TLS connection's last DISCONNECT may take to reach the kernel before the close."""


class StreamConnection(Connection):
    """A connection served by a task of its own over a watched stream; a
    subscriber gets a writer task that sends its queue."""

    __slots__ = ("farewell", "outbox", "pending", "replies", "server", "wake", "writer")
    stream: idlekeeper.WatchedStream

    def __init__(self, server: HeartbeatServer, stream: idlekeeper.WatchedStream, door: Door) -> None:
        super().__init__(stream, door)
        stream.last_words = self.last_words
        self.server = server
        self.outbox: collections.deque[bytes] | None = None
        self.pending = 0
        """Bytes in the outbox and in the batch being sent."""
        self.replies: list[bytes] = []
        """Replies waiting for the durable store (see :meth:`release`)."""
        self.wake: trio.Event | None = None
        self.writer: trio.CancelScope | None = None
        self.farewell: bytes | None = None
        """Over TLS: what :meth:`say` was asked to write (a DISCONNECT 0x8E, 0x8B), sent
        by this connection's task as it ends (the socket carries records, not bytes)."""

    @property
    def subscriber(self) -> bool:
        """Whether the client has subscribed (it has a writer task)."""
        return self.outbox is not None

    def flushed(self) -> bool:
        """The writer has sent everything queued and waits for more."""
        return not self.outbox and self.wake is not None and not self.wake.is_set()

    def congested(self) -> bool:
        """The writer has a backlog (bulk sends wait for it)."""
        return self.pending > CONGESTED_BYTES

    def push(self, data: bytes, *, held: bool = False) -> None:
        """Queue for the writer task (the broker's budget bounds what is queued)."""
        if self.ended_by is not None:
            return  # being closed (cut off, taken over): nobody will send it
        outbox = self.outbox
        if outbox is None:
            if not held:
                return
            outbox = self._start_writer()  # a resumed session's resends before any SUBSCRIBE
        outbox.append(data)
        self.server.counters["packets_out"] += 1  # its bytes are counted as the writer sends them
        self.pending += len(data)
        if self.wake is not None:
            self.wake.set()

    def queued(self) -> int:
        """Bytes queued for the writer and being sent (none once the connection is being closed)."""
        return 0 if self.ended_by is not None else self.pending

    def stop_writing(self) -> None:
        """Cancel the writer task, if there is one."""
        if self.writer is not None:
            self.writer.cancel()

    async def serve(self) -> None:
        """Serve the connection until it ends, whatever ends it."""
        server = self.server
        server.opened(self)
        reader = PacketReader(server.config.max_packet_size)
        session = self.session
        outcome: Offline | None = None
        detail = ""
        try:
            async for data in self.stream:
                server.counters["bytes_in"] += len(data)  # $SYS/broker/bytes/received
                for packet in reader.feed(data):
                    server.counters["packets_in"] += 1
                    if type(packet) is V5Connect:
                        session = self.speak_v5()
                    for effect in session.receive(packet):
                        await self._apply(effect)
                    if session.state is State.CLOSED:
                        break
                await self.release()
                if session.state is State.CLOSED:
                    outcome = Offline.DISCONNECT  # unless refused: ended_by says so
                    break
                if session.state is State.CONNECTED:
                    self.packet_deadline(reader.buffered > 0)
        except ProtocolError as exc:
            outcome, detail = Offline.PROTOCOL_ERROR, exc.reason
            refusal = server.protocol_error(self, exc)
            if refusal is not None:
                await self._goodbye(refusal)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            outcome = Offline.CONNECTION_LOST
        except trio.Cancelled:
            outcome = Offline.SHUTDOWN  # cancelled from outside: the server is stopping
            raise
        finally:
            self.stream.last_words = None  # the watch and this connection need not outlive each other
            # Over TLS the keeper leaves the socket open at an expiry (close=False): the
            # reaper cannot write a TLS record, so this task says the goodbye. Asked for
            # before the end is told: it records the reason code the event carries.
            words = self.farewell
            framed = not self.plain
            if framed and words is None and self.stream.reason is not None:
                words = self.last_words(self.stream.reason)
            server.ended(self, self.end_reason(outcome), detail)
            if framed and words:
                await self._farewell(words)

    @property
    def plain(self) -> bool:
        """Whether the client's bytes go straight to a TCP socket (not TLS records, not
        WebSocket frames): then the keeper's reaper and :meth:`say` may write them."""
        return isinstance(self.stream.transport_stream, trio.SocketStream)

    async def _farewell(self, words: bytes) -> None:
        """Tell an MQTT 5 client over TLS or a WebSocket why its connection ends (0x8D,
        or what :meth:`say` kept), briefly, and only if nothing is left unsent that the
        goodbye would cut into; the socket is closed after."""
        stream = self.stream
        if self.pending:
            return
        self.stop_writing()  # nothing else may write to the stream meanwhile
        gone = (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError)
        with trio.CancelScope(shield=True), trio.move_on_after(FAREWELL_TIMEOUT), contextlib.suppress(*gone):
            await stream.send_all(words)

    async def release(self) -> None:
        """Send the replies that waited for the durable store's commit, once it is done
        (one wait for every packet of a read, not one each)."""
        if self.replies:
            replies, self.replies = self.replies, []
            for data in await self.server.fanout.committed(self, replies):
                if self.finished:
                    return
                await self._send(data)

    async def _apply(self, effect: object) -> None:
        if self.finished:
            # Ended from outside (a takeover) while this task was at an await: the rest
            # of what it had read is not the device's any more; a SUBSCRIBE applied now
            # would leave a dead subscriber in the broker.
            return
        server = self.server
        if isinstance(effect, Send):
            if self in server.unsettled:
                await self.release()
                await server.settle(self)  # a SUBACK: see FanOut.settle
                if self.finished:
                    return
            elif self.replies or self in server.fanout.commits:
                self.replies.append(effect.data)  # sent once what the packets changed is durable
                return
            await self._send(effect.data)
        elif isinstance(effect, Publication):
            server.published(self, effect)
        elif isinstance(effect, Accept):
            await self._accept(effect)
        elif isinstance(effect, AddSubscription):
            self._start_writer()
            server.subscribed(self, effect)
        elif isinstance(effect, RemoveSubscription):
            server.unsubscribed(self, effect)
        elif isinstance(effect, Exchange):
            server.exchanged(self, effect)
        # Goodbye needs nothing here: the session is CLOSED and the loop ends.

    async def _accept(self, request: Accept) -> None:
        server = self.server
        arrived = server.connect_received(self)
        refusal, opened = await server.vet(self, request)
        if refusal is not None:
            await self._goodbye(refusal)
            return
        connack = server.admit(self, request, opened, arrived)
        if connack is None:
            return  # superseded: closed unanswered
        # Announced before the CONNACK's send yields: a takeover during the send would
        # otherwise end a session nobody had heard of, and neither event would be told.
        server.announce(self, attach=False)
        await self._send(connack)
        if self.finished:
            return
        for effect in server.restored(opened):
            await self._apply(effect)
        server.attach(self)

    async def _goodbye(self, data: bytes) -> None:
        """Send a refusal (a CONNACK, or an MQTT 5 DISCONNECT), briefly: a refused client
        must not hold its connection open. A subscriber's writer task owns the stream's
        sends, so the refusal queues behind what it has to send and is waited for."""
        with trio.move_on_after(GOODBYE_TIMEOUT):
            if self.outbox is not None:
                self.push(data, held=True)
                # Nothing more is queued behind it (push refuses once ended_by is set).
                self.ended_by = self.ended_by or Offline.PROTOCOL_ERROR
                while not self.flushed():  # noqa: ASYNC110 (an event per write would cost every subscriber)
                    await trio.sleep(0.01)
                return
            count_out(self.server.counters, data)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.stream.send_all(data)

    async def _send(self, data: bytes) -> None:
        if self.outbox is not None:
            # A reply (PINGRESP, SUBACK, PUBACK...) behind the subscriber's queue: never dropped.
            self.server.broker.write(self, [data])
        else:
            count_out(self.server.counters, data)
            self.pending += len(data)  # a send under way: say() must not cut into it
            try:
                await self.stream.send_all(data)
            finally:
                self.pending -= len(data)

    def say(self, data: bytes) -> None:
        """Write ``data`` now if nothing is being sent (see :meth:`Connection.say`). Over
        TLS, kept for the connection's task to send as it ends: the socket under the
        stream takes records, not plaintext."""
        if not self.plain:
            self.farewell = data
            return
        sock = self.stream.socket
        if self.pending or sock is None:
            return
        with contextlib.suppress(OSError):  # the socket is non-blocking: a full buffer drops it
            os.write(sock.fileno(), data)

    def _start_writer(self) -> collections.deque[bytes]:
        if self.outbox is not None:
            return self.outbox
        outbox = self.outbox = collections.deque()
        self.writer = trio.CancelScope()
        self.server.nursery.start_soon(self._writer)
        return outbox

    async def _writer(self) -> None:
        outbox = self.outbox
        assert outbox is not None and self.writer is not None
        stream = self.stream
        budget = self.server.broker.budget
        with self.writer:
            try:
                while True:
                    if not outbox:
                        self.wake = trio.Event()
                        await self.wake.wait()
                        continue
                    batch: list[bytes] = []
                    size = 0
                    while outbox and size < _WRITE_BATCH:
                        item = outbox.popleft()
                        batch.append(item)
                        size += len(item)
                    await stream.send_all(b"".join(batch))
                    self.server.counters["bytes_out"] += size
                    self.pending -= size
                    budget.settle(self, self.queued())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


async def serve_streams(
    server: HeartbeatServer,
    door: Door,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept MQTT over TCP (or TLS) on ``door``'s sockets until cancelled or
    the server's shutdown closes them, a task per connection."""
    accepting = _stops_with(server)
    listeners = door.sockets

    async def handle(stream: idlekeeper.WatchedStream) -> None:
        await StreamConnection(server, stream, door).serve()

    tls = door.listener.tls
    with accepting:
        await idlekeeper.serve_listeners(
            handle,
            listeners,
            keeper=server.keeper,
            handler_nursery=server.nursery,
            task_status=task_status,
            # MQTT over TLS (8883): the handshake first, under its own deadline; CONNECT's follows.
            ssl_context=None if tls is None else tls.context(),
            # Over TLS an expiry cancels the connection's task, which sends its goodbye
            # (a record the reaper cannot make) before trio closes the socket.
            close=tls is None,
            handshake_timeout=idlekeeper.DEFAULT_HANDSHAKE_TIMEOUT if tls is None else tls.handshake_timeout,
        )
    for listener in listeners:  # refuse new connections at once, not after the shutdown
        await listener.aclose()


async def serve_websockets(
    server: HeartbeatServer,
    door: Door,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """MQTT over WebSockets on ``door``'s sockets (over TLS, wss, when the door has TLS),
    a task per connection, beside the server's TCP listeners whichever engine serves
    those; until cancelled or the server's shutdown closes them.

    The keeper watches the stream of MQTT bytes the frames carry, so keep-alive counts
    MQTT packets and the stall check looks at the socket under the frames. An expiry
    cancels the connection's task (``close=False``), which sends an MQTT 5 client its
    DISCONNECT in a frame; trio closes the socket after.
    """
    config = server.config
    policy = WsPolicy(config.ws_path, allowed_origins=config.ws_allowed_origins)
    # Over TLS (wss) the handshake runs on the first read, inside the watch, under the
    # CONNECT deadline.
    tls = door.listener.tls
    context = None if tls is None else tls.context()
    accepting = _stops_with(server)
    listeners = door.sockets

    async def handle(raw: trio.SocketStream) -> None:
        carrier: trio.abc.Stream = raw
        if context is not None:
            carrier = trio.SSLStream(raw, context, server_side=True, https_compatible=True)
        stream = WsMqttStream(carrier, MqttOverWs(policy))
        with server.keeper.watch(stream, close=False) as watch:
            await StreamConnection(server, watch.stream, door).serve()

    with accepting:
        await trio.serve_listeners(handle, listeners, handler_nursery=server.nursery, task_status=task_status)
    for listener in listeners:
        await listener.aclose()


def _stops_with(server: HeartbeatServer) -> trio.CancelScope:
    """A scope that the server's shutdown cancels, with its other listeners (``server.closers``)."""
    accepting = trio.CancelScope()
    server.closers.append(accepting.cancel)
    return accepting
