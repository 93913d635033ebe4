"""The heartbeat server: MQTT 3.1.1 keep-alive and presence on idlekeeper.

Bytes from a connection go to the sans-IO reader, packets to the session, and the
session's effects are carried out by the steps here (admit, refuse, subscribe,
route, end), which both engines share: the dense engine's protocol callbacks
(:mod:`.dense`, the default) and the streams engine's task per connection
(:mod:`.streams`). Deadlines are declared once per phase on the connection's watch
(a transport or a watched stream), and the keeper's one reaper enforces all of them:

- before CONNECT: an absolute ``connect_timeout`` from accept;
- after CONNECT: a receive timeout of 1.5 × keep-alive (the spec's rule; any
  control packet counts), or the server's ``max_idle`` when keep-alive is 0; and a
  packet that has started arriving must be complete within that same time, so
  trickled bytes cannot keep a dead device "alive";
- while the server is sending to a subscriber: ``send_timeout`` without progress.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import os
import select
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

import idlekeeper
from idlekeeper import Reason

from ..config import WorkerConfig
from ..prometheus import Families, Metric, render, worker_registry
from .acl import AclFile, AclFileError
from .auth import AuthResult, PasswordFile
from .broker import Broker
from .budget import DEFAULT_MAX_OUTBOX_BYTES, DEFAULT_MAX_SUBSCRIBER_BYTES, SendBudget
from .coordination import Coordinator
from .coordination.authority import epoch_of
from .coordination.inprocess import InProcessCoordinator
from .coordination.retention import MqttState
from .encoders import encode_publish
from .outbox import DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_WINDOW, Message, Outbox
from .packets import ProtocolError
from .persistent import DEFAULT_EXPIRY, Acked, Attach, Detach, Inbound, Opened, Push, SessionStore, Subscribed
from .presence import REFUSED, Offline, PresenceEvent, PresenceSink
from .retained import DEFAULT_MAX_BYTES, RetainedStore
from .session import (
    DEFAULT_MAX_QOS,
    DEFAULT_PRESENCE_PREFIX,
    Accept,
    Acknowledged,
    AddSubscription,
    Denied,
    HoldInbound,
    ReleaseInbound,
    RemoveSubscription,
    Route,
    Session,
    State,
)
from .throttle import Admission, AuthGate, Hold, ThrottlePolicy, source_key

__all__ = ["Connection", "Exchange", "HeartbeatConfig", "HeartbeatServer", "mqtt_state"]

logger = logging.getLogger("servers.heartbeat")

ENGINES = ("dense", "streams")

Exchange = Acknowledged | HoldInbound | ReleaseInbound | Denied
"""Session effects both engines hand to :meth:`HeartbeatServer.exchanged` as they are."""
"""How connections are served: see :mod:`.dense` and :mod:`.streams`."""

# The refusal CONNACK codes (MQTT-3.2.2-3), by name, for a refusal's record.
REFUSALS = {
    1: "unacceptable-protocol-version",
    2: "identifier-rejected",
    3: "server-unavailable",
    4: "bad-credentials",
    5: "not-authorized",
}

# A refused or misbehaving client gets this long to read its CONNACK before the close.
GOODBYE_TIMEOUT = 1.0

# What is queued for subscribers' sockets is bounded in bytes (``max_subscriber_bytes``,
# ``max_outbox_bytes``): see :mod:`.budget`.
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
    """Highest QoS granted to subscribers and routed for publishers: 0, 1 or 2."""
    max_inflight: int = DEFAULT_WINDOW
    """QoS 1 and 2 messages sent to a client and not yet acknowledged, at most."""
    max_queued: int = DEFAULT_MAX_QUEUED
    """QoS 1 and 2 messages queued per client behind those in flight (while it is away, too)."""
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES
    """Bytes queued per client behind those in flight."""
    max_subscriber_bytes: int = DEFAULT_MAX_SUBSCRIBER_BYTES
    """Bytes queued for one subscriber's socket; beyond, its QoS 0 messages are dropped (see :mod:`.budget`)."""
    max_outbox_bytes: int = DEFAULT_MAX_OUTBOX_BYTES
    """Bytes queued for all subscribers' sockets in this worker; beyond, QoS 0 messages are dropped."""
    session_expiry: float = DEFAULT_EXPIRY
    """Seconds a persistent session (CleanSession=0) is kept after its client left."""
    retain_presence: bool = True
    """Presence events are retained: a new subscription to ``presence/#`` first gets every device's last one."""
    presence_offline_ttl: float | None = 7 * 24 * 3600.0
    """Seconds an offline device's presence stays retained (None: as long as its record is kept)."""
    max_retained_bytes: int = DEFAULT_MAX_BYTES
    """Bytes of retained topics and payloads kept, presence not included; beyond, new ones are refused."""
    engine: str = "dense"
    """``dense`` (one task serves every connection) or ``streams`` (a task per connection)."""
    coalesce: float = 0.0
    """Dense engine: seconds packets are gathered per pass while they keep coming (CPU for latency)."""
    max_device_records: int = 1_000_000
    """Presence records kept for /devices; the longest-offline are forgotten first."""
    auth: PasswordFile | None = None
    auth_throttle: ThrottlePolicy | None = field(default_factory=ThrottlePolicy)
    """How failed password checks are throttled per source address and per username
    (see :mod:`.throttle`); None: not at all."""
    auth_threads: int = 1
    """Password checks hashed at once, each in a worker thread (the event loop never hashes)."""
    acl: AclFile | None = None
    """Who may subscribe to and publish on what (Mosquitto's ``acl_file`` format); None: anyone."""
    node: str = ""
    """This gateway's name in a fleet (empty on a lone machine); part of every session's epoch."""
    extra_sinks: list[PresenceSink] = field(default_factory=list)
    """Presence sinks of the default (in-process) coordinator; other coordinators hold their own."""

    def __post_init__(self) -> None:
        if self.max_qos not in (0, 1, 2):
            raise ValueError(f"max_qos must be 0, 1 or 2, not {self.max_qos}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, not {self.max_inflight}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.auth_threads < 1:
            raise ValueError(f"auth_threads must be at least 1, not {self.auth_threads}")
        if self.max_subscriber_bytes < 1 or self.max_outbox_bytes < 1:
            raise ValueError("max_subscriber_bytes and max_outbox_bytes must be at least 1")
        if self.tls is not None and self.engine == "dense":
            # TLS runs on trio's SSLStream, a stream per connection: the streams engine.
            logger.warning("TLS is served by the streams engine (a task per connection): engine streams selected")
            self.engine = "streams"


def mqtt_state(config: HeartbeatConfig) -> MqttState:
    """The sessions and retained messages a coordinator keeps, bounded as ``config`` says."""
    return MqttState(
        session_store(config),
        RetainedStore(max_bytes=config.max_retained_bytes),
        retain_presence=config.retain_presence,
        presence_offline_ttl=config.presence_offline_ttl,
    )


def acl_reader(config: HeartbeatConfig) -> Callable[[str | None, str, str], bool] | None:
    """Whether (username, client id) may read a topic under the ACL in force, for the
    stores that route to absent clients; None when there is no ACL."""
    if config.acl is None:
        return None

    def may_read(username: str | None, client_id: str, topic: str) -> bool:
        acl = config.acl  # looked up each time: a SIGHUP reload replaces it
        return acl is None or acl.can_read(username, client_id, topic)

    return may_read


def session_store(config: HeartbeatConfig) -> SessionStore:
    """The persistent sessions' store, bounded as ``config`` says, reading the ACL in force."""
    return SessionStore(
        max_qos=config.max_qos,
        window=config.max_inflight,
        max_queued=config.max_queued,
        max_queued_bytes=config.max_queued_bytes,
        expiry=config.session_expiry,
        may_read=acl_reader(config),
    )


class ClientRules:
    """The ACL as it applies to one client (its username and client id), for its session."""

    __slots__ = ("server", "username", "client_id")

    def __init__(self, server: HeartbeatServer, username: str | None, client_id: str) -> None:
        self.server = server
        self.username = username
        self.client_id = client_id

    def may_subscribe(self, topic_filter: str) -> bool:
        """A read grant covers every topic of the filter (else 0x80 in SUBACK)."""
        acl = self.server.config.acl
        return acl is None or acl.can_read_filter(self.username, self.client_id, topic_filter)

    def may_publish(self, topic: str) -> bool:
        """The client may write ``topic`` (else its PUBLISH is dropped and counted)."""
        acl = self.server.config.acl
        return acl is None or acl.can_publish(self.username, self.client_id, topic)

    def may_read(self, topic: str) -> bool:
        """A message on ``topic`` may be delivered to the client (checked per message)."""
        acl = self.server.config.acl
        return acl is None or acl.can_read(self.username, self.client_id, topic)


class Connection:
    """One client connection, as the server sees it, whichever engine serves it.

    ``stream`` is the connection's watch: a watched stream (streams engine) or a
    dense engine's transport; both carry the deadlines the server sets per phase.
    Subclasses say how bytes reach a subscriber (:meth:`push`).
    """

    __slots__ = ("ended_by", "finished", "held", "online", "peer", "persistent", "refusal", "session", "stream")

    def __init__(self, stream: idlekeeper.Watch, peer: str, session: Session) -> None:
        self.stream = stream
        self.peer = peer
        self.online: PresenceEvent | None = None
        """The session's online event once CONNECT is accepted (its epoch names the session)."""
        self.session = session
        self.ended_by: Offline | None = None
        self.finished = False
        self.held: Outbox | None = None
        """QoS 1 and 2 messages sent and not yet acknowledged, and those queued behind them
        (a clean session's; a persistent session's live in the coordinator's store)."""
        self.persistent = False
        """CleanSession=0: the session outlives the connection, in the coordinator."""
        self.refusal = 0
        """The CONNACK code its CONNECT was refused with (0: not refused by admission)."""

    def silent_for(self, now: float | None = None) -> float:
        """Seconds since the client last sent anything (since accept, if nothing yet)."""
        return self.stream.silent_for(now)

    def end(self, reason: Offline) -> None:
        """Close this connection from outside its own task (takeover, shutdown)."""
        if self.ended_by is None:
            self.ended_by = reason
        self.stream.cancel()

    @property
    def subscriber(self) -> bool:
        """Whether the client has subscribed (it then receives messages)."""
        raise NotImplementedError

    def flushed(self) -> bool:
        """Whether everything queued for the client has been handed to the kernel."""
        raise NotImplementedError

    def congested(self) -> bool:
        """Whether the client's queue is long enough that bulk sends should wait."""
        raise NotImplementedError

    def push(self, data: bytes, *, held: bool = False) -> None:
        """Queue bytes for the client (the broker's budget let them in). ``held``: they
        may come before any subscription (a resumed session's resends)."""
        raise NotImplementedError

    def queued(self) -> int:
        """Bytes queued for the client's socket and not yet taken by the kernel."""
        raise NotImplementedError

    def overflow(self, detail: str) -> None:
        """It fell too far behind what it is sent (see :mod:`.budget`): end it with
        ``send-overflow``, like any other end (one offline event, its Will)."""
        if self.ended_by is not None or self.finished:
            return
        logger.warning("subscriber %s (%s) cut off: send-overflow, %s", self.peer, self.session.client_id, detail)
        self.end(Offline.SEND_OVERFLOW)

    def may_read(self, topic: str) -> bool:
        """Whether the ACL lets a message on ``topic`` reach this client."""
        rules = self.session.permissions
        return rules is None or rules.may_read(topic)

    def stop_writing(self) -> None:
        """The connection ended: stop whatever sends its queue."""


def source_of(stream: idlekeeper.Watch) -> str:
    """The client's address, without the port (``?`` if unknown)."""
    try:
        return str(stream.socket.getpeername()[0])  # type: ignore[union-attr]
    except (OSError, AttributeError, IndexError):
        return "?"


def peer_closed(stream: idlekeeper.Watch) -> bool:
    """Whether the client has closed its side (a FIN or a reset is waiting), without
    reading: a password check queued for a client that gave up is not worth hashing."""
    sock = stream.socket
    flags = getattr(select, "POLLRDHUP", 0)
    if sock is None or not flags or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    try:
        poller.register(sock.fileno(), flags)
    except (OSError, ValueError):
        return True
    return bool(poller.poll(0))


def peer_of(stream: idlekeeper.Watch) -> str:
    """``host:port`` of the client, for logs and presence events."""
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
        self.nursery = nursery
        """Where the server starts its tasks (password checks, writers)."""
        self.coordinator: Coordinator = coordinator or InProcessCoordinator(
            config.extra_sinks,
            presence_prefix=config.presence_prefix,
            max_records=config.max_device_records,
            state=mqtt_state(config),
        )
        self.online: dict[str, Connection] = {}
        self.connections: set[Connection] = set()
        self.unsettled: dict[Connection, list[AddSubscription]] = {}
        """Connections whose next reply (the SUBACK) waits for :meth:`settle`, with the
        subscriptions whose retained messages follow it."""
        self._settle_failing = False
        budget: SendBudget[Connection] = SendBudget(
            lambda conn: conn.queued(),
            trio.current_time,
            config.max_subscriber_bytes,
            config.max_outbox_bytes,
            grace=config.send_timeout,
        )
        self.broker: Broker[Connection] = Broker(config.max_qos, budget, config.max_inflight, config.max_queued)
        self.broker.checks_reads = config.acl is not None
        self.offline_by_reason: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.auth_gate = AuthGate(config.auth_throttle) if config.auth_throttle is not None else None
        """Failed password checks per source address and per username, and their delays."""
        # Checks wait their turn here; the second limiter only gives the threads their
        # own pool (never contended: the first admits as many).
        self.auth_turns = trio.CapacityLimiter(config.auth_threads)
        self._auth_threads = trio.CapacityLimiter(config.auth_threads)
        self.port = 0
        self._announced: set[str] = set()
        self._epochs = itertools.count(1)
        self._pid = os.getpid()
        self.engine: idlekeeper.Engine | None = None
        """The dense engine serving the connections, if that is the engine."""
        self.stop_accepting: Callable[[], None] = lambda: None
        """Closes the listeners (the first step of a shutdown); set by the engine serving them."""
        self._registry = worker_registry(keeper.stats, {"worker": str(config.worker)}, self.figures)

    # -- what both engines share: each step of a connection's life, synchronous ---------

    def opened(self, conn: Connection) -> None:
        """A connection was accepted: count it and give it ``connect_timeout`` for CONNECT."""
        self.connections.add(conn)
        self.counters["connections"] += 1
        conn.stream.deadline = trio.current_time() + self.config.connect_timeout

    def protocol_error(self, conn: Connection, exc: ProtocolError) -> bytes | None:
        """Count and log a violation; returns the CONNACK refusal to send, if the spec has one."""
        session = conn.session
        self.counters["protocol_errors"] += 1
        logger.info("protocol error from %s (%s): %s %s", conn.peer, session.client_id, exc.reason, exc.detail)
        if exc.connack_code is not None and session.state in (State.AWAITING_CONNECT, State.CONNECTING):
            return session.refused(exc.connack_code)
        return None

    def admission(self, conn: Connection, request: Accept, code: int) -> bytes | None:
        """After the password check (``code``, 0 if accepted): the refusal CONNACK, or None to admit."""
        cfg = self.config
        if not code and len(self.online) >= cfg.max_connections and request.client_id not in self.online:
            code = 3  # server unavailable: the polite refusal beyond the cap
            self.counters["refused_capacity"] += 1
        if not code:
            return None
        return self._refuse(conn, code)

    def _refuse(self, conn: Connection, code: int) -> bytes:
        """Refuse the CONNECT with ``code``: counted, and :meth:`ended` records it as a refusal."""
        self.counters[f"refused_{code}"] += 1
        conn.ended_by = Offline.REFUSED
        conn.refusal = code
        return conn.session.refused(code)

    def waits(self, request: Accept) -> bool:
        """Whether admitting ``request`` needs :meth:`vet` (a password check or a stored session)."""
        return self.config.auth is not None or not request.clean_session

    async def vet(self, conn: Connection, request: Accept) -> tuple[bytes | None, Opened | None]:
        """The slow part of admission: the password check, then (CleanSession=0) the
        stored session from the coordinator. Returns the refusal CONNACK, or the session
        to resume (None for a clean one); then :meth:`admit`."""
        if self.identified_by_certificate:
            # The certificate was the credential, checked at the handshake (Mosquitto's
            # use_identity_as_username: no password file); without a CN, no username.
            code = 0 if self.username(conn, request) is not None else 4
        else:
            code = await self.authenticate(conn, request)
        refusal = self.admission(conn, request, code)
        if refusal is not None or request.clean_session:
            return refusal, None
        opened = await self.coordinator.open_session(request.client_id, self.username(conn, request))
        if opened is None:
            return self._refuse(conn, 3), None  # rather than a new session that loses the stored one
        return None, opened

    @property
    def identified_by_certificate(self) -> bool:
        """Clients are named by their TLS certificate's CN (``--use-identity-as-username``)."""
        tls = self.config.tls
        return tls is not None and tls.use_identity_as_username

    def username(self, conn: Connection, request: Accept) -> str | None:
        """Who the client is, for ACLs and presence: its certificate's CN when clients
        are identified by certificate (the CONNECT's username is then ignored), else
        the CONNECT's username."""
        if self.identified_by_certificate:
            return idlekeeper.peer_common_name(conn.stream.stream)
        return request.username

    def admit(self, conn: Connection, request: Accept, opened: Opened | None = None) -> bytes:
        """Make ``conn`` the device's session; returns the CONNACK to send.

        ``opened`` is the persistent session :meth:`vet` found (None: a clean session,
        and any stored one is discarded). Send the CONNACK, apply :meth:`restored`,
        then call :meth:`announce`.
        """
        cfg = self.config
        old = self.online.get(request.client_id)
        if old is not None and old is not conn:
            # Its offline event (and Will) go out now, before the new one's online event.
            old.end(Offline.TAKEOVER)
            self.ended(old, Offline.TAKEOVER, "")
        self.online[request.client_id] = conn
        if cfg.acl is not None:
            # Read from the config on every check, so a reload (SIGHUP) applies at once.
            conn.session.permissions = ClientRules(self, self.username(conn, request), request.client_id)
        stream = conn.stream
        keep_alive = min(request.keep_alive, cfg.max_keepalive) if request.keep_alive else 0
        if keep_alive:
            # MQTT counts the keep-alive from the CONNECT, which a coalescing engine may
            # have read up to a window after it came. Only so far back, though: after a
            # stall, a client that times its PINGREQ from the CONNACK still has 1.25 K.
            stream.receive_timeout_since(1.5 * keep_alive, trio.current_time() - keep_alive / 4)
        else:
            stream.receive_timeout = cfg.max_idle
        # Stamped before CONNACK goes out: a device can only reconnect elsewhere after
        # reading it, so a later session always carries a later time (the registry
        # orders crossing claims by it).
        conn.online = self._event(
            conn,
            "online",
            None,
            epoch=epoch_of(cfg.worker, self._pid, next(self._epochs), cfg.node),
            username=(self.username(conn, request) or "") if self.identified_by_certificate else "",
        )
        if opened is None:
            self.coordinator.discard_session(request.client_id)
            return conn.session.accepted()
        conn.persistent = True
        return conn.session.accepted(opened.present, opened.inbound)

    @staticmethod
    def restored(opened: Opened | None) -> list[AddSubscription]:
        """The subscriptions a resumed session brings back, to apply like new ones."""
        if opened is None:
            return []
        return [AddSubscription(topic_filter, qos, suback=False) for topic_filter, qos in opened.subscriptions.items()]

    def announce(self, conn: Connection, *, attach: bool = True) -> None:
        """Publish an admitted session online: the coordinator ends the device's
        session on any other worker or gateway. Call it before anything can end the
        session (a takeover must find it announced, or its offline event is lost).
        With ``attach`` (its CONNACK is out) it also :meth:`attach`-es."""
        online = conn.online
        assert online is not None
        self.coordinator.online(online)
        if attach:
            self.attach(conn)

    def attach(self, conn: Connection) -> None:
        """The CONNACK is out: a persistent session's resends and what queued while it
        was away may follow it (not if the session ended meanwhile)."""
        online = conn.online
        if conn.persistent and online is not None and not conn.finished:
            self.coordinator.session(Attach(online.client_id or "", online.epoch))

    def published(self, message: Route) -> None:
        """A client's PUBLISH: count it and route it to every subscriber (retained,
        it is kept for later ones; existing subscribers get it without the flag)."""
        self.counters["messages_in"] += 1
        if message.retain:
            self.coordinator.retain(message.topic, message.payload, message.qos)
        self.route(message.topic, message.payload, message.qos)

    def subscribed(self, conn: Connection, effect: AddSubscription) -> None:
        """The client subscribed: from now on it is sent what matches (within ``send_timeout``)."""
        if conn.finished:
            return  # its end has been dealt with: nothing would ever drop this subscription
        self.broker.subscriptions.subscribe(conn, effect.topic_filter, effect.qos)
        conn.stream.send_timeout = self.config.send_timeout
        if conn.persistent:
            self.coordinator.session(Subscribed(conn.session.client_id or "", effect.topic_filter, effect.qos))
        changed = self._announce()
        if effect.suback and (conn in self.unsettled or ((changed or conn.persistent) and self.coordinator.settles())):
            self.unsettled.setdefault(conn, []).append(effect)  # retained ones go after the SUBACK
        else:
            # After the SUBACK, which the session's effects put after this one.
            self.nursery.start_soon(self._send_retained, conn, effect)

    async def settle(self, conn: Connection) -> None:
        """Hold the SUBACK of a subscription others did not route to yet until they do.

        Without it a message published on another worker just after the SUBACK could
        miss the subscriber: filters reach other workers a few milliseconds later. Costs
        a round trip to every worker, only when a filter is new here or the session
        persistent; a stalled worker holds it up for at most the lookup timeout."""
        subscriptions = self.unsettled.pop(conn, [])
        self.counters["subscribe_settles"] += 1
        settled = await self.coordinator.settle()
        for effect in subscriptions:  # they start once the caller has written the SUBACK
            self.nursery.start_soon(self._send_retained, conn, effect)
        if settled:
            self._settle_failing = False
            return
        self.counters["subscribe_settle_timeouts"] += 1
        if not self._settle_failing:  # once per spell, not once per SUBSCRIBE of a stall
            self._settle_failing = True
            logger.warning(
                "a SUBACK to %s went before every worker confirmed its subscription (one stalled?);"
                " heartbeat_subscribe_settle_timeouts_total counts them",
                conn.peer,
            )

    async def _send_retained(self, conn: Connection, effect: AddSubscription) -> None:
        """The retained messages the new subscription matches, page by page, with the
        retain flag, at min(their QoS, granted); a page waits while the client's queue
        is long, so a million of them never sit in memory at once."""
        cursor: str | None = None
        while True:
            messages, cursor = await self.coordinator.retained(effect.topic_filter, cursor)
            if conn.finished:
                return
            for m in messages:
                self._give(conn, m.topic, m.payload, min(m.qos, effect.qos), retain=True)
            if cursor is None:
                return
            # Polled: an event on every write of every connection would cost more.
            while conn.congested() and not conn.finished:  # noqa: ASYNC110
                await trio.sleep(0.05)

    def _give(self, conn: Connection, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """One message for one subscriber, by the path its QoS and session take."""
        if not conn.may_read(topic):
            self.broker.denied += 1
            return
        if qos == 0:
            self.broker.enqueue(conn, encode_publish(topic, payload, retain=retain))
        elif conn.persistent:
            self.coordinator.session(Push(conn.session.client_id or "", topic, payload, qos, retain))
        else:
            self.broker.hold(conn, Message(topic, payload, qos, retain))
        self.broker.delivered += 1

    def unsubscribed(self, conn: Connection, effect: RemoveSubscription) -> None:
        """The client dropped a subscription."""
        self.broker.subscriptions.unsubscribe(conn, effect.topic_filter)
        if conn.persistent:
            self.coordinator.session(Subscribed(conn.session.client_id or "", effect.topic_filter, None))
        self._announce()

    def exchanged(self, conn: Connection, effect: Exchange) -> None:
        """A step of a QoS 1 or 2 exchange: the client's outbox (or its persistent session)
        takes it; or a PUBLISH that was denied, counted."""
        client_id = conn.session.client_id or ""
        if isinstance(effect, Denied):
            self.counters["denied_publishes"] += 1
            logger.info("publish from %s (%s) to %r denied", conn.peer, client_id, effect.topic)
            return
        if isinstance(effect, Acknowledged):
            if conn.persistent:
                online = conn.online
                assert online is not None
                self.coordinator.session(Acked(client_id, online.epoch, effect.kind, effect.packet_id))
                return
            box = conn.held
            if box is None:
                return  # an ack for nothing we sent: MQTT leaves it to the server
            kind = effect.kind
            packets = box.puback if kind == "puback" else box.pubrec if kind == "pubrec" else box.pubcomp
            self.broker.write(conn, packets(effect.packet_id))
        elif conn.persistent:
            held = isinstance(effect, HoldInbound)
            self.coordinator.session(Inbound(client_id, effect.packet_id, held))

    def reload_acl(self) -> bool:
        """Re-read the ACL file (SIGHUP); a broken file keeps the rules in force (logged)."""
        acl = self.config.acl
        if acl is None:
            return False
        try:
            self.config.acl = acl.reload()
        except AclFileError as exc:
            logger.error("ACL file not reloaded, the old rules stay: %s", exc)
            return False
        self.counters["acl_reloads"] += 1
        logger.warning("ACL file reloaded: %d rules", len(self.config.acl.rules))
        return True

    async def authenticate(self, conn: Connection, request: Accept) -> int:
        """The password check; 0 if accepted, else the CONNACK refusal code.

        Credentials verified before are accepted without hashing (the file's cache);
        others are hashed in a worker thread, ``auth_threads`` at a time, so the event
        loop never hashes. The throttle (:mod:`.throttle`) refuses, unchecked and with
        the same code as a wrong password, what comes from a source address or for a
        username that failed too often; it is asked again when a queued check's turn
        comes, so a burst queued before the first failures were counted is not hashed
        either, nor is the check of a client that has hung up meanwhile.
        """
        auth = self.config.auth
        if auth is None:
            return 0
        username, password = request.username, request.password
        if username is None:
            self.counters["auth_failures"] += 1
            return int(AuthResult.NOT_AUTHORIZED)
        source = source_key(source_of(conn.stream))
        verdict = self._admit_credentials(source, username, password)
        if verdict is not None:
            return verdict
        gate = self.auth_gate
        async with self.auth_turns:
            verdict = self._admit_credentials(source, username, password)
            if verdict is not None:
                return verdict
            if peer_closed(conn.stream):
                self.counters["auth_abandoned"] += 1
                return int(AuthResult.BAD_CREDENTIALS)
            hold = gate.begin(source, username, trio.current_time()) if gate is not None else Hold(False, False)
            self.counters["auth_checks"] += 1
            try:
                result = await trio.to_thread.run_sync(auth.verify, username, password, limiter=self._auth_threads)
            except BaseException:
                if gate is not None:
                    gate.abandon(source, username, hold)
                raise
        accepted = result is AuthResult.ACCEPTED
        if gate is not None:
            gate.outcome(source, username, trio.current_time(), accepted, hold)
        if accepted:
            return 0
        self.counters["auth_failures"] += 1
        if gate is not None:
            now = trio.current_time()
            delay = max(gate.sources.wait(source, now), gate.users.wait(username, now))
            if delay > 0:
                logger.info("password of %r from %s refused: more checks wait %.1f s", username, source, delay)
        return int(result)

    def _admit_credentials(self, source: str, username: str, password: bytes | None) -> int | None:
        """Before hashing: 0 to accept (verified before), a refusal code (throttled), or
        None to check the password."""
        auth = self.config.auth
        assert auth is not None
        known = auth.cached(username, password)
        gate = self.auth_gate
        verdict = (
            Admission.CHECK if gate is None else gate.admit(source, username, trio.current_time(), known_good=known)
        )
        if known and verdict is not Admission.REFUSE_SOURCE:
            self.counters["auth_cache_hits"] += 1
            return 0
        if verdict is Admission.CHECK:
            return None
        self.counters["auth_throttled"] += 1
        return int(AuthResult.BAD_CREDENTIALS)

    def reason(self, conn: Connection, outcome: Offline | None) -> Offline:
        """Why a connection ended: who ended it, else which deadline, else ``outcome``."""
        if conn.ended_by is not None:
            return conn.ended_by
        stream = conn.stream
        if stream.expired:
            if conn.session.state is not State.CONNECTED:
                return Offline.CONNECT_TIMEOUT
            return Offline.SEND_TIMEOUT if stream.reason is Reason.SEND else Offline.KEEPALIVE_TIMEOUT
        return outcome or Offline.CONNECTION_LOST

    def packet_deadline(self, conn: Connection, partial: bool) -> None:
        """A packet that has begun must be complete within the keep-alive window."""
        stream = conn.stream
        if partial and stream.deadline == math.inf:
            window = stream.receive_timeout
            if window is not None:
                stream.deadline = trio.current_time() + window
        elif not partial and stream.deadline != math.inf:
            stream.deadline = None

    def route(self, topic: str, payload: bytes, qos: int) -> int:
        """Deliver a message to every subscriber of ``topic``, here and on other workers.

        Returns how many local subscribers got it; the coordinator passes it on to
        other workers or gateways whose subscribers want it.
        """
        self.coordinator.route(topic, payload, qos)
        return self.broker.deliver(topic, payload, qos)

    # -- presence ------------------------------------------------------------------------

    def ended(self, conn: Connection, reason: Offline, detail: str) -> None:
        """Bookkeeping when a connection ends; synchronous, so it runs even when cancelled.

        Idempotent: the first call's reason stands.
        """
        if conn.finished:
            return
        conn.finished = True
        self.connections.discard(conn)
        self.unsettled.pop(conn, None)
        conn.stop_writing()
        self.broker.forget(conn)
        if self.broker.subscriptions.has(conn):
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
                if will.retain:
                    self.coordinator.retain(will.topic, will.message, will.qos)
                self.route(will.topic, will.message, will.qos)
        self.offline_by_reason[reason.value] += 1
        if was_online and conn.online is not None and conn.persistent and client_id is not None:
            self.coordinator.session(Detach(client_id, conn.online.epoch))
        if was_online and conn.online is not None:
            event = self._event(conn, "offline", reason, detail, epoch=conn.online.epoch, username=conn.online.username)
            # Exactly once, fleet-wide: the coordinator drops it if the session was already ended.
            self.coordinator.offline(event, forget=session.assigned)
        elif reason is Offline.REFUSED:
            # Not the device's presence: the id was only asked for, by whoever knew it.
            self.coordinator.note(self._refused_event(conn, detail))
        elif client_id is None:
            self.coordinator.note(self._event(conn, "offline", reason, detail))

    def _refused_event(self, conn: Connection, detail: str) -> PresenceEvent:
        """The record of a refused CONNECT: status ``refused``, no client id (only the one
        claimed), so no reader takes it for the named device's presence; see :mod:`.presence`."""
        session = conn.session
        code = REFUSALS.get(conn.refusal, f"code-{conn.refusal}")
        claimed = "" if session.assigned or session.client_id is None else session.client_id
        event = self._event(conn, REFUSED, Offline.REFUSED, f"{code}: {detail}" if detail else code)
        return dataclasses.replace(event, client_id=None, claimed_client_id=claimed)

    def _event(
        self,
        conn: Connection,
        status: str,
        reason: Offline | None,
        detail: str = "",
        epoch: str = "",
        username: str = "",
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
            username=username,
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
            self.ended(conn, Offline.TAKEOVER, detail)

    def transmit(self, client_id: str, epoch: str, packets: list[bytes]) -> None:
        """A persistent session's messages (from the coordinator), if it is held here."""
        conn = self.online.get(client_id)
        if conn is not None and conn.online is not None and conn.online.epoch == epoch:
            self.broker.write(conn, packets)

    def sessions(self) -> list[PresenceEvent]:
        """The online event of every session held here."""
        return [c.online for c in self.online.values() if c.online is not None]

    def filters(self) -> set[str]:
        """Every filter this worker's subscribers hold."""
        return self.broker.subscriptions.filters()

    def _announce(self) -> bool:
        """Tell the coordinator if this worker's filters changed; returns whether they did."""
        filters = self.filters()
        if filters == self._announced:
            return False
        self._announced = filters
        self.coordinator.filters_changed(filters)
        return True

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
        self.stop_accepting()
        with trio.move_on_after(grace):
            for conn in [c for c in self.connections if not c.subscriber]:
                conn.end(Offline.SHUTDOWN)
            # A device's offline event is reported when its task has finished. Polled:
            # an event for that moment would cost every connection's bookkeeping.
            while any(not c.subscriber for c in self.connections):  # noqa: ASYNC110
                await trio.sleep(0.01)
            # Every report published everywhere (other workers' devices' events included),
            await self.coordinator.drain()
            # then each subscriber's queue must have been sent.
            while not all(c.flushed() for c in self.connections):  # noqa: ASYNC110
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

    def _auth_figures(self, f: Families) -> None:
        if self.config.auth is None:
            return
        f.gauge(
            "heartbeat_auth_queue",
            "Password checks waiting for a thread (--auth-threads).",
            self.auth_turns.statistics().tasks_waiting,
        )
        gate = self.auth_gate
        if gate is None:
            return
        now = trio.current_time()
        for kind, throttle in (("source", gate.sources), ("user", gate.users)):
            delayed, longest = throttle.delayed(now)
            f.gauge(f"heartbeat_auth_delayed_{kind}s", f"{kind.capitalize()} keys whose delay runs now.", delayed)
            f.gauge(f"heartbeat_auth_{kind}_delay_seconds", f"The longest delay a {kind} key has left.", longest)
            f.gauge(
                f"heartbeat_auth_tracked_{kind}s", f"{kind.capitalize()} keys with failures remembered.", len(throttle)
            )

    def figures(self) -> list[Metric]:
        """This worker's live presence figures, as Prometheus families."""
        f = Families({"worker": str(self.config.worker)})
        f.gauge("heartbeat_devices_online", "Devices with a live, accepted MQTT connection.", len(self.online))
        f.gauge("heartbeat_connections", "Open client connections, handshaking ones included.", len(self.connections))
        f.counter("heartbeat_messages_out_total", "Messages delivered to subscribers.", self.broker.delivered)
        f.counter_by(
            "heartbeat_messages_dropped_total",
            "Messages dropped for subscribers, by reason: subscriber-bytes and total-bytes (QoS 0 beyond "
            "--max-subscriber-bytes or --max-outbox-bytes), max-queued (QoS 1/2 beyond the outbox's queue).",
            "reason",
            self.broker.dropped_by,
        )
        budget = self.broker.budget
        f.gauge(
            "heartbeat_outbox_bytes",
            "Bytes queued for subscribers' sockets in this worker (at most; exact after a recount).",
            budget.total,
        )
        f.gauge(
            "heartbeat_outbox_bytes_peak",
            "The most bytes queued for subscribers' sockets at once.",
            budget.peak_total,
        )
        f.gauge(
            "heartbeat_subscriber_bytes_peak",
            "The most bytes queued for one subscriber's socket.",
            budget.peak_subscriber,
        )
        f.gauge(
            "heartbeat_subscribers_behind",
            "Subscribers losing messages with over half their bound queued.",
            budget.behind,
        )
        f.counter(
            "heartbeat_denied_deliveries_total",
            "Messages not delivered: the ACL does not let the subscriber read the topic.",
            self.broker.denied,
        )
        f.counter_by(
            "heartbeat_offline_total",
            "Connections ended, by reason.",
            "reason",
            {reason.value: self.offline_by_reason.get(reason.value, 0) for reason in Offline},
        )
        for name, help_text in _COUNTERS:
            f.counter(f"heartbeat_{name}_total", help_text, self.counters.get(name, 0))
        self._auth_figures(f)
        engine = self.engine
        if engine is not None:
            f.counter("heartbeat_engine_passes_total", "Passes of the dense engine's loop.", engine.passes)
            f.counter(
                "heartbeat_engine_accept_errors_total",
                "Accepts that failed for lack of descriptors or memory (each pauses accepting 0.1 s).",
                engine.accept_errors,
            )
            f.counter(
                "heartbeat_engine_callback_errors_total",
                "Protocol callbacks that raised (each closed its own connection).",
                engine.callback_errors,
            )
        return f.families + self.coordinator.figures()


_COUNTERS: Iterable[tuple[str, str]] = (
    ("connections", "Connections accepted."),
    ("packets_in", "MQTT control packets received."),
    ("messages_in", "PUBLISH messages received and routed."),
    ("protocol_errors", "Connections closed for violating MQTT 3.1.1."),
    ("auth_failures", "CONNECTs refused for bad or missing credentials (after a check)."),
    ("auth_throttled", "CONNECTs refused unchecked: their source address or username failed too often."),
    ("auth_checks", "Passwords hashed (each in a worker thread)."),
    ("auth_cache_hits", "CONNECTs accepted without hashing: credentials verified before."),
    ("auth_abandoned", "Password checks skipped: the client hung up while its check waited its turn."),
    ("refused_capacity", "CONNECTs refused because the worker was at its connection cap."),
    ("wills_published", "Will messages published for devices that died."),
    ("denied_publishes", "PUBLISHes dropped: the ACL (or the presence prefix) does not let the client write there."),
    ("acl_reloads", "ACL file reloads (SIGHUP)."),
    ("subscribe_settles", "SUBACKs held until every other worker routed by the new subscription."),
    ("subscribe_settle_timeouts", "SUBACKs sent before every other worker confirmed (one stalled or gone)."),
)
