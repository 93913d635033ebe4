"""Topic matching, subscriptions and routing: which subscribers get a message published on a topic.

Pure (no I/O). :func:`topic_matches` is the reference statement of MQTT's filter
rules (4.7). Exact filters (no wildcards) sit in a dict, so a device subscribed to its
own command topic costs O(1) per publish however many devices there are; wildcard
filters sit in a tree of levels (:mod:`.topics`), so a publish costs a step per level
of its topic and per filter it matches, however many wildcard filters one client holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable
from typing import Any, Generic, Protocol, TypeVar

from .budget import CONGESTED_BYTES, SUBSCRIBER_BYTES, TOTAL_BYTES, Offer, SendBudget
from .encoders import encode_publish
from .outbox import DEFAULT_MAX_QUEUED, DEFAULT_WINDOW, Message, Outbox
from .policy import utf8_length
from .publication import Publication
from .topics import SHARE_PREFIX, FilterChanges, SharedFilters, TopicTree, is_wildcard
from .v5.aliases import OutboundAliases
from .v5.outbound import publish as publish_v5
from .v5.outbound import subscription_identifier

__all__ = [
    "EXPIRED",
    "MAX_QUEUED",
    "NO_LOCAL",
    "RETAIN_AS_PUBLISHED",
    "SENT_LIVE_LIMIT",
    "TOO_LARGE",
    "Broker",
    "Limits5",
    "Subscriber",
    "Subscriptions",
    "pack_options",
    "topic_matches",
]

NO_LOCAL = 1
"""An MQTT 5 subscription option: not sent what its own client publishes."""
RETAIN_AS_PUBLISHED = 2
"""An MQTT 5 subscription option: the retain flag as the publisher set it."""
SENT_LIVE_LIMIT = 4096
"""Messages sent live that a subscriber's retained ones are checked against (past it,
a retained copy of a message already sent may go too: the same message twice, never
one lost)."""


def pack_options(no_local: bool = False, retain_as_published: bool = False, identifier: int = 0) -> int:
    """A subscription's MQTT 5 options as one int: two flags and its Subscription Identifier."""
    return (NO_LOCAL if no_local else 0) | (RETAIN_AS_PUBLISHED if retain_as_published else 0) | (identifier << 2)


