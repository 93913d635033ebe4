"""The heartbeat server: MQTT 3.1.1 keep-alive and presence on idlekeeper.

Each connection is one short trio loop: receive, feed the reader, hand packets to
the session, carry out its effects. Deadlines are declared once per phase on the
watched stream, and the keeper's one reaper enforces all of them:

- before CONNECT: an absolute ``connect_timeout`` from accept;
- after CONNECT: a receive timeout of 1.5 × keep-alive (the spec's rule; any
  control packet counts), or the server's ``max_idle`` when keep-alive is 0; and a
  packet that has started arriving must be complete within that same time, so
  trickled bytes cannot keep a dead device "alive";
- while the server is sending to a subscriber: ``send_timeout`` without progress.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import trio

import idlekeeper
from idlekeeper import Reason

from ..config import WorkerConfig
from ..listeners import open_listeners, port_of
from ..prometheus import Families, Metric, render, worker_registry
from .auth import AuthResult, PasswordFile
from .broker import Broker
from .coordination import Coordinator
from .coordination.authority import epoch_of
from .coordination.inprocess import InProcessCoordinator
from .packets import ProtocolError
from .presence import Offline, PresenceEvent, PresenceSink
from .reader import PacketReader
from .session import (
    DEFAULT_MAX_QOS,
    DEFAULT_PRESENCE_PREFIX,
    Accept,
    AddSubscription,
    RemoveSubscription,
    Route,
    Send,
    Session,
    State,
)

__all__ = ["Connection", "HeartbeatConfig", "HeartbeatServer"]

logger = logging.getLogger("servers.heartbeat")

# A subscriber that falls this far behind loses its oldest queued messages.
OUTBOX_LIMIT = 50_000
_WRITE_BATCH = 64 * 1024


@dataclass
class HeartbeatConfig(WorkerConfig):
    """Everything a heartbeat worker needs to know. The CLI fills it in."""

    port: int = 1883
    connect_timeout: float = 10.0
    max_idle: float | None = 3600.0
    max_keepalive: int = 3600
    send_timeout: float = 30.0
    max_packet_size: int = 256 * 1024
    max_connections: int = 18_000
    presence_prefix: str = DEFAULT_PRESENCE_PREFIX
    """Topic prefix of presence events; devices' own publishes under it are dropped."""
    max_qos: int = DEFAULT_MAX_QOS
    """Highest QoS granted to subscribers and routed for publishers: 0 or 1."""
    max_device_records: int = 1_000_000
    """Presence records kept for /devices; the longest-offline are forgotten first."""
    auth: PasswordFile | None = None
    node: str = ""
    """This gateway's name in a fleet (empty on a lone machine); part of every session's epoch."""
    extra_sinks: list[PresenceSink] = field(default_factory=list)
    """Presence sinks of the default (in-process) coordinator; other coordinators hold their own."""

    def __post_init__(self) -> None:
        # Delivery to subscribers has no QoS 2 exchange (PUBREC/PUBREL/PUBCOMP outbound).
        if self.max_qos not in (0, 1):
            raise ValueError(f"max_qos must be 0 or 1, not {self.max_qos}")


class Connection:
    """One client connection, as the server sees it."""

    __slots__ = (
        "ended_by",
        "finished",
        "msg_id",
        "online",
        "outbox",
        "peer",
        "session",
        "stream",
        "wake",
        "writer",
    )

    def __init__(self, stream: idlekeeper.WatchedStream, peer: str, session: Session) -> None:
        self.stream = stream
        self.peer = peer
        self.online: PresenceEvent | None = None
        """The session's online event once CONNECT is accepted (its epoch names the session)."""
        self.session = session
        self.ended_by: Offline | None = None
        self.finished = False
        self.outbox: collections.deque[bytes] | None = None
        self.wake: trio.Event | None = None
        self.writer: trio.CancelScope | None = None
        self.msg_id = 0

    def silent_for(self, now: float | None = None) -> float:
        """Seconds since the client last sent anything (since accept, if nothing yet)."""
        return self.stream.silent_for(now)

    def end(self, reason: Offline) -> None:
        """Close this connection from outside its own task (takeover, shutdown)."""
        if self.ended_by is None:
            self.ended_by = reason
        self.stream.cancel()


