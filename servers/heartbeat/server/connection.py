"""One client connection as the server sees it, whichever engine serves it, and what
the socket under it tells of the client (its address, whether it has hung up)."""

from __future__ import annotations

import logging
import math
import select

import trio

import idlekeeper
from idlekeeper import Reason

from ...logs import shown
from ..broker.outbox import Outbox
from ..mqtt.endings import Offline
from ..mqtt.session import Session, State
from ..mqtt.v5.session import Session5
from ..presence.event import PresenceEvent
from .doors import Door

__all__ = ["GOODBYE_TIMEOUT", "SUBSCRIBED", "Connection", "peer_closed", "peer_of"]

logger = logging.getLogger("servers.heartbeat")

GOODBYE_TIMEOUT = 1.0
"""Seconds a refused or misbehaving client gets to read its CONNACK before the close."""

# Connection._flags
_FINISHED = 1
_PERSISTENT = 2
SUBSCRIBED = 4
"""A subclass's: the client has subscribed."""
_REFUSAL_SHIFT = 8
_FLAG_BITS = (1 << _REFUSAL_SHIFT) - 1


class Connection:
    """One client connection, as the server sees it, whichever engine serves it.

    ``stream`` is the connection's watch: a watched stream (streams engine) or a
    dense engine's transport; both carry the deadlines the server sets per phase.
    ``door`` is the listener it came through; its session follows the door's rules.
    Subclasses say how bytes reach a subscriber (:meth:`push`).
    """

    # The booleans share one slot (``_flags``): a device's connection is kept to as few
    # of the allocator's 16-byte steps as it can be, since there may be a million.
    __slots__ = ("_flags", "door", "ended_by", "held", "online", "peer", "session", "stream")

    def __init__(self, stream: idlekeeper.Watch, door: Door) -> None:
        self.stream = stream
        self.door = door
        """The listener the client came through (its TLS, rules, credentials and ACL)."""
        self.peer = peer_of(stream)
        self.online: PresenceEvent | None = None
        """The session's online event once CONNECT is accepted (its epoch names the session)."""
        self.session = Session(door.policy)
        self.ended_by: Offline | None = None
        self._flags = 0
        self.held: Outbox | None = None
        """QoS 1 and 2 messages sent and not yet acknowledged, and those queued behind them
        (a clean session's; a persistent session's live in the coordinator's store)."""

    @property
    def refusal(self) -> int:
        """The CONNACK code its CONNECT was refused with (0: not refused by admission)."""
        # In the flags' slot, above the flags: a slot more is the allocator's next size
        # class for every device.
        return self._flags >> _REFUSAL_SHIFT

    @refusal.setter
    def refusal(self, code: int) -> None:
        self._flags = (self._flags & _FLAG_BITS) | (code << _REFUSAL_SHIFT)

    @property
    def finished(self) -> bool:
        """Its end has been dealt with (reported, its session released)."""
        return bool(self._flags & _FINISHED)

    @finished.setter
    def finished(self, value: bool) -> None:
        self._flags = self._flags | _FINISHED if value else self._flags & ~_FINISHED

    @property
    def persistent(self) -> bool:
        """CleanSession=0: the session outlives the connection, in the coordinator."""
        return bool(self._flags & _PERSISTENT)

    @persistent.setter
    def persistent(self, value: bool) -> None:
        self._flags = self._flags | _PERSISTENT if value else self._flags & ~_PERSISTENT

    def silent_for(self, now: float | None = None) -> float:
        """Seconds since the client last sent anything (since accept, if nothing yet)."""
        return self.stream.silent_for(now)

    def speak_v5(self) -> Session5:
        """The client's CONNECT said MQTT 5.0: its session becomes a :class:`Session5`
        (before the CONNECT is handed to it). Returns it."""
        session = self.session
        if not isinstance(session, Session5):
            session = self.session = Session5(session._policy)
        return session

    @property
    def v5(self) -> Session5 | None:
        """The session, if the client speaks MQTT 5.0 (what it may be sent depends on it)."""
        session = self.session
        return session if type(session) is Session5 else None

    def end(self, reason: Offline) -> None:
        """Close this connection from outside its own task (takeover, shutdown). An MQTT 5
        client is told why first (a DISCONNECT with the reason code), if that can be
        written without waiting."""
        if self.ended_by is None:
            self.ended_by = reason
        farewell = self.session.goodbye(reason)
        if farewell is not None:
            self.say(farewell)
        self.stream.cancel()

    def last_words(self, reason: idlekeeper.Reason) -> bytes | None:
        """A deadline expired: an MQTT 5 client is told why (DISCONNECT 0x8D for its
        keep-alive; nothing for a reader that stopped reading, which would not read it).
        The keeper writes it just before the close (either engine; not over TLS)."""
        if reason is idlekeeper.Reason.SEND:
            return None
        return self.session.goodbye(Offline.KEEPALIVE_TIMEOUT)

    def say(self, data: bytes) -> None:
        """Write ``data`` now if it can go whole without waiting and without cutting into
        a packet being sent (the connection is closed right after); else drop it."""

    def end_reason(self, outcome: Offline | None) -> Offline:
        """Why the connection ended: who ended it, else which deadline, else ``outcome``
        (what its engine saw)."""
        if self.ended_by is not None:
            return self.ended_by
        stream = self.stream
        if stream.expired:
            if self.session.state is not State.CONNECTED:
                return Offline.CONNECT_TIMEOUT
            return Offline.SEND_TIMEOUT if stream.reason is Reason.SEND else Offline.KEEPALIVE_TIMEOUT
        return outcome or Offline.CONNECTION_LOST

    def packet_deadline(self, partial: bool) -> None:
        """After a read: a packet that has begun (``partial``) must be complete within the
        keep-alive window; once none is, that deadline goes."""
        stream = self.stream
        if partial and stream.deadline == math.inf:
            window = stream.receive_timeout
            if window is not None:
                stream.deadline = trio.current_time() + window
        elif not partial and stream.deadline != math.inf:
            stream.deadline = None

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
        """It fell too far behind what it is sent (see :mod:`..broker.budget`): end it with
        ``send-overflow``, like any other end (one offline event, its Will)."""
        if self.ended_by is not None or self.finished:
            return
        client_id = shown(self.session.client_id)
        logger.warning("subscriber %s (%s) cut off: send-overflow, %s", self.peer, client_id, detail)
        self.end(Offline.SEND_OVERFLOW)

    def may_read(self, topic: str) -> bool:
        """Whether the ACL lets a message on ``topic`` reach this client."""
        rules = self.session.permissions
        return rules is None or rules.may_read(topic)

    def stop_writing(self) -> None:
        """The connection ended: stop whatever sends its queue."""


def peer_of(stream: idlekeeper.Watch, *, port: bool = True) -> str:
    """``host:port`` of the client, for logs and presence events; ``host`` alone without
    ``port`` (the key its failed password checks are throttled by); ``?`` if unknown."""
    try:
        if isinstance(stream, idlekeeper.Transport):
            # Knows the address of a peer that reset before it was read (from accept).
            host, number = stream.get_extra_info("peername")[:2]  # type: ignore[index]
        else:
            host, number = stream.socket.getpeername()[:2]  # type: ignore[union-attr]
    except (OSError, AttributeError, ValueError, TypeError):
        return "?"
    return f"{host}:{number}" if port else str(host)


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
