"""Persistent sessions (CleanSession=0), sans-IO: what a client id keeps between connections.

MQTT 3.1.1 (3.1.2.4) makes a session with CleanSession=0 belong to the client id,
not to the connection: its subscriptions, the QoS 1 and 2 messages that arrive
while the client is away, the messages sent and not yet acknowledged, and the QoS 2
packet ids received and not yet released. A :class:`SessionStore` keeps them for
whichever coordinator owns the sessions (the worker itself, the supervisor's
authority for several workers), so a reconnect on another worker, or after the
worker that held the session was killed, finds it whole.

The store routes the QoS 1 and 2 messages of persistent sessions itself (each
session's :class:`~.outbox.Outbox` numbers them and keeps them until acknowledged);
QoS 0 messages to a connected client take the ordinary path of its worker's
broker, and are not queued while it is away (as Mosquitto's default).

Bounds: each session's outbox (in flight, queued messages and bytes; a bridge's by
bytes alone), a total of queued bytes over every session, and an expiry for sessions
whose client does not return. What is dropped is counted.

Expiry is the session's own (MQTT 5.0 §3.1.2.11.2): a 3.1.1 session is kept the
store's ``expiry`` after its client left; a 5.0 session the Session Expiry Interval
its client's last connection set (in CONNECT, or changed by DISCONNECT), which the
worker has capped. The one a connection brings takes effect when its CONNACK is out
(:class:`Attach`), not at the CONNECT: a CONNECT that dies before then leaves the
session as it was. A session whose expiry is 0 ends with its connection
(:class:`Detach`). A client that comes back after its session expired finds none:
CONNACK says session-present 0, and the messages the session held are counted as
dropped with it.

MQTT 5.0 (§4.1: subscription options are session state). A session opened by a 5.0
client keeps its subscriptions' options and writes its messages as 5.0, with the
publisher's properties, the Subscription Identifiers of the filters that matched,
Retain As Published, No Local (``origin``: the publisher's client id) and a Message
Expiry counted down while the message waits; :class:`Delivery` says which version
its packets are written for. A client that comes back speaking the other version
gets its session's messages in that one.
"""

from __future__ import annotations

import collections
import heapq
import time
from collections.abc import Callable, Collection, Hashable, Iterable

from ..mqtt.publication import Publication
from .outbox import DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_WINDOW, Message, Outbox
from .reports import Acked, AckedTogether, Attach, Delivery, Detach, Discard, Opened, Push, Report, Subscribed
from .stored import SessionJournal, StoredSession
from .subscriptions import Subscriptions

__all__ = [
    "DEFAULT_EXPIRY",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_TOTAL_QUEUED_BYTES",
    "TAKEOVER_GRACE",
    "SessionJournal",
    "SessionStore",
    "StoredSession",
]

DEFAULT_MAX_SESSIONS = 1_000_000
"""Persistent sessions kept at once unless told otherwise (each about a kilobyte, queue aside)."""
DEFAULT_EXPIRY = 24 * 3600.0
"""Seconds a persistent session outlives its client's last connection."""
DEFAULT_TOTAL_QUEUED_BYTES = 256 * 1024 * 1024
"""Bytes queued for absent clients, over every session, beyond which messages are dropped."""
TAKEOVER_GRACE = 60
"""Seconds a session resumed from a connection that still holds it (a takeover) is kept
at least, whatever its expiry, should that connection end before the new one's
CONNACK: the old expiry (0, say) must not end a session the new connection resumed."""
_NO_COUNT = 1 << 62  # a bridge's queue: bounded by its bytes instead


