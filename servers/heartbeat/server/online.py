"""The sessions this worker holds: which connection holds each client id, admitting a
CONNECT (capacity, a persistent session to resume), and telling the coordinator
(announce when admitted, attach when the CONNACK is out, detach when the client left)."""

from __future__ import annotations

import collections
import itertools
import os

import trio

from ..broker.reports import Attach, Detach, Opened
from ..config import HeartbeatConfig
from ..coordination import Coordinator
from ..coordination.authority import epoch_of
from ..mqtt import sharing
from ..mqtt.effects import Accept, AddSubscription
from ..mqtt.endings import Offline
from ..presence.event import PresenceEvent
from .access import ClientRules
from .authenticator import Authenticator
from .connection import Connection
from .events import ConnectionEvents

__all__ = ["OnlineSessions"]


class OnlineSessions:
    """Client id -> the connection holding its session here, and the steps that change it.

    A takeover (the id connects again) is the caller's to carry out before :meth:`admit`:
    ending the old connection is the connection lifecycle's job.
    """

    def __init__(
        self,
        config: HeartbeatConfig,
        coordinator: Coordinator,
        counters: collections.Counter[str],
        authenticator: Authenticator,
        events: ConnectionEvents,
    ) -> None:
        self.config = config
        self.coordinator = coordinator
        self.counters = counters
        self.authenticator = authenticator
        self.events = events
        self.online: dict[str, Connection] = {}
        self._epochs = itertools.count(1)
        self._pid = os.getpid()

    def holding(self, client_id: str, epoch: str) -> Connection | None:
        """The connection holding session ``epoch`` of ``client_id`` here, if any."""
        conn = self.online.get(client_id)
        if conn is not None and conn.online is not None and conn.online.epoch == epoch:
            return conn
        return None

    def sessions(self) -> list[PresenceEvent]:
        """The online event of every session held here."""
        return [c.online for c in self.online.values() if c.online is not None]

    @staticmethod
    def waits(conn: Connection, request: Accept) -> bool:
        """Whether admitting ``request`` needs vetting (a password check, a refusal of an
        anonymous client, or a stored session)."""
        door = conn.door
        return door.auth is not None or not door.allow_anonymous or not request.clean_session

    def admission(self, conn: Connection, request: Accept, code: int) -> bytes | None:
        """After the password check (``code``, 0 if accepted): the refusal CONNACK, or None to admit.

        A Will is a PUBLISH that waits: a topic the client could not publish to (the
        server's own, presence and ``$`` topics, or one the ACL does not let it write)
        refuses the CONNECT with 5 (not authorized), as Mosquitto does.
        """
        cfg = self.config
        door = conn.door
        if not code and conn.session.assigned and not door.allow_zero_length_clientid:
            code = 2  # identifier rejected (0x85 in 5.0), as Mosquitto's allow_zero_length_clientid false
        if (
            not code
            and (len(self.online) >= cfg.max_connections or door.full())
            and request.client_id not in self.online
        ):
            code = 3  # server unavailable: the polite refusal beyond the cap
            self.counters["refused_capacity"] += 1
        if (
            not code
            and cfg.keepalive_over_max == "refuse"
            and request.keep_alive > cfg.max_keepalive
            and conn.session.protocol_level < 5
        ):
            code = 2  # identifier rejected: what Mosquitto 2.0.12+ answers (3.1.1 has no better code)
            self.counters["refused_keepalive"] += 1
        will = request.will
        if not code and will is not None and not self.may_will(conn, request.client_id, will.topic, request):
            code = 5
            self.counters["refused_wills"] += 1
        if not code:
            return None
        return self.refuse(conn, code)

    def may_will(self, conn: Connection, client_id: str, topic: str, request: Accept | None = None) -> bool:
        """Whether the client may leave a Will on ``topic``: as if it published there now
        (the ACL in force now: at CONNECT, and again when the Will goes out)."""
        if conn.session.reserved(topic):
            return False
        acl = conn.door.acl
        if acl is None:
            return True
        rules = conn.session.permissions
        if rules is not None:
            return rules.may_publish(topic)
        username = self.authenticator.username(conn, request) if request is not None else None
        return acl.can_publish(username, client_id, topic)

    def refuse(self, conn: Connection, code: int) -> bytes:
        """Refuse the CONNECT with ``code``: counted, and its end is recorded as a refusal."""
        self.counters[f"refused_{code}"] += 1
        conn.door.refused += 1
        conn.ended_by = Offline.REFUSED
        conn.refusal = code
        return conn.session.refused(code)

    async def open(self, conn: Connection, request: Accept, code: int) -> tuple[bytes | None, Opened | None]:
        """Vetting once the credentials have their verdict (``code``): the refusal
        CONNACK, or (CleanSession=0) the stored session to resume, from the coordinator
        (None for a clean one, or for MQTT 5's Clean Start 0 with Session Expiry 0 when
        none is stored: a session that ends with its connection needs no store)."""
        refusal = self.admission(conn, request, code)
        if refusal is not None or request.clean_session:
            return refusal, None
        if request.fresh:
            # MQTT 5's Clean Start with a lasting session: the stored one goes first, and
            # the coordinator applies this node's reports in order, so the open finds none.
            self.coordinator.discard_session(request.client_id)
        username = self.authenticator.username(conn, request)
        expiry = self.expiry(request)
        opened = await self.coordinator.open_session(
            request.client_id, username, v5=conn.v5 is not None, expiry=expiry, create=expiry > 0
        )
        if opened is None:
            return self.refuse(conn, 3), None  # rather than a new session that loses the stored one
        return None, opened if opened.kept else None

    def expiry(self, request: Accept) -> int:
        """Seconds the session of ``request`` outlives its connection: a 5.0 client's
        own (capped already), else ``--session-expiry``."""
        return int(self.config.session_expiry) if request.expiry is None else request.expiry

    def admit(self, conn: Connection, request: Accept, opened: Opened | None, arrived: float) -> bytes:
        """Make ``conn`` the device's session; returns the CONNACK to send.

        ``opened`` is the persistent session :meth:`open` found (None: a clean session,
        and any stored one is discarded); ``arrived``: when its CONNECT came (wall clock).
        """
        cfg = self.config
        authenticator = self.authenticator
        self.online[request.client_id] = conn
        door = conn.door
        door.online += 1
        if door.acl is not None:
            # Read from the door on every check, so a reload (SIGHUP) applies at once.
            conn.session.permissions = ClientRules(door, authenticator.username(conn, request), request.client_id)
        stream = conn.stream
        keep_alive = request.keep_alive  # a 5.0 client's is within the maximum already (Server Keep Alive)
        if keep_alive > cfg.max_keepalive and cfg.keepalive_over_max != "honour":
            keep_alive = cfg.max_keepalive
        if keep_alive:
            # MQTT counts the keep-alive from the CONNECT, which a coalescing engine may
            # have read up to a window after it came. Only so far back, though: after a
            # stall, a client that times its PINGREQ from the CONNACK still has 1.25 K.
            stream.receive_timeout_since(sharing.silence_allowed(keep_alive), trio.current_time() - keep_alive / 4)
        else:
            stream.receive_timeout = cfg.max_idle
        # Stamped with its CONNECT's arrival, not its admission: a device connects again
        # only after sending the earlier CONNECT, so the later session carries the later
        # time (the registry orders crossing claims by it) even when the earlier one's
        # password check or stored session took longer to come.
        conn.online = self.events.event(
            conn,
            "online",
            None,
            epoch=epoch_of(cfg.worker, self._pid, next(self._epochs), cfg.node),
            username=(authenticator.username(conn, request) or "") if door.identified_by_certificate else "",
            at=arrived,
        )
        if opened is None:
            self.coordinator.discard_session(request.client_id)
            return conn.session.accepted()
        conn.persistent = True
        return conn.session.accepted(opened.present, opened.inbound)

    @staticmethod
    def restored(opened: Opened | None) -> list[AddSubscription]:
        """The subscriptions a resumed session brings back (with their MQTT 5 options), to
        apply like new ones."""
        if opened is None:
            return []
        options = opened.options
        return [
            AddSubscription(topic_filter, qos, suback=False, options=options.get(topic_filter, 0))
            for topic_filter, qos in opened.subscriptions.items()
        ]

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
        was away may follow it (not if the session ended meanwhile); from now on the
        session outlives this connection by the expiry it brought."""
        online = conn.online
        if conn.persistent and online is not None and not conn.finished:
            v5 = conn.v5
            expiry = v5.session_expiry if v5 is not None else int(self.config.session_expiry)
            self.coordinator.session(Attach(online.client_id or "", online.epoch, expiry))

    def release(self, conn: Connection) -> bool:
        """``conn`` ended: its session is no longer held here. Returns whether it was
        (a refused or taken-over connection's was not)."""
        client_id = conn.session.client_id
        if client_id is None or self.online.get(client_id) is not conn:
            return False
        del self.online[client_id]
        conn.door.online -= 1
        return True

    def detach(self, conn: Connection, reason: Offline) -> None:
        """The client of a released persistent session left: the coordinator keeps the
        session, and queues what comes for it, until it returns or expires."""
        online = conn.online
        client_id = conn.session.client_id
        if online is not None and conn.persistent and client_id is not None:
            v5 = conn.v5
            # A 5.0 client's DISCONNECT says the session's expiry from now (0: it ends
            # now), whether it changed it or not; any other end leaves it as it was.
            expiry = v5.session_expiry if v5 is not None and reason is Offline.DISCONNECT else None
            self.coordinator.session(Detach(client_id, online.epoch, expiry))