K = TypeVar("K", bound=Hashable)


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches ``topic_filter``.

    ``+`` matches exactly one level, ``#`` its own level and every level below, so
    ``a/#`` matches ``a`` too. Topics starting with ``$`` are not matched by a filter
    starting with a wildcard (MQTT-4.7.2-1), so ``#`` does not see ``$SYS/...``.
    """
    if topic_filter == topic:
        return True
    if topic[:1] == "$" and topic_filter[:1] in ("+", "#"):
        return False
    levels = topic.split("/")
    parts = topic_filter.split("/")
    count = len(levels)
    for i, part in enumerate(parts):
        if part == "#":
            return True
        if i >= count or (part != "+" and part != levels[i]):
            return False
    return len(parts) == count


_ROUTE_MEMO = 4096
"""Subscribers (plus one a topic) that :meth:`Subscriptions.route` keeps found: a
topic per device (its presence, its telemetry) must not make it a table per device."""
_NOBODY: dict[Any, int] = {}
"""The route of every topic nobody wants (one table, never remembered)."""


class Subscriptions(Generic[K]):
    """Topic filters per subscriber key, with the granted QoS of each, at most ``max_qos``.

    A shared subscription (``$share/<group>/<filter>``, MQTT 5) joins its group: its
    members are kept apart from the other subscriptions (:meth:`route` never returns
    them), and each message for the group goes to one of them (:meth:`members`)."""

    def __init__(self, max_qos: int) -> None:
        self._max_qos = max_qos
        self._groups: dict[str, dict[K, int]] = {}
        """Each shared subscription's members (by its whole filter), in the order they joined."""
        self._shared = SharedFilters()
        self._turns: dict[str, int] = {}
        """Where each group's next message starts looking for a member (round robin)."""
        self._exact: dict[str, dict[K, int]] = {}
        self._wild: dict[str, dict[K, int]] = {}
        self._tree: TopicTree[dict[K, int]] = TopicTree()
        """The dicts of ``_wild`` by their filters' levels, for :meth:`route`."""
        self._by_key: dict[K, set[str]] = {}
        self._bytes: dict[K, int] = {}
        """The bytes of each key's filters, for the per-client bound: a SUBSCRIBE must not
        cost a step per filter its client already holds."""
        self._options: dict[K, dict[str, int]] = {}
        """MQTT 5 subscription options (:func:`pack_options`) of the filters that have any:
        most subscriptions have none, and the common delivery never looks here."""
        self._changes: FilterChanges | None = None
        # Each topic's subscribers as route() found them, until the subscriptions
        # change: publishers send to the same topics again and again, and the walk of
        # the filter tree was a tenth of a forwarded message's work. Bounded in
        # subscribers counted over all topics; emptied when full, and on any change.
        self._routes: dict[str, dict[K, int]] = {}
        self._routed = 0

    def __len__(self) -> int:
        return sum(len(filters) for filters in self._by_key.values())

    def subscribe(self, key: K, topic_filter: str, qos: int, options: int = 0) -> int:
        """Add or replace a subscription, with its MQTT 5 ``options`` (:func:`pack_options`;
        0: none); returns the granted QoS (capped)."""
        if options:
            self._options.setdefault(key, {})[topic_filter] = options
        else:
            self._drop_option(key, topic_filter)
        granted = min(qos, self._max_qos)
        if topic_filter.startswith(SHARE_PREFIX):
            subs = self._groups.get(topic_filter)
            if subs is None:
                subs = self._groups[topic_filter] = {}
                self._shared.add(topic_filter)
                if self._changes is not None:
                    self._changes.came(topic_filter)
        else:
            wild = is_wildcard(topic_filter)
            table = self._wild if wild else self._exact
            subs = table.get(topic_filter)
            if subs is None:
                subs = table[topic_filter] = {}
                if wild:
                    self._tree.set(topic_filter, subs)
                if self._changes is not None:
                    self._changes.came(topic_filter)
            self._forget_routes()
        subs[key] = granted
        held = self._by_key.setdefault(key, set())
        if topic_filter not in held:
            held.add(topic_filter)
            self._bytes[key] = self._bytes.get(key, 0) + utf8_length(topic_filter)
        return granted

    def unsubscribe(self, key: K, topic_filter: str) -> bool:
        """Remove one subscription; returns whether it existed."""
        if topic_filter.startswith(SHARE_PREFIX):
            return self._leave(key, topic_filter)
        wild = is_wildcard(topic_filter)
        table = self._wild if wild else self._exact
        subs = table.get(topic_filter)
        if not subs or key not in subs:
            return False
        del subs[key]
        self._forget_routes()
        if not subs:
            del table[topic_filter]
            if wild:
                self._tree.pop(topic_filter)
            if self._changes is not None:
                self._changes.went(topic_filter)
        self._forget_filter(key, topic_filter)
        return True

    def _leave(self, key: K, topic_filter: str) -> bool:
        members = self._groups.get(topic_filter)
        if not members or key not in members:
            return False
        del members[key]
        if not members:
            del self._groups[topic_filter]
            self._turns.pop(topic_filter, None)
            self._shared.discard(topic_filter)
            if self._changes is not None:
                self._changes.went(topic_filter)
        self._forget_filter(key, topic_filter)
        return True

    def _drop_option(self, key: K, topic_filter: str) -> None:
        held_options = self._options.get(key)
        if held_options is not None and held_options.pop(topic_filter, None) is not None and not held_options:
            del self._options[key]

    def _forget_filter(self, key: K, topic_filter: str) -> None:
        self._drop_option(key, topic_filter)
        filters = self._by_key.get(key)
        if filters is not None:
            filters.discard(topic_filter)
            if filters:
                self._bytes[key] -= utf8_length(topic_filter)
            else:
                del self._by_key[key]
                del self._bytes[key]

    def drop(self, key: K) -> None:
        """Remove every subscription of ``key`` (its connection ended)."""
        for topic_filter in list(self._by_key.get(key, ())):
            self.unsubscribe(key, topic_filter)

    def filters(self) -> set[str]:
        """Every filter that has at least one subscriber (shared subscriptions' whole)."""
        return set(self._exact) | set(self._wild) | set(self._groups)

    @property
    def has_groups(self) -> bool:
        """Whether any shared subscription is held here."""
        return bool(self._groups)

    def groups(self, topic: str) -> list[str]:
        """The shared subscriptions held here that ``topic`` reaches (their whole filters)."""
        return self._shared.matching(topic) if self._shared else []

    def members(self, shared: str) -> dict[K, int]:
        """A shared subscription's members here, with their granted QoS (a view)."""
        return self._groups.get(shared, {})

    def turn(self, shared: str) -> int:
        """Where the group's next message starts looking (and moves it on by one)."""
        turn = self._turns.get(shared, 0)
        self._turns[shared] = turn + 1
        return turn

    def track(self) -> FilterChanges:
        """Record, from now on, each filter that gains its first subscriber or loses its
        last; the record starts with every filter held now as come. It has one reader (a
        second call returns the same record), who takes from it: untaken, it holds an
        entry per filter held."""
        if self._changes is None:
            self._changes = FilterChanges()
            for topic_filter in (*self._exact, *self._wild, *self._groups):
                self._changes.came(topic_filter)
        return self._changes

    def has(self, key: K) -> bool:
        """Whether ``key`` has any subscription."""
        return key in self._by_key

    def held(self, key: K) -> Collection[str]:
        """The filters ``key`` holds (a view: read it, do not keep it)."""
        return self._by_key.get(key, ())

    def options(self, key: K) -> dict[str, int] | None:
        """The MQTT 5 options of ``key``'s filters that have any (a view), or None."""
        return self._options.get(key)

    def shaped(
        self, key: K, options: dict[str, int], topic: str, own: bool, published_retain: bool, shared: str = ""
    ) -> tuple[bool, bytes] | None:
        """What the MQTT 5 options of ``key``'s filters matching ``topic`` (``options``, as
        :meth:`options` gives them) make of a message: the retain flag (Retain As
        Published) and the Subscription Identifiers to add; None if No Local skips it
        (``own``: ``key`` published it, and every filter of ``key`` that matches says
        No Local). ``shared``: a shared subscription's copy, shaped by its options alone."""
        if shared:  # a shared subscription's copy: its own options only
            matched = [options[shared]] if shared in options else []
        else:
            matched = [
                value
                for topic_filter, value in options.items()
                if not topic_filter.startswith(SHARE_PREFIX) and topic_matches(topic_filter, topic)
            ]
        if not matched:
            return False, b""
        if own and all(value & NO_LOCAL for value in matched):
            others = (f for f in self.held(key) if f not in options)
            if not any(topic_matches(f, topic) for f in others):
                return None
        flag = published_retain and any(value & RETAIN_AS_PUBLISHED for value in matched)
        ids = sorted({value >> 2 for value in matched if value >> 2})
        return flag, b"".join(subscription_identifier(i) for i in ids)

    def held_bytes(self, key: K) -> int:
        """The bytes of filter text ``key`` holds (kept as it changes, not summed per call)."""
        return self._bytes.get(key, 0)

    def route(self, topic: str) -> dict[K, int]:
        """Subscribers of ``topic`` with the QoS to deliver at (the highest match wins).

        The dict is shared with later calls until the subscriptions change: read it,
        do not change it."""
        out = self._routes.get(topic)
        if out is not None:
            return out
        out = dict(self._exact.get(topic, {}))
        for subs in self._tree.match(topic):
            for key, qos in subs.items():
                if qos > out.get(key, -1):
                    out[key] = qos
        if not out:
            # Not remembered: a topic nobody wants is most often one of a device's own
            # (its presence, its telemetry), seen once or twice a session, and a memo of
            # them would hold a topic string per device for nothing.
            return _NOBODY
        self._routed += len(out) + 1
        if self._routed > _ROUTE_MEMO:
            self._forget_routes()
            self._routed = len(out) + 1
        self._routes[topic] = out
        return out

    def _forget_routes(self) -> None:
        if self._routes:
            self._routes.clear()
            self._routed = 0


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
    ``max_queued``) hold them until acknowledged; what an outbox releases, and the
    replies to a client's own packets, are never dropped. Every loss is counted, by
    reason (:attr:`dropped_by`).
    """

    def __init__(
        self,
        max_qos: int,
        budget: SendBudget[S],
        window: int = DEFAULT_WINDOW,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        self.subscriptions: Subscriptions[S] = Subscriptions(max_qos=max_qos)
        self.budget = budget
        self.window = window
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
        self.retained_resent_skipped = 0
        """Retained messages not sent to a new subscription: it had them live already."""
        self.sent_live: dict[S, set[tuple[str, bytes]]] = {}
        """Subscribers whose new subscriptions' retained messages are still to come, and
        the (topic, payload) each has been sent live since it subscribed (at most
        :data:`SENT_LIVE_LIMIT`): a retained copy of one of those would be the same
        message twice (:mod:`.retained_delivery` skips it)."""

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
            elif level == 0:
                if not wire:
                    wire = encode_publish(topic, payload, retain=retain)
                self.enqueue(sub, wire)
            elif sub.persistent:
                continue
            else:
                self.hold(sub, Message(topic, payload, level, retain))
            count += 1
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
        return 1

    def hold(self, sub: S, message: Message) -> None:
        """Give a QoS 1 or 2 message to the subscriber's outbox and queue what it releases."""
        box = sub.held
        if box is None:
            v5 = sub.v5
            window = self.window if v5 is None else min(self.window, v5.receive_maximum)
            box = sub.held = Outbox(window, self.max_queued)
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