def _flushed(conn: Connection) -> bool:
    """A subscriber whose writer has sent everything queued and waits for more."""
    return not conn.outbox and conn.wake is not None and not conn.wake.is_set()


def _peer_of(stream: idlekeeper.WatchedStream) -> str:
    sock = stream.socket
    try:
        host, port = sock.getpeername()[:2]  # type: ignore[union-attr]
    except (OSError, AttributeError):
        return "?"
    return f"{host}:{port}"


class HeartbeatServer:
    """Presence for many MQTT devices, in one trio process (one worker).

    It serves connections and keeps its own subscribers (a :class:`Broker`); what is
    shared with other workers or gateways (who holds each client id, the device
    registry, presence events, subscribers elsewhere) goes through ``coordinator``,
    by default an :class:`InProcessCoordinator` (a lone worker). It is the
    coordinator's :class:`~servers.heartbeat.coordination.Host`.
    """

    def __init__(
        self,
        config: HeartbeatConfig,
        keeper: idlekeeper.Keeper,
        nursery: trio.Nursery,
        coordinator: Coordinator | None = None,
    ) -> None:
        self.config = config
        self.keeper = keeper
        self._nursery = nursery
        self.coordinator: Coordinator = coordinator or InProcessCoordinator(
            config.extra_sinks, presence_prefix=config.presence_prefix, max_records=config.max_device_records
        )
        self.online: dict[str, Connection] = {}
        self.connections: set[Connection] = set()
        self.broker: Broker[Connection] = Broker(config.max_qos, OUTBOX_LIMIT)
        self.offline_by_reason: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.port = 0
        self._announced: set[str] = set()
        self._epochs = itertools.count(1)
        self._pid = os.getpid()
        self.accepting = trio.CancelScope()
        """Cancelled to stop accepting connections (the first step of a shutdown)."""
        self._registry = worker_registry(keeper.stats, {"worker": str(config.worker)}, self.figures)

    # -- the connection loop ------------------------------------------------------

    async def handle(self, stream: idlekeeper.WatchedStream) -> None:
        """Serve one client connection until it ends, whatever ends it."""
        cfg = self.config
        conn = Connection(stream, _peer_of(stream), Session(max_qos=cfg.max_qos, presence_prefix=cfg.presence_prefix))
        self.connections.add(conn)
        self.counters["connections"] += 1
        stream.deadline = trio.current_time() + cfg.connect_timeout
        reader = PacketReader(cfg.max_packet_size)
        session = conn.session
        outcome: Offline | None = None
        detail = ""
        try:
            async for data in stream:
                for packet in reader.feed(data):
                    self.counters["packets_in"] += 1
                    for effect in session.receive(packet):
                        await self._apply(conn, effect)
                    if session.state is State.CLOSED:
                        break
                if session.state is State.CLOSED:
                    outcome = Offline.DISCONNECT  # unless refused: ended_by says so
                    break
                if session.state is State.CONNECTED:
                    self._packet_deadline(conn, reader.buffered > 0)
        except ProtocolError as exc:
            outcome, detail = Offline.PROTOCOL_ERROR, exc.reason
            self.counters["protocol_errors"] += 1
            logger.info("protocol error from %s (%s): %s %s", conn.peer, session.client_id, exc.reason, exc.detail)
            if exc.connack_code is not None and session.state in (State.AWAITING_CONNECT, State.CONNECTING):
                await self._goodbye(conn, session.refused(exc.connack_code))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            outcome = Offline.CONNECTION_LOST
        except trio.Cancelled:
            outcome = Offline.SHUTDOWN  # cancelled from outside: the server is stopping
            raise
        finally:
            self._ended(conn, self._reason(conn, outcome), detail)

    def _reason(self, conn: Connection, outcome: Offline | None) -> Offline:
        if conn.ended_by is not None:
            return conn.ended_by
        stream = conn.stream
        if stream.expired:
            if conn.session.state is not State.CONNECTED:
                return Offline.CONNECT_TIMEOUT
            return Offline.SEND_TIMEOUT if stream.reason is Reason.SEND else Offline.KEEPALIVE_TIMEOUT
        return outcome or Offline.CONNECTION_LOST

    def _packet_deadline(self, conn: Connection, partial: bool) -> None:
        """A packet that has begun must be complete within the keep-alive window."""
        stream = conn.stream
        if partial and stream.deadline == math.inf:
            window = stream.receive_timeout
            if window is not None:
                stream.deadline = trio.current_time() + window
        elif not partial and stream.deadline != math.inf:
            stream.deadline = None

    async def _apply(self, conn: Connection, effect: object) -> None:
        if isinstance(effect, Send):
            await self._send(conn, effect.data)
        elif isinstance(effect, Route):
            self.counters["messages_in"] += 1
            self.route(effect.topic, effect.payload, effect.qos)
        elif isinstance(effect, Accept):
            await self._accept(conn, effect)
        elif isinstance(effect, AddSubscription):
            self.broker.subscriptions.subscribe(conn, effect.topic_filter, effect.qos)
            self._start_writer(conn)
            self._announce()
        elif isinstance(effect, RemoveSubscription):
            self.broker.subscriptions.unsubscribe(conn, effect.topic_filter)
            self._announce()
        # Goodbye needs nothing here: the session is CLOSED and the loop ends.

    async def _accept(self, conn: Connection, request: Accept) -> None:
        cfg = self.config
        conn.stream.deadline = None  # CONNECT is in: the handshake deadline has been met
        code = 0
        if cfg.auth is not None:
            result = await trio.to_thread.run_sync(cfg.auth.check, request.username, request.password)
            if result is not AuthResult.ACCEPTED:
                code = int(result)
                self.counters["auth_failures"] += 1
        if not code and len(self.online) >= cfg.max_connections and request.client_id not in self.online:
            code = 3  # server unavailable: the polite refusal beyond the cap
            self.counters["refused_capacity"] += 1
        if code:
            self.counters[f"refused_{code}"] += 1
            conn.ended_by = Offline.REFUSED
            await self._goodbye(conn, conn.session.refused(code))
            return
        old = self.online.get(request.client_id)
        if old is not None and old is not conn:
            # Its offline event (and Will) go out now, before the new one's online event.
            old.end(Offline.TAKEOVER)
            self._ended(old, Offline.TAKEOVER, "")
        self.online[request.client_id] = conn
        stream = conn.stream
        keep_alive = min(request.keep_alive, cfg.max_keepalive) if request.keep_alive else 0
        stream.receive_timeout = 1.5 * keep_alive if keep_alive else cfg.max_idle
        # Stamped before CONNACK goes out: a device can only reconnect elsewhere after
        # reading it, so a later session always carries a later time (the registry
        # orders crossing claims by it).
        conn.online = self._event(
            conn, "online", None, epoch=epoch_of(cfg.worker, self._pid, next(self._epochs), cfg.node)
        )
        await self._send(conn, conn.session.accepted())
        # The coordinator ends the device's session on any other worker or gateway.
        self.coordinator.online(conn.online)

    async def _goodbye(self, conn: Connection, connack: bytes) -> None:
        """Send a refusal, briefly: a refused client must not hold its connection open."""
        with trio.move_on_after(1.0):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await conn.stream.send_all(connack)

    # -- sending ------------------------------------------------------------------------

    async def _send(self, conn: Connection, data: bytes) -> None:
        if conn.outbox is not None:
            self.broker.enqueue(conn, data)
        else:
            await conn.stream.send_all(data)

    def _start_writer(self, conn: Connection) -> None:
        if conn.outbox is not None:
            return
        conn.outbox = collections.deque()
        conn.writer = trio.CancelScope()
        conn.stream.send_timeout = self.config.send_timeout
        self._nursery.start_soon(self._writer, conn)

    async def _writer(self, conn: Connection) -> None:
        outbox = conn.outbox
        assert outbox is not None and conn.writer is not None
        with conn.writer:
            try:
                while True:
                    if not outbox:
                        conn.wake = trio.Event()
                        await conn.wake.wait()
                        continue
                    batch: list[bytes] = []
                    size = 0
                    while outbox and size < _WRITE_BATCH:
                        item = outbox.popleft()
                        batch.append(item)
                        size += len(item)
                    await conn.stream.send_all(b"".join(batch))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    def route(self, topic: str, payload: bytes, qos: int) -> int:
        """Deliver a message to every subscriber of ``topic``, here and on other workers.

        Returns how many local subscribers got it; the coordinator passes it on to
        other workers or gateways whose subscribers want it.
        """
        self.coordinator.route(topic, payload, qos)
        return self.broker.deliver(topic, payload, qos)

    # -- presence ------------------------------------------------------------------------

    def _ended(self, conn: Connection, reason: Offline, detail: str) -> None:
        """Bookkeeping when a connection ends; synchronous, so it runs even when cancelled."""
        if conn.finished:
            return
        conn.finished = True
        self.connections.discard(conn)
        if conn.writer is not None:
            conn.writer.cancel()
            self.broker.subscriptions.drop(conn)
            self._announce()
        session = conn.session
        client_id = session.client_id
        was_online = client_id is not None and self.online.get(client_id) is conn
        if was_online:
            assert client_id is not None
            del self.online[client_id]
            will = session.will
            if will is not None and reason not in (Offline.DISCONNECT, Offline.REFUSED):
                self.counters["wills_published"] += 1
                self.route(will.topic, will.message, will.qos)
        self.offline_by_reason[reason.value] += 1
        if was_online and conn.online is not None:
            event = self._event(conn, "offline", reason, detail, epoch=conn.online.epoch)
            # Exactly once, fleet-wide: the coordinator drops it if the session was already ended.
            self.coordinator.offline(event, forget=session.assigned)
        elif client_id is None or reason is Offline.REFUSED:
            self.coordinator.note(self._event(conn, "offline", reason, detail))

    def _event(
        self, conn: Connection, status: str, reason: Offline | None, detail: str = "", epoch: str = ""
    ) -> PresenceEvent:
        cfg = self.config
        return PresenceEvent(
            status=status,
            client_id=conn.session.client_id,
            peer=conn.peer,
            reason=reason,
            silent_for=conn.silent_for(),
            time=time.time(),
            worker=cfg.worker,
            detail=detail,
            epoch=epoch,
            node=cfg.node,
            keep_alive=conn.session.keep_alive,
        )

    # -- the coordinator's host -------------------------------------------------------------

    def deliver(self, topic: str, payload: bytes, qos: int) -> None:
        """A message for this worker's subscribers only (from the coordinator)."""
        self.broker.deliver(topic, payload, qos)

    def evict(self, client_id: str, epoch: str, detail: str) -> None:
        """The device reconnected elsewhere: close this session (its offline event is out)."""
        conn = self.online.get(client_id)
        if conn is not None and conn.online is not None and conn.online.epoch == epoch:
            conn.end(Offline.TAKEOVER)
            self._ended(conn, Offline.TAKEOVER, detail)

    def sessions(self) -> list[PresenceEvent]:
        """The online event of every session held here."""
        return [c.online for c in self.online.values() if c.online is not None]

    def filters(self) -> set[str]:
        """Every filter this worker's subscribers hold."""
        return self.broker.subscriptions.filters()

    def _announce(self) -> None:
        filters = self.filters()
        if filters != self._announced:
            self._announced = filters
            self.coordinator.filters_changed(filters)

    # -- control -----------------------------------------------------------------------------

    async def shutdown(self, grace: float = 5.0) -> None:
        """End every connection with reason ``shutdown``, in the order subscribers need.

        New connections are refused first. Devices are ended next, and their offline
        events (and Wills) are routed; then, for up to ``grace`` seconds, the
        subscribers' queues are flushed, so that a dashboard hears every device go
        offline before its own connection closes; last, the subscribers are closed.
        Every connection gets its TCP close. Cancelling the server instead ends
        everything at once (the presence log still gets every event).
        """
        self.accepting.cancel()
        with trio.move_on_after(grace):
            for conn in [c for c in self.connections if c.outbox is None]:
                conn.end(Offline.SHUTDOWN)
            # A device's offline event is reported when its task has finished. Polled:
            # an event for that moment would cost every connection's bookkeeping.
            while any(c.outbox is None for c in self.connections):  # noqa: ASYNC110
                await trio.sleep(0.01)
            # Every report published everywhere (other workers' devices' events included),
            await self.coordinator.drain()
            # then each subscriber's writer must have sent its queue and wait for more.
            while not all(_flushed(c) for c in self.connections):  # noqa: ASYNC110
                await trio.sleep(0.01)
        for conn in list(self.connections):
            conn.end(Offline.SHUTDOWN)
        with trio.move_on_after(1.0):  # the subscribers' own offline reports, out before we exit
            while self.connections:  # noqa: ASYNC110
                await trio.sleep(0.01)
            await self.coordinator.flush()
        with trio.move_on_after(2.0):
            await self.coordinator.leave()

    # -- status endpoint (servers.status.StatusSource) -------------------------------------

    def healthy(self) -> bool | str:
        """The worker is serving; a string says what is degraded (the coordinator is behind)."""
        health = self.coordinator.health()
        return True if health.ok else health.detail

    async def lookup(self, kind: str, key: str, local: bool = False) -> object | None:
        """``/devices/<client-id>``: the device's last presence, from whichever worker or gateway."""
        if kind != "devices":
            return None
        event = await self.coordinator.lookup(key)
        if event is None:
            return None
        out = event.to_dict()
        out["keep_alive"] = event.keep_alive
        conn = self.online.get(key)
        if (
            event.status == "online"
            and conn is not None
            and conn.online is not None
            and conn.online.epoch == event.epoch
        ):
            out["silent_for"] = round(conn.silent_for(), 3)  # held here: how silent right now
        return out

    def metrics(self) -> bytes:
        """Prometheus exposition text for this worker: its figures, its keeper's, its process's."""
        return render(self._registry)

    def figures(self) -> list[Metric]:
        """This worker's live presence figures, as Prometheus families."""
        f = Families({"worker": str(self.config.worker)})
        f.gauge("heartbeat_devices_online", "Devices with a live, accepted MQTT connection.", len(self.online))
        f.gauge("heartbeat_connections", "Open client connections, handshaking ones included.", len(self.connections))
        f.counter("heartbeat_messages_out_total", "Messages delivered to subscribers.", self.broker.delivered)
        f.counter(
            "heartbeat_messages_dropped_total",
            "Messages dropped for subscribers that fell too far behind.",
            self.broker.dropped,
        )
        f.counter_by(
            "heartbeat_offline_total",
            "Connections ended, by reason.",
            "reason",
            {reason.value: self.offline_by_reason.get(reason.value, 0) for reason in Offline},
        )
        for name, help_text in _COUNTERS:
            f.counter(f"heartbeat_{name}_total", help_text, self.counters.get(name, 0))
        return f.families + self.coordinator.figures()