class SessionStore:
    """Every persistent session of a server (or of its fleet member), by client id."""

    def __init__(
        self,
        *,
        max_qos: int = 2,
        window: int = DEFAULT_WINDOW,
        window_bytes: int = 0,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        total_queued_bytes: int = DEFAULT_TOTAL_QUEUED_BYTES,
        expiry: float = DEFAULT_EXPIRY,
        may_read: Callable[[str | None, str, str], bool] | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        bridges: Collection[str] = (),
    ) -> None:
        self.bridges = frozenset(bridges)
        """The client ids of the server's own bridges (their local sessions): queued by bytes alone."""
        self.max_sessions = max_sessions
        """Sessions kept at once: past it, a new one is refused (a stored one still resumes)."""
        self.refused = 0
        """New sessions refused at ``max_sessions``."""
        self.may_read = may_read
        """Access rules: whether (username, client id) may read a topic; None lets everything through."""
        self.window = window
        self.window_bytes = window_bytes
        """Payload bytes in flight per session past which no more go (0: no bound)."""
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.total_queued_bytes = total_queued_bytes
        self.expiry = expiry
        self.subscriptions: Subscriptions[str] = Subscriptions(max_qos)
        self._sessions: dict[str, StoredSession] = {}
        self._expiries: list[tuple[float, str]] = []
        self.queued_bytes = 0
        self.dropped = 0
        """Messages dropped for a full session queue or the total bound."""
        self.expired = 0
        """Sessions that ended by their expiry (0 included: at their connection's end)."""
        self.expired_messages = 0
        """Messages (in flight or queued) that went with an expired session."""
        self.newly_dropping: collections.deque[str] = collections.deque(maxlen=1000)
        """Client ids whose first drop has not been logged yet (the server logs once per session)."""
        self.journal: SessionJournal | None = None
        """Told of every change, where the sessions are kept durably."""
        self.keeps_absent = True
        """Whether messages are queued for absent clients: False while a durable store
        cannot write (a full disk), so nothing is taken that would be lost."""
        self.unkept = 0
        """Messages for absent clients not queued: the durable store could not write."""

    def _touched(self, client_id: str) -> None:
        journal = self.journal
        if journal is not None:
            journal.session(client_id)

    def adopt(self, stored: StoredSession, options: dict[str, int]) -> None:
        """Take back a session a durable store kept (its client away; ``left_at`` on
        this store's clock), messages included; ``options``: its subscriptions' MQTT 5
        options, packed, for those that have any."""
        self._sessions[stored.client_id] = stored
        for topic_filter, qos in stored.subscriptions.items():
            stored.subscriptions[topic_filter] = self.subscriptions.subscribe(
                stored.client_id, topic_filter, qos, options.get(topic_filter, 0)
            )
        self.queued_bytes += stored.outbox.queued_bytes
        heapq.heappush(self._expiries, (stored.left_at + stored.expiry, stored.client_id))
        if self.journal is not None:
            stored.outbox.journal = self.journal.opened(stored)

    def __len__(self) -> int:
        return len(self._sessions)

    def away(self) -> tuple[int, int]:
        """Sessions whose client is away, and messages held for every session (in flight
        and queued): ``$SYS/broker``'s figures. A scan of every session: call it seldom."""
        away = held = 0
        for stored in self._sessions.values():
            away += stored.holder is None
            held += len(stored.outbox)
        return away, held

    def get(self, client_id: str) -> StoredSession | None:
        """The client's stored session, if it has one."""
        return self._sessions.get(client_id)

    def apply(self, report: Report, now: float) -> Delivery | None:
        """Apply one report; returns packets for the client's connection, if any."""
        if isinstance(report, Attach):
            return self.attach(report.client_id, report.epoch, report.expiry)
        if isinstance(report, Detach):
            self.detach(report.client_id, report.epoch, now, report.expiry)
        elif isinstance(report, Subscribed):
            if report.qos is None:
                self.unsubscribe(report.client_id, report.topic_filter)
            else:
                self.subscribe(report.client_id, report.topic_filter, report.qos, report.options)
        elif isinstance(report, Acked):
            return self.acknowledge(report.client_id, report.epoch, report.kind, report.packet_id)
        elif isinstance(report, AckedTogether):
            return self.acknowledge_all(report.client_id, report.epoch, report.unpack())
        elif isinstance(report, Push):
            stored = self._sessions.get(report.client_id)
            properties = report.properties if stored is not None and stored.v5 else None
            message = Message(report.topic, report.payload, report.qos, report.retain, properties)
            return self.push(report.client_id, message)
        elif isinstance(report, Discard):
            self.discard(report.client_id)
        elif report.held:
            self.hold_inbound(report.client_id, report.packet_id)
        else:
            self.release_inbound(report.client_id, report.packet_id)
        return None

    # -- a client's connections ---------------------------------------------------------

    def open(
        self,
        client_id: str,
        clean: bool,
        now: float = 0.0,
        username: str | None = None,
        v5: bool = False,
        *,
        expiry: float | None = None,
        create: bool = True,
    ) -> Opened | None:
        """A CONNECT was accepted: CleanSession=1 discards any stored session (and keeps
        none); CleanSession=0 resumes the stored one or starts one, unless ``max_sessions``
        are kept already (None: refused, counted). ``v5``: the client speaks MQTT 5.0.

        ``expiry``: a new session's (None: the store's). Without ``create`` a stored
        session is resumed but none is made (MQTT 5's Clean Start 0 with Session Expiry 0:
        the session, if any, ends with the connection); the answer says ``kept`` False."""
        if clean:
            self.discard(client_id)
            return Opened(False, {}, frozenset())
        stored = self._sessions.get(client_id)
        if stored is not None and stored.holder is None and stored.left_at + stored.expiry <= now:
            self._expire(stored)  # expired, though not yet swept
            stored = None
        if stored is not None:
            if stored.holder is not None:
                # A takeover: the connection it takes over ends after this open, and its
                # Detach must not end the session before this one's Attach sets the expiry.
                stored.expiry = max(stored.expiry, TAKEOVER_GRACE)
                stored.reopened = True
            stored.username = username
            stored.speak(v5)
            self._touched(client_id)
            options = dict(self.subscriptions.options(client_id) or {})
            return Opened(True, dict(stored.subscriptions), frozenset(stored.inbound), options)
        if not create:
            return Opened(False, {}, frozenset(), kept=False)
        if len(self._sessions) >= self.max_sessions:
            self.refused += 1
            return None
        outbox = self.outbox(client_id)
        stored = StoredSession(client_id, outbox, username, v5, self.expiry if expiry is None else expiry)
        self._sessions[client_id] = stored
        if self.journal is not None:
            outbox.journal = self.journal.opened(stored)
            self.journal.session(client_id)
        # Counted as left now: a connection that dies before its CONNACK never attaches.
        stored.left_at = now
        heapq.heappush(self._expiries, (now + stored.expiry, client_id))
        return Opened(False, {}, frozenset())

    def outbox(self, client_id: str, clock: Callable[[], float] = time.monotonic) -> Outbox:
        """A new outbox for ``client_id``'s session on ``clock``, bounded as the store says,
        but a bridge's: it holds what a remote broker is owed, however many messages that
        is, within the bytes' bound (the remote away, or slower than the publishers)."""
        count = _NO_COUNT if client_id in self.bridges else self.max_queued
        return Outbox(
            self.window, count, self.max_queued_bytes, window_bytes=self.window_bytes, attached=False, clock=clock
        )

    def attach(self, client_id: str, holder: Hashable, expiry: float | None = None) -> Delivery | None:
        """Its CONNACK is out: from now on ``holder`` gets its messages, starting with the
        resends and what queued while it was away; the session outlives this connection
        by ``expiry`` seconds (None: as before)."""
        stored = self._sessions.get(client_id)
        if stored is None:
            return None
        stored.holder = holder
        stored.reopened = False
        if expiry is not None:
            stored.expiry = expiry
        self._touched(client_id)
        before = stored.outbox.queued_bytes
        packets = stored.outbox.attach()
        self.queued_bytes -= before - stored.outbox.queued_bytes
        return Delivery(client_id, holder, packets, stored.v5)

    def detach(self, client_id: str, holder: Hashable, now: float, expiry: float | None = None) -> None:
        """The connection of ``holder`` ended: the session waits its expiry for the
        client (``expiry``, if the DISCONNECT set one), or ends now if that is 0.

        A report from a connection that no longer holds the session changes nothing.
        """
        stored = self._sessions.get(client_id)
        if stored is None or stored.holder != holder:
            return
        if expiry is not None and not stored.reopened:
            stored.expiry = expiry
        stored.holder = None
        if stored.expiry <= 0:
            self._expire(stored)
            return
        stored.outbox.detach()
        stored.left_at = now
        self._touched(client_id)
        heapq.heappush(self._expiries, (now + stored.expiry, client_id))

    def detach_held(self, held: Callable[[Hashable], bool], now: float) -> int:
        """Detach every session whose holder ``held`` names (its worker died without
        reporting); returns how many."""
        lost = [stored for stored in self._sessions.values() if stored.holder is not None and held(stored.holder)]
        for stored in lost:
            assert stored.holder is not None
            self.detach(stored.client_id, stored.holder, now)
        return len(lost)

    def discard(self, client_id: str) -> bool:
        """Forget the client's session (CleanSession=1, or it expired)."""
        stored = self._sessions.pop(client_id, None)
        if stored is None:
            return False
        self.subscriptions.drop(client_id)
        self.queued_bytes -= stored.outbox.queued_bytes
        if self.journal is not None:
            self.journal.discarded(stored)
        return True

    def expire(self, now: float) -> list[str]:
        """Discard every session whose client has been away longer than its expiry."""
        out: list[str] = []
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, client_id = heapq.heappop(heap)
            stored = self._sessions.get(client_id)
            # A client that came back (or left again later) has a newer entry, or none due.
            if stored is not None and stored.holder is None and stored.left_at + stored.expiry <= now:
                self._expire(stored)
                out.append(client_id)
        return out

    def _expire(self, stored: StoredSession) -> None:
        # What it held for its client goes with it, counted (the client finds session-present 0).
        self.expired_messages += len(stored.outbox)
        self.discard(stored.client_id)
        self.expired += 1

    # -- what a connected client does ---------------------------------------------------

    def subscribe(self, client_id: str, topic_filter: str, qos: int, options: int = 0) -> None:
        """The client subscribed (its SUBACK granted ``qos``; ``options``: MQTT 5's, packed)."""
        stored = self._sessions.get(client_id)
        if stored is not None:
            granted = self.subscriptions.subscribe(client_id, topic_filter, qos, options)
            stored.subscriptions[topic_filter] = granted
            self._touched(client_id)

    def unsubscribe(self, client_id: str, topic_filter: str) -> None:
        """The client unsubscribed."""
        stored = self._sessions.get(client_id)
        if stored is not None and stored.subscriptions.pop(topic_filter, None) is not None:
            self.subscriptions.unsubscribe(client_id, topic_filter)
            self._touched(client_id)

    def acknowledge(self, client_id: str, holder: Hashable, kind: str, packet_id: int) -> Delivery | None:
        """PUBACK, PUBREC or PUBCOMP (``kind``) from the client's connection ``holder``."""
        return self.acknowledge_all(client_id, holder, ((kind, packet_id),))

    def acknowledge_all(self, client_id: str, holder: Hashable, acks: Iterable[tuple[str, int]]) -> Delivery | None:
        """Acknowledgements (kind and packet id) the client's connection ``holder`` read
        together, in order: the window is refilled once (:meth:`.Outbox.acknowledge`)."""
        stored = self._sessions.get(client_id)
        if stored is None or stored.holder != holder:
            return None  # from a connection that lost the session: its successor resends
        outbox = stored.outbox
        before = outbox.queued_bytes
        packets = outbox.acknowledge(acks)
        self.queued_bytes -= before - outbox.queued_bytes
        return Delivery(client_id, holder, packets, stored.v5) if packets else None

    def hold_inbound(self, client_id: str, packet_id: int) -> None:
        """A QoS 2 PUBLISH was taken (PUBREC sent): its duplicates are dropped until PUBREL."""
        stored = self._sessions.get(client_id)
        if stored is not None:
            stored.inbound.add(packet_id)
            self._touched(client_id)

    def release_inbound(self, client_id: str, packet_id: int) -> None:
        """PUBREL came for a QoS 2 packet id."""
        stored = self._sessions.get(client_id)
        if stored is not None and packet_id in stored.inbound:
            stored.inbound.discard(packet_id)
            self._touched(client_id)

    # -- messages -------------------------------------------------------------------------

    def route(self, published: Publication, origin: str = "") -> list[Delivery]:
        """A message published: every persistent session subscribed to its topic at QoS
        1 or 2 takes it at min(its QoS, granted); returns what to send to connected ones.
        A 5.0 session gets the publisher's properties shaped by its subscriptions'
        options: the published retain flag for Retain As Published, and none of its own
        messages (``origin``: the publisher's client id) where every filter that
        matches says No Local."""
        topic, payload, qos, properties, retain = (
            published.topic, published.payload, published.qos, published.properties, published.retain
        )  # fmt: skip
        if qos == 0:
            return []
        out: list[Delivery] = []
        may_read = self.may_read
        subscriptions = self.subscriptions
        for client_id, granted in subscriptions.route(topic).items():
            level = min(qos, granted)
            if level == 0:
                continue
            stored = self._sessions[client_id]
            if may_read is not None and not may_read(stored.username, client_id, topic):
                continue
            options = subscriptions.options(client_id)  # 5.0's, or a 3.1.x bridge's
            flag, extra = False, b""
            if options:
                shaped = subscriptions.shaped(client_id, options, topic, client_id == origin, retain)
                if shaped is None:
                    continue  # No Local: its own message
                flag, extra = shaped
            message = (
                Message(topic, payload, level, flag, properties + extra)
                if stored.v5
                else Message(topic, payload, level, flag)
            )
            if stored.holder is None:
                if not self.keeps_absent:
                    self.unkept += 1
                    continue
                if self.queued_bytes + message.size > self.total_queued_bytes:
                    self._dropped(stored)
                    continue
            delivery = self.push(client_id, message)
            if delivery is not None:
                out.append(delivery)
        return out

    def push(self, client_id: str, message: Message) -> Delivery | None:
        """One QoS 1 or 2 message for one client's session."""
        stored = self._sessions.get(client_id)
        if stored is None:
            return None
        outbox = stored.outbox
        before, lost = outbox.queued_bytes, outbox.dropped
        packets = outbox.push(message)
        self.queued_bytes += outbox.queued_bytes - before
        if outbox.dropped != lost:
            self._dropped(stored)
        if packets and stored.holder is not None:
            return Delivery(client_id, stored.holder, packets, stored.v5)
        return None

    def _dropped(self, stored: StoredSession) -> None:
        self.dropped += 1
        if not stored.drop_logged:
            stored.drop_logged = True
            self.newly_dropping.append(stored.client_id)
