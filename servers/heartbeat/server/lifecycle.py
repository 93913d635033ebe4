"""The heartbeat server: MQTT 3.1.1 keep-alive and presence on idlekeeper.

Bytes from a connection go to the sans-IO reader, packets to the session, and the
session's effects are carried out by the server's steps (admit, refuse, subscribe,
route, end), which both engines share: the dense engine's protocol callbacks
(:mod:`..transports.dense`, the default) and the streams engine's task per connection
(:mod:`..transports.streams`). The server is the glue of the parts that take those steps:
:mod:`.authenticator`, :mod:`.online` (session bookkeeping), :mod:`.fanout` (with
:mod:`.retained_delivery`) and :mod:`.events` (presence). Deadlines are declared once
per phase on the connection's watch (a transport or a watched stream), and the
keeper's one reaper enforces all of them:

- before CONNECT: an absolute ``connect_timeout`` from accept (:meth:`HeartbeatServer.opened`);
- after CONNECT: a receive timeout of 1.5 × keep-alive (the spec's rule; any
  control packet counts), or the server's ``max_idle`` when keep-alive is 0
  (:meth:`.OnlineSessions.admit`); and a packet that has started arriving must be
  complete within that same time, so trickled bytes cannot keep a dead device
  "alive" (:meth:`.Connection.packet_deadline`);
- while the server is sending to a subscriber: ``send_timeout`` without progress
  (:meth:`.FanOut.subscribed`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection

import trio

import idlekeeper

from ...logs import OncePer, shown
from ...prometheus import Metric, render, worker_registry
from ..broker.reports import Opened
from ..config import HeartbeatConfig
from ..coordination import LEAVE_TIMEOUT, Coordinator
from ..coordination.inprocess import InProcessCoordinator
from ..mqtt.effects import Accept
from ..mqtt.endings import Offline
from ..mqtt.packets import ProtocolError
from ..mqtt.policy import SessionPolicy
from ..mqtt.publication import Publication
from ..mqtt.v5.outbound import from_v311
from ..mqtt.v5.reason_codes import PacketError
from ..presence.event import PresenceEvent
from ..security.connect_rate import ConnectRate
from ..security.throttle import source_key
from .access import reload_acl
from .authenticator import Authenticator
from .connection import Connection, peer_of
from .dashboard import Dashboard
from .delayed_wills import DelayedWills
from .doors import Door, listeners_of
from .events import ConnectionEvents
from .fanout import FanOut
from .metrics import worker_figures
from .online import OnlineSessions
from .stores import durability_for, mqtt_state

__all__ = ["DRAIN_CAP", "HeartbeatServer"]

DRAIN_CAP = 30.0
"""Seconds a stopping worker waits at most for its coordinator to drain while it keeps
moving (Kubernetes' default grace period is as long)."""

logger = logging.getLogger("servers.heartbeat")

connection_log = logging.getLogger("servers.heartbeat.connections")
"""Mosquitto's connection messages (``--connection-messages``), at INFO; off unless asked
for: a line per device is much at this server's scale."""
connection_log.disabled = True

_GONE = {
    Offline.DISCONNECT: "disconnected.",
    Offline.CONNECTION_LOST: "closed its connection.",
    Offline.KEEPALIVE_TIMEOUT: "has exceeded timeout, disconnecting.",
    Offline.PROTOCOL_ERROR: "disconnected due to protocol error.",
}
"""How Mosquitto words a client's going, by why it went (the others: "disconnected (why).")."""


class HeartbeatServer:
    """Presence for many MQTT devices, in one trio process (one worker).

    It serves connections and keeps its own subscribers (a :class:`~..broker.routing.Broker`);
    what is shared with other workers or gateways (who holds each client id, the device
    registry, presence events, subscribers elsewhere) goes through ``coordinator``,
    by default an :class:`InProcessCoordinator` (a lone worker). It is the
    coordinator's :class:`~servers.heartbeat.coordination.Host`.

    It is the glue of its parts, each with a job of its own: :class:`.Authenticator`
    (credentials), :class:`.OnlineSessions` (who holds each client id),
    :class:`.FanOut` (subscriptions and routing, with :class:`.RetainedDelivery`) and
    :class:`.ConnectionEvents` (presence); it carries out a connection's life (opened,
    admitted, ended) across them.
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
        self.nursery = nursery
        """Where the server starts its tasks (password checks, writers)."""
        self.coordinator: Coordinator = coordinator or InProcessCoordinator(
            config.extra_sinks,
            presence_prefix=config.presence_prefix,
            max_records=config.max_device_records,
            max_record_bytes=config.max_device_record_bytes,
            state=mqtt_state(config),
            durability=durability_for(config, trio.current_time),
        )
        # A dict, not a set: at a hundred thousand connections a set's sparse table
        # costs about 70 bytes more a connection.
        self.connections: dict[Connection, None] = {}
        self.offline_by_reason: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        """Every part's counted events (exported as ``heartbeat_<name>_total``)."""
        self.authenticator = Authenticator(config, self.counters)
        self.events = ConnectionEvents(config, self.coordinator)
        self.dashboard = Dashboard(self)
        """The operator's page's figures of this worker (detection lateness among them)."""
        self.online_sessions = OnlineSessions(config, self.coordinator, self.counters, self.authenticator, self.events)
        self.fanout = FanOut(config, self.coordinator, self.counters, nursery)
        self.wills = DelayedWills(self.coordinator, self.fanout.publish_will, self.counters, nursery)
        """MQTT 5 Wills waiting out their delay."""
        self.policy = SessionPolicy(
            max_qos=config.max_qos,
            presence_prefix=config.presence_prefix,
            max_client_id=config.max_client_id,
            max_username=config.max_username,
            max_subscriptions=config.max_subscriptions,
            max_subscription_bytes=config.max_subscription_bytes,
            held=self._held,
            max_keepalive=config.max_keepalive,
            receive_maximum=config.max_inflight,
            max_packet_size=config.max_packet_size,
            topic_alias_maximum=config.max_topic_alias,
            outbound_topic_aliases=config.outbound_topic_aliases,
            session_expiry=int(config.session_expiry),
            retain_available=config.retain_available,
            message_size_limit=config.message_size_limit,
        )
        """What every connection's session applies (one object for them all, but those
        of a listener of its own ``max_qos`` or ``max_topic_alias``)."""
        self.doors = [Door(config, listener, self.policy) for listener in listeners_of(config)]
        """The listeners, in the order given."""
        self.online: dict[str, Connection] = self.online_sessions.online
        """Client id -> the connection holding its session here."""
        self.broker = self.fanout.broker
        self.broker.checks_reads = any(door.acl is not None for door in self.doors)
        self.unsettled = self.fanout.unsettled
        """Connections whose SUBACK waits for :meth:`settle`."""
        # The steps the engines take, bound to the part whose job each is: the engines
        # call some of them per packet, and a call through a method here would add one.
        self.published = self.fanout.published
        self.subscribed = self.fanout.subscribed
        self.unsubscribed = self.fanout.unsubscribed
        self.exchanged = self.fanout.exchanged
        self.acknowledged = self.fanout.acknowledged
        self.settle = self.fanout.settle
        self.route = self.fanout.route
        self.waits = self.online_sessions.waits
        self.restored = self.online_sessions.restored
        self.announce = self.online_sessions.announce
        self.attach = self.online_sessions.attach
        self.connect_rate = ConnectRate(config.max_connect_rate) if config.max_connect_rate else None
        """CONNECTs per source address (see :mod:`..security.connect_rate`); None: unbounded."""
        self._logged = OncePer()
        self.port = 0
        self.ws_port = 0
        """The port MQTT over WebSockets is served on (0: none)."""
        self.engine: idlekeeper.Engine | None = None
        """The dense engine serving the connections, if that is the engine."""
        self.closers: list[Callable[[], None]] = []
        """What closes the listeners (the first step of a shutdown): each engine serving some adds one."""
        self._registry = worker_registry(keeper.stats, {"worker": str(config.worker)}, self.figures)

    # -- a connection's life, the steps both engines share (synchronous but vet) ---------

    def opened(self, conn: Connection) -> None:
        """A connection was accepted: count it and give it ``connect_timeout`` for CONNECT."""
        self.connections[conn] = None
        self.counters["connections"] += 1
        conn.door.accepted += 1
        conn.stream.deadline = trio.current_time() + self.config.connect_timeout

    def connect_received(self, conn: Connection) -> float:
        """CONNECT is in: the handshake deadline has been met. Returns when it came (wall
        clock), for :meth:`admit` (not kept on the connection: a float per device)."""
        self.counters["connects"] += 1  # $SYS/broker/load/connections
        conn.stream.deadline = None
        return time.time()

    def protocol_error(self, conn: Connection, exc: ProtocolError) -> bytes | None:
        """Count and log a violation; returns the CONNACK refusal to send, if the spec has one."""
        session = conn.session
        self.counters["protocol_errors"] += 1
        logger.info("protocol error from %s (%s): %s %s", conn.peer, shown(session.client_id), exc.reason, exc.detail)
        if isinstance(exc, PacketError) and session.protocol_level != 5:
            # A 5.0 CONNECT its reader refused: answered as 5.0, with the reason code.
            session = conn.speak_v5()
        return session.violated(exc)

    def admission(self, conn: Connection, request: Accept, code: int) -> bytes | None:
        """The quick part of admission, after the credentials' verdict (``code``, 0 if
        accepted): the refusal CONNACK, or None to admit. A client named by its
        certificate is checked here (its name is known, and nothing waits for it)."""
        code = code or self._source_rate(conn)
        if not code and conn.door.identified_by_certificate:
            code = self.authenticator.certified(conn, request)
        return self.online_sessions.admission(conn, request, code)

    async def vet(self, conn: Connection, request: Accept) -> tuple[bytes | None, Opened | None]:
        """The slow part of admission (when :meth:`waits` says so): the source's rate
        (before any hashing), the credentials, then (CleanSession=0) the stored session
        from the coordinator. Returns the refusal CONNACK, or the session to resume
        (None for a clean one); then :meth:`admit`."""
        authenticator = self.authenticator
        code = self._source_rate(conn)
        if not code and conn.door.identified_by_certificate:
            code = authenticator.certified(conn, request)
        elif not code:
            code = await self.authenticate(conn, request)
        return await self.online_sessions.open(conn, request, code)

    def _source_rate(self, conn: Connection) -> int:
        """3 (server unavailable) if the client's address connects faster than allowed, else 0."""
        rate = self.connect_rate
        if rate is None:
            return 0
        source = source_key(peer_of(conn.stream, port=False))
        if rate.admit(source, trio.current_time()):
            return 0
        self.counters["refused_connect_rate"] += 1
        if self._logged.due(source, trio.current_time()):
            logger.warning(
                "CONNECTs from %s refused (3): faster than --max-connect-rate %g a second after a burst of %g;"
                " more are counted, not logged",
                source,
                rate.rate,
                rate.burst,
            )
        return 3

    async def authenticate(self, conn: Connection, request: Accept) -> int:
        """The password check; 0 if accepted, else the CONNACK refusal code
        (see :meth:`.Authenticator.check`)."""
        return await self.authenticator.check(conn, request)

    def admit(self, conn: Connection, request: Accept, opened: Opened | None, arrived: float) -> bytes | None:
        """Make ``conn`` the device's session, ending any other connection that held it;
        returns the CONNACK to send.

        ``opened`` is the persistent session :meth:`vet` found (None: a clean session,
        and any stored one is discarded); ``arrived``, when the CONNECT came
        (:meth:`connect_received`): the session's online event carries it. Send the
        CONNACK, apply :meth:`restored`, then call :meth:`announce`.

        None: a connection of the same client id whose CONNECT came *later* holds the
        session (this one's vetting took longer), so this one is closed unanswered
        rather than take over the newer: MQTT's takeover is by the newer connection.
        A device that gave up waiting for a CONNACK and connected again is the usual
        cause; its abandoned connection must not end the one it uses.
        """
        old = self.online.get(request.client_id)
        if old is not None and old is not conn:
            if old.online is not None and old.online.time > arrived:
                self._supersede(conn, old)
                return None
            # Its offline event (and Will) go out now, before the new one's online event.
            old.end(Offline.TAKEOVER)
            self.ended(old, Offline.TAKEOVER, "")
        if request.clean_session or request.fresh:
            self.wills.release(request.client_id)  # the old session ends: a waiting Will goes now
        else:
            self.wills.cancel(request.client_id)  # the session goes on: its Will never goes
        connack = self.online_sessions.admit(conn, request, opened, arrived)
        if connection_log.isEnabledFor(logging.INFO):
            level = conn.session.protocol_level
            user = "" if request.username is None else f", u'{request.username}'"
            connection_log.info(
                "New client connected from %s as %s (p%d, c%d, k%d%s).",
                conn.peer,
                request.client_id,
                2 if level == 4 else 1 if level == 3 else level,  # Mosquitto's numbers: 3.1.1 is p2
                1 if request.clean_session else 0,
                request.keep_alive,
                user,
            )
        return connack

    def _supersede(self, conn: Connection, newer: Connection) -> None:
        logger.info(
            "CONNECT of %s from %s dropped: %s connected later and holds the session",
            shown(conn.session.client_id),
            conn.peer,
            newer.peer,
        )
        conn.session.superseded()
        conn.end(Offline.SUPERSEDED)

    def ended(self, conn: Connection, reason: Offline, detail: str) -> None:
        """Bookkeeping when a connection ends; synchronous, so it runs even when cancelled.

        Idempotent: the first call's reason stands.
        """
        if conn.finished:
            return
        conn.finished = True
        self.connections.pop(conn, None)
        conn.stop_writing()
        self.fanout.forget(conn)
        was_online = self.online_sessions.release(conn)
        if was_online:
            will = conn.session.will
            # A DISCONNECT drops the Will in the session, unless it was MQTT 5's 0x04
            # ("disconnect with Will Message"), which keeps it to go out now.
            if will is not None and reason is not Offline.REFUSED:
                client_id = conn.session.client_id or ""
                # Checked again: the ACL may have been reloaded since the CONNECT.
                if not self.online_sessions.may_will(conn, client_id, will.topic):
                    self.counters["denied_wills"] += 1
                elif will.delay and conn.online is not None:
                    self.wills.hold(client_id, conn.online.epoch, will)  # MQTT 5's Will Delay
                else:
                    self.fanout.publish_will(client_id, will)
        self.offline_by_reason[reason.value] += 1
        if was_online and connection_log.isEnabledFor(logging.INFO):
            gone = _GONE.get(reason, f"disconnected ({reason.value}).")
            connection_log.info("Client %s %s", conn.session.client_id, gone)
        if was_online:
            if reason is Offline.KEEPALIVE_TIMEOUT:
                self.dashboard.detected(conn.stream.lag)
            self.online_sessions.detach(conn, reason)
        self.events.ended(conn, reason, detail, was_online)

    def _held(self, client_id: str) -> tuple[Collection[str], int]:
        """The filters the connection holding ``client_id`` here subscribes to, and their bytes."""
        conn = self.online.get(client_id)
        if conn is None:
            return (), 0
        subscriptions = self.broker.subscriptions
        return subscriptions.held(conn), subscriptions.held_bytes(conn)

    def reload_files(self) -> bool:
        """Re-read the ACL file and the password file (SIGHUP), each on its own: one that
        cannot be read or has a bad line keeps what it gave in force (logged). Sessions
        already accepted stay. Returns whether every file the server was given was re-read."""
        config = self.config
        acl = config.acl is None or reload_acl(config, self.counters)
        users = config.auth is None or config.auth.path is None or self.authenticator.reload()
        for door in self.doors:  # a listener's own files (per_listener_settings)
            listener = door.listener
            if listener.acl is not None:
                acl = reload_acl(listener, self.counters, door.name) and acl
            if listener.auth is not None:
                users = self.authenticator.reload(listener, door.name) and users
        return acl and users

    def reload_acl(self) -> bool:
        """SIGHUP's call (``__main__``): :meth:`reload_files`, the password file included,
        which an operator edits live as much as the ACL (Mosquitto reloads both)."""
        return self.reload_files()

    # -- the coordinator's host -------------------------------------------------------------

    def deliver(self, message: Publication, groups: Collection[str] | None = None, plain: bool = True) -> None:
        """A message for this worker's subscribers only (from the coordinator)."""
        self.broker.deliver(message, groups=groups, plain=plain)

    def evict(self, client_id: str, epoch: str, detail: str) -> None:
        """The device reconnected elsewhere: close this session (its offline event is out)."""
        conn = self.online_sessions.holding(client_id, epoch)
        if conn is not None:
            conn.end(Offline.TAKEOVER)
            self.ended(conn, Offline.TAKEOVER, detail)

    def transmit(self, client_id: str, epoch: str, packets: list[bytes], v5: bool = False) -> None:
        """A persistent session's messages (from the coordinator), if it is held here;
        ``v5``: written for MQTT 5.0 (the store writes what the client spoke when it
        opened the session; the fleet's, 3.1.1 always)."""
        conn = self.online_sessions.holding(client_id, epoch)
        if conn is not None:
            if conn.session.protocol_level == 5 and not v5:
                # A 5.0 PUBLISH has a property length more.
                packets = [from_v311(data) for data in packets]
            self.broker.write(conn, packets)

    def packets_in(self) -> int:
        """MQTT control packets received, the PINGREQs the engine answered itself included."""
        engine = self.engine
        return self.counters["packets_in"] + (0 if engine is None else engine.canned)

    def sessions(self) -> list[PresenceEvent]:
        """The online event of every session held here."""
        return self.online_sessions.sessions()

    def filters(self) -> set[str]:
        """Every filter this worker's subscribers hold."""
        return self.fanout.filters()

    # -- control -----------------------------------------------------------------------------

    async def shutdown(self, grace: float = 5.0) -> None:
        """End every connection with reason ``shutdown``, in the order subscribers need.

        New connections are refused first. Devices are ended next, and their offline
        events (and Wills) are routed; then, for up to ``grace`` seconds, the
        subscribers' queues are flushed, so that a dashboard hears every device go
        offline before its own connection closes; last, the subscribers are closed.
        Every connection gets its TCP close. Cancelling the server instead ends
        everything at once (the presence log still gets every event). A coordinator
        stuck (a fleet's Redis down or stalled) is waited for ``grace`` seconds without
        progress, 1 s more for the subscribers' reports, then :data:`LEAVE_TIMEOUT`, and
        the worker leaves without it (its one line says what was left undone).
        """
        for close in self.closers:
            close()
        with trio.move_on_after(grace):
            self.wills.flush()
            for conn in [c for c in self.connections if not c.subscriber]:
                conn.end(Offline.SHUTDOWN)
            # A device's offline event is reported when its task has finished. Polled:
            # an event for that moment would cost every connection's bookkeeping.
            while any(not c.subscriber for c in self.connections):  # noqa: ASYNC110
                await trio.sleep(0.01)
        # Every report published everywhere (other workers' devices' events included),
        await self._drain(grace)
        with trio.move_on_after(grace):
            # then each subscriber's queue must have been sent.
            while not all(c.flushed() for c in self.connections):  # noqa: ASYNC110
                await trio.sleep(0.01)
        for conn in list(self.connections):
            conn.end(Offline.SHUTDOWN)
        with trio.move_on_after(1.0):  # the subscribers' own offline reports, out before we exit
            while self.connections:  # noqa: ASYNC110
                await trio.sleep(0.01)
            await self.coordinator.flush()
        # The coordinator keeps to LEAVE_TIMEOUT and says itself what it could not do
        # (Redis down: one line, exit 0); this bound is for one that does not.
        with trio.move_on_after(LEAVE_TIMEOUT + 1.0):
            await self.coordinator.leave()

    async def _drain(self, idle: float, cap: float = DRAIN_CAP) -> None:
        """The coordinator drained: for ``idle`` seconds, and again while it keeps moving,
        up to ``cap``. A fleet node's reader may be a backlog behind after a mass
        disconnect (measured: 30 s at 100,000 devices on 2 cores), and its own events
        reach its presence log as it reads them back; a node stuck (Redis down) stops after ``idle``."""
        with trio.move_on_after(cap):
            while True:
                before = self.coordinator.progress()
                with trio.move_on_after(idle) as scope:
                    await self.coordinator.drain()
                if not scope.cancelled_caught or self.coordinator.progress() == before:
                    return

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
        conn = self.online_sessions.holding(key, event.epoch)
        if event.status == "online" and conn is not None:
            out["silent_for"] = round(conn.silent_for(), 3)  # held here: how silent right now
        return out

    def metrics(self) -> bytes:
        """Prometheus exposition text for this worker: its figures, its keeper's, its process's."""
        return render(self._registry)

    def figures(self) -> list[Metric]:
        """This worker's live presence figures, as Prometheus families."""
        return worker_figures(self)