_COUNTERS: Iterable[tuple[str, str]] = (
    ("connections", "Connections accepted."),
    ("packets_in", "MQTT control packets received."),
    ("messages_in", "PUBLISH messages received and routed."),
    ("protocol_errors", "Connections closed for violating MQTT 3.1.1."),
    ("auth_failures", "CONNECTs refused for bad or missing credentials."),
    ("refused_capacity", "CONNECTs refused because the worker was at its connection cap."),
    ("wills_published", "Will messages published for devices that died."),
)


async def serve_heartbeat(
    config: HeartbeatConfig,
    *,
    listeners: list[trio.SocketListener] | None = None,
    status_port: int | None = None,
    status_host: str = "127.0.0.1",
    coordinator: Coordinator | None = None,
    task_status: trio.TaskStatus[HeartbeatServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one heartbeat worker until cancelled; ``nursery.start`` returns the server.

    ``listeners`` default to a TCP listener on ``config.host:config.port`` (port 0
    picks a free one: read ``server.port``). ``coordinator`` defaults to a lone
    worker's (:class:`InProcessCoordinator`, with ``config.extra_sinks``). ``await
    server.shutdown()`` first for a graceful stop (subscribers hear every device go
    offline); cancelling alone ends every connection at once, each with reason
    ``shutdown`` and its TCP close.
    """
    from ..status import serve_status  # the status endpoint only when asked for

    async with idlekeeper.open_keeper(tick=config.tick) as keeper, trio.open_nursery() as nursery:
        server = HeartbeatServer(config, keeper, nursery, coordinator)
        # Started before the first connection, so that no report finds it unattached.
        await nursery.start(partial(server.coordinator.run, server))
        if listeners is None:
            listeners = open_listeners(config.host, config.port)
        server.port = port_of(listeners)
        bound = listeners

        async def accept(task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
            with server.accepting:
                await idlekeeper.serve_listeners(
                    server.handle, bound, keeper=keeper, handler_nursery=nursery, task_status=task_status
                )
            for listener in bound:  # refuse new connections at once, not after the shutdown
                await listener.aclose()

        await nursery.start(accept)
        if status_port is not None:
            await nursery.start(partial(serve_status, server, status_port, keeper=keeper, host=status_host))
        task_status.started(server)
