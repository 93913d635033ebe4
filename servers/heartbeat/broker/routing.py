"""Routing, pure: a message published here, to each subscriber of this process that wants
it, encoded once per version and options, and queued within each subscriber's budget.

:class:`Broker` holds the subscriptions (:mod:`.subscriptions`), each subscriber's QoS 1
and 2 exchanges (:mod:`.outbox`) and the byte bounds (:mod:`.budget`); the server's
fan-out calls it for every message, the connection's transport writes what it queues.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable
from typing import Generic, Protocol, TypeVar

from ..mqtt.encoders import encode_publish
from ..mqtt.publication import Publication
from ..mqtt.v5.aliases import OutboundAliases
from ..mqtt.v5.outbound import publish as publish_v5
from .budget import CONGESTED_BYTES, SUBSCRIBER_BYTES, TOTAL_BYTES, Offer, SendBudget
from .outbox import DEFAULT_MAX_QUEUED, DEFAULT_WINDOW, Message, Outbox
from .subscriptions import Subscriptions

__all__ = [
    "EXPIRED",
    "MAX_QUEUED",
    "SENT_LIVE_LIMIT",
    "TOO_LARGE",
    "Broker",
    "Limits5",
    "Subscriber",
]

SENT_LIVE_LIMIT = 4096
"""Messages sent live that a subscriber's retained ones are checked against (past it,
a retained copy of a message already sent may go too: the same message twice, never
one lost)."""


class Limits5(Protocol):
    """What an MQTT 5 client told the server it takes (its CONNECT's properties)."""

    max_packet_size: int
    """The largest packet it takes; 0: no limit."""
    receive_maximum: int
    """QoS 1 and 2 messages it takes unacknowledged."""
    sent_aliases: OutboundAliases | None
    """The topic aliases the server sets towards it, if it allows any."""


class Subscriber(Hashable, Protocol):
    """A connection that receives messages: where they are queued, and (for QoS 1
    and 2) the outbox that keeps them until the client acknowledges them."""

    persistent: bool
    """Its session is persistent: the session store, not the broker, delivers its QoS 1 and 2."""
    held: Outbox | None
    """Its QoS 1 and 2 messages in flight and queued (made on the first one)."""

    def push(self, data: bytes, *, held: bool = False) -> None:
        """Queue ``data`` to be written (the broker's budget already let it in).
        ``held``: it may come before any subscription (a resumed session's resends)."""

    def queued(self) -> int:
        """Bytes queued for the socket and not yet taken by the kernel."""

    def overflow(self, detail: str) -> None:
        """It fell too far behind what it is sent: end its connection (send-overflow)."""

    def may_read(self, topic: str) -> bool:
        """Whether access rules let a message on ``topic`` reach this subscriber."""

    @property
    def v5(self) -> Limits5 | None:
        """Its limits if it speaks MQTT 5.0 (its messages are then written as 5.0), else None."""


S = TypeVar("S", bound=Subscriber)


MAX_QUEUED = "max-queued"
"""Why a QoS 1 or 2 message was dropped: its subscriber's outbox queue was full."""
EXPIRED = "expired"
"""Why a queued MQTT 5 message was not sent: its Message Expiry Interval ran out first."""
TOO_LARGE = "too-large"
"""Why a message was not sent to an MQTT 5 subscriber: larger than its Maximum Packet Size
(§3.1.2.11.4: the server drops it for that subscriber, as if sent)."""


class Broker(Generic[S]):
    """This process's subscribers: who gets a message, encoded once, queued per subscriber.

    Writing the queues out is the server's job (a writer task per subscriber, or
    the dense engine's write queue); the broker only decides and queues, so it
    stays free of I/O. What is queued for subscribers' sockets is bounded in bytes
    by ``budget`` (per subscriber and per worker, :mod:`.budget`): QoS 0 messages
    beyond are dropped, and a subscriber too far behind is cut off. QoS 1 and 2 go
    through the subscriber's outbox, whose window and queue bounds (``window``,
    ``window_bytes``, ``max_queued``) hold them until acknowledged; what an outbox releases, and the
    replies to a client's own packets, are never dropped. Every loss is counted, by
    reason (:attr:`dropped_by`).
    """

    def __init__(
        self,
        max_qos: int,
        budget: SendBudget[S],
        window: int = DEFAULT_WINDOW,
        max_queued: int = DEFAULT_MAX_QUEUED,
        *,
        window_bytes: int = 0,
    ) -> None:
        self.subscriptions: Subscriptions[S] = Subscriptions(max_qos=max_qos)
        self.budget = budget
        self.window = window
        self.window_bytes = window_bytes
        """Payload bytes in flight per subscriber past which no more go (0: no bound)."""
        self.max_queued = max_queued
        self.delivered = 0
        self.denied = 0
        self.held_dropped = 0
        """QoS 1 and 2 messages dropped: the subscriber's outbox queue was full."""
        self.too_large = 0
        """Messages not sent to an MQTT 5 subscriber: past its Maximum Packet Size."""
        self.expired = 0
        """MQTT 5 messages dropped from an outbox's queue: their Message Expiry ran out."""
        self.checks_reads = False
        """Ask each subscriber whether it may read a message's topic (an ACL is in force)."""
        self.persist: Callable[[S, Message], None] | None = None
        """Where a persistent session's QoS 1 or 2 message from a shared subscription goes
        (its session store; a plain subscription's copies go there by routing instead)."""
        self.unserved: Callable[[Message], None] | None = None
        """Called with a QoS 1 or 2 message the coordinator sent here for a shared
        subscription (``groups``) that has no member here any more: its last one left
        while the message was on its way, so it is passed on."""
        self.delivered_bytes = 0
        self.joined = 0
        """Packets written to a subscriber joined to others, beyond the first of each
        write (the subscriber counts writes: ``$SYS/broker/messages/sent``)."""
        """Payload bytes of the messages counted in :attr:`delivered` (``$SYS/broker/publish/bytes/sent``)."""
        self.retained_resent_skipped = 0
        """Retained messages not sent to a new subscription: it had them live already."""
        self.sent_live: dict[S, set[tuple[str, bytes]]] = {}
        """Subscribers whose new subscriptions' retained messages are still to come, and
        the (topic, payload) each has been sent live since it subscribed (at most
        :data:`SENT_LIVE_LIMIT`): a retained copy of one of those would be the same
        message twice (:mod:`..server.retained_delivery` skips it)."""

    @property
    def dropped(self) -> int:
        """Messages dropped, whatever the reason."""
        return self.held_dropped + self.too_large + self.expired + sum(self.budget.dropped.values())

    @property
    def dropped_by(self) -> dict[str, int]:
        """Messages dropped, by reason: the subscriber's bytes, the worker's bytes, a full outbox."""
        dropped = self.budget.dropped
        return {
            SUBSCRIBER_BYTES: dropped[SUBSCRIBER_BYTES],
            TOTAL_BYTES: dropped[TOTAL_BYTES],
            MAX_QUEUED: self.held_dropped,
            TOO_LARGE: self.too_large,
            EXPIRED: self.expired,
        }

    def deliver(
        self,
        message: Publication,
        *,
        origin: S | None = None,
        groups: Collection[str] | None = None,
        plain: bool = True,
    ) -> int:
        """Queue ``message`` for every local subscriber of its topic; returns how many.

        Encoded once per version its subscribers speak: an MQTT 5 subscriber also gets
        the publisher's properties, unless the message is larger than it takes. Its
        subscription options shape its copy: No Local skips ``origin`` (the publishing
        connection, if local), Retain As Published keeps the flag it was published
        with (sent without it otherwise), a Subscription Identifier is added.
        Persistent sessions' QoS 1 and 2 copies are left to the session store. Each
        shared subscription in ``groups`` (None: every one held here that the topic
        reaches) gets it once, at one of its members (:meth:`member`); without
        ``plain``, they alone do.
        """
        topic, payload, qos, properties = message.topic, message.payload, message.qos, message.properties
        published_retain, retain = message.retain, False  # live copies go without the flag
        subscriptions = self.subscriptions
        targets = subscriptions.route(topic) if plain else {}
        if not targets and not subscriptions.has_groups and not groups:
            return 0
        wire = wire5 = b""
        count = 0
        checks = self.checks_reads
        sent_live = self.sent_live
        for sub, granted in targets.items():
            if checks and not sub.may_read(topic):
                self.denied += 1
                continue
            if sent_live:
                seen = sent_live.get(sub)
                if seen is not None and len(seen) < SENT_LIVE_LIMIT:
                    seen.add((topic, payload))
            level = min(qos, granted)
            v5 = sub.v5
            if v5 is not None:
                flag, extra = retain, b""
                options = subscriptions.options(sub)
                if options:
                    shaped = subscriptions.shaped(sub, options, topic, sub is origin, published_retain)
                    if shaped is None:
                        continue  # No Local: its own message
                    flag, extra = shaped[0] or retain, shaped[1]
                if extra or flag != retain:
                    data = publish_v5(topic, payload, retain=flag, properties=properties + extra)
                else:
                    data = wire5 = wire5 or publish_v5(topic, payload, retain=retain, properties=properties)
                limit = v5.max_packet_size
                if limit and len(data) + (2 if level else 0) > limit:
                    self.too_large += 1
                    continue
                if level == 0:
                    self.enqueue(sub, data)
                elif not sub.persistent:
                    self.hold(sub, Message(topic, payload, level, flag, properties + extra))
                else:
                    continue
            else:
                flag = retain
                options = subscriptions.options(sub)
                if options:  # a 3.1.x bridge's subscription (Mosquitto's try_private)
                    shaped = subscriptions.shaped(sub, options, topic, sub is origin, published_retain)
                    if shaped is None:
                        continue  # No Local: its own message
                    flag = shaped[0]
                if level == 0:
                    if flag:
                        self.enqueue(sub, encode_publish(topic, payload, retain=True))
                    else:
                        wire = wire or encode_publish(topic, payload, retain=retain)
                        self.enqueue(sub, wire)
                elif sub.persistent:
                    continue
                else:
                    self.hold(sub, Message(topic, payload, level, flag))
            count += 1
        self.delivered_bytes += count * len(payload)  # the shared ones' are give_message's
        for shared in subscriptions.groups(topic) if groups is None else groups:
            picked = self.member(shared)
            if picked is not None and (not checks or picked[0].may_read(topic)):
                copy = Message(topic, payload, min(qos, picked[1]), retain, properties, group=shared)
                count += self.give_message(picked[0], copy, published_retain)
            elif picked is None and groups is not None and qos and self.unserved is not None:
                self.unserved(Message(topic, payload, qos, published_retain, properties, group=shared))
        self.delivered += count
        return count

    def member(self, shared: str, skip: S | None = None) -> tuple[S, int] | None:
        """The member of a shared subscription that gets its next message, and its QoS:
        the next in turn that keeps up with what it is sent (one whose queue is long is
        passed over, as the spec lets a server do), or the next in turn if none does."""
        members = [(sub, qos) for sub, qos in self.subscriptions.members(shared).items() if sub is not skip]
        if not members:
            return None
        start = self.subscriptions.turn(shared)
        for i in range(len(members)):
            sub, qos = members[(start + i) % len(members)]
            if sub.queued() <= CONGESTED_BYTES:
                return sub, qos
        return members[start % len(members)]

    def give_message(self, sub: S, message: Message, published_retain: bool = False, *, shape: bool = True) -> int:
        """One message for one subscriber, in the version it speaks and (``shape``) as
        its subscription's options make it, through its outbox or its session store at
        QoS 1 and 2; returns 1 if it was given, 0 if it is larger than the subscriber
        takes. Without ``shape`` its properties are as given (a retained message for a
        new subscription carries that subscription's identifier alone)."""
        v5 = sub.v5
        data = b""
        if v5 is None:
            message.properties = None
        else:
            if message.properties is None:  # passed on from a 3.1.1 member: 5.0's form, no properties
                message.properties = b""
            options = self.subscriptions.options(sub) if shape else None
            if options:
                shaped = self.subscriptions.shaped(sub, options, message.topic, False, published_retain, message.group)
                if shaped is not None:
                    message.retain = shaped[0] or message.retain
                    message.properties += shaped[1]
            if message.qos:  # its size with a packet id; the outbox writes it when its turn comes
                size = len(publish_v5(message.topic, message.payload, 1, False, 1, False, message.properties))
            else:
                data = message.wire()
                size = len(data)
            if v5.max_packet_size and size > v5.max_packet_size:
                self.too_large += 1
                return 0
        if not message.qos:
            self.enqueue(sub, data or message.wire())
        elif sub.persistent and self.persist is not None:
            self.persist(sub, message)
        else:
            self.hold(sub, message)
        self.delivered_bytes += len(message.payload)
        return 1

    def hold(self, sub: S, message: Message) -> None:
        """Give a QoS 1 or 2 message to the subscriber's outbox and queue what it releases."""
        box = sub.held
        if box is None:
            v5 = sub.v5
            window = self.window if v5 is None else min(self.window, v5.receive_maximum)
            box = sub.held = Outbox(window, self.max_queued, window_bytes=self.window_bytes)
        lost = box.dropped
        self.write(sub, box.push(message))
        if box.dropped != lost:
            self.held_dropped += 1

    def write(self, sub: S, packets: list[bytes]) -> None:
        """Queue packets that must not be dropped: what an outbox released (it bounds
        those), or replies to the client's own packets. One that would take the
        subscriber past its hard cap cuts it off instead."""
        budget = self.budget
        v5 = sub.v5
        if v5 is None or v5.sent_aliases is None:
            # In one piece: a refilled window goes to the kernel in one send. Held
            # packets are only refused at the hard cap, which cuts the subscriber off,
            # so taking them whole or one by one queues the same.
            if packets:
                data = packets[0] if len(packets) == 1 else b"".join(packets)
                if budget.offer(sub, sub.queued(), len(data), held=True) is Offer.QUEUE:
                    self.joined += len(packets) - 1
                    sub.push(data, held=True)
                    budget.settle(sub, sub.queued())
        else:
            aliases, limit = v5.sent_aliases, v5.max_packet_size
            for data in packets:
                if budget.offer(sub, sub.queued(), len(data), held=True) is not Offer.QUEUE:
                    break
                # Rewritten only once sure to be queued: the client learns an alias from
                # the packet that sets it, so one set on a packet dropped here would be unknown.
                sub.push(aliases.apply(data, limit), held=True)
                budget.settle(sub, sub.queued())
        if budget.cutting:
            self._cut()

    def enqueue(self, sub: S, data: bytes) -> None:
        """Queue a QoS 0 message for one subscriber, if its budget and the worker's allow."""
        budget = self.budget
        if budget.offer(sub, sub.queued(), len(data)) is Offer.QUEUE:
            v5 = sub.v5
            if v5 is not None and v5.sent_aliases is not None:
                data = v5.sent_aliases.apply(data, v5.max_packet_size)
            sub.push(data)
            budget.settle(sub, sub.queued())
        elif budget.cutting:
            self._cut()

    def forget(self, sub: S) -> None:
        """The subscriber's connection ended: what was queued for it no longer counts."""
        self.budget.forget(sub)
        self.sent_live.pop(sub, None)

    def _cut(self) -> None:
        for sub, detail in self.budget.take_cut():
            sub.overflow(detail)
