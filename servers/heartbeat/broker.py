"""Topic matching, subscriptions and routing: which subscribers get a message published on a topic.

Pure (no I/O). :func:`topic_matches` is the reference statement of MQTT's filter
rules (4.7). Exact filters (no wildcards) sit in a dict, so a device subscribed to its
own command topic costs O(1) per publish however many devices there are; wildcard
filters sit in a tree of levels (:mod:`.topics`), so a publish costs a step per level
of its topic and per filter it matches, however many wildcard filters one client holds.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Generic, Protocol, TypeVar

from .budget import SUBSCRIBER_BYTES, TOTAL_BYTES, Offer, SendBudget
from .encoders import encode_publish
from .outbox import DEFAULT_MAX_QUEUED, DEFAULT_WINDOW, Message, Outbox
from .policy import utf8_length
from .topics import FilterChanges, TopicTree, is_wildcard

__all__ = ["MAX_QUEUED", "Broker", "Subscriber", "Subscriptions", "topic_matches"]

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


class Subscriptions(Generic[K]):
    """Topic filters per subscriber key, with the granted QoS of each, at most ``max_qos``."""

    def __init__(self, max_qos: int) -> None:
        self._max_qos = max_qos
        self._exact: dict[str, dict[K, int]] = {}
        self._wild: dict[str, dict[K, int]] = {}
        self._tree: TopicTree[dict[K, int]] = TopicTree()
        """The dicts of ``_wild`` by their filters' levels, for :meth:`route`."""
        self._by_key: dict[K, set[str]] = {}
        self._bytes: dict[K, int] = {}
        """The bytes of each key's filters, for the per-client bound: a SUBSCRIBE must not
        cost a step per filter its client already holds."""
        self._changes: FilterChanges | None = None

    def __len__(self) -> int:
        return sum(len(filters) for filters in self._by_key.values())

    def subscribe(self, key: K, topic_filter: str, qos: int) -> int:
        """Add or replace a subscription; returns the granted QoS (capped)."""
        granted = min(qos, self._max_qos)
        wild = is_wildcard(topic_filter)
        table = self._wild if wild else self._exact
        subs = table.get(topic_filter)
        if subs is None:
            subs = table[topic_filter] = {}
            if wild:
                self._tree.set(topic_filter, subs)
            if self._changes is not None:
                self._changes.came(topic_filter)
        subs[key] = granted
        held = self._by_key.setdefault(key, set())
        if topic_filter not in held:
            held.add(topic_filter)
            self._bytes[key] = self._bytes.get(key, 0) + utf8_length(topic_filter)
        return granted

    def unsubscribe(self, key: K, topic_filter: str) -> bool:
        """Remove one subscription; returns whether it existed."""
        wild = is_wildcard(topic_filter)
        table = self._wild if wild else self._exact
        subs = table.get(topic_filter)
        if not subs or key not in subs:
            return False
        del subs[key]
        if not subs:
            del table[topic_filter]
            if wild:
                self._tree.pop(topic_filter)
            if self._changes is not None:
                self._changes.went(topic_filter)
        filters = self._by_key.get(key)
        if filters is not None:
            filters.discard(topic_filter)
            if filters:
                self._bytes[key] -= utf8_length(topic_filter)
            else:
                del self._by_key[key]
                del self._bytes[key]
        return True

    def drop(self, key: K) -> None:
        """Remove every subscription of ``key`` (its connection ended)."""
        for topic_filter in list(self._by_key.get(key, ())):
            self.unsubscribe(key, topic_filter)

    def filters(self) -> set[str]:
        """Every filter that has at least one subscriber."""
        return set(self._exact) | set(self._wild)

    def track(self) -> FilterChanges:
        """Record, from now on, each filter that gains its first subscriber or loses its
        last; the record starts with every filter held now as come. It has one reader (a
        second call returns the same record), who takes from it: untaken, it holds an
        entry per filter held."""
        if self._changes is None:
            self._changes = FilterChanges()
            for topic_filter in (*self._exact, *self._wild):
                self._changes.came(topic_filter)
        return self._changes

    def has(self, key: K) -> bool:
        """Whether ``key`` has any subscription."""
        return key in self._by_key

    def held(self, key: K) -> Collection[str]:
        """The filters ``key`` holds (a view: read it, do not keep it)."""
        return self._by_key.get(key, ())

    def held_bytes(self, key: K) -> int:
        """The bytes of filter text ``key`` holds (kept as it changes, not summed per call)."""
        return self._bytes.get(key, 0)

    def route(self, topic: str) -> dict[K, int]:
        """Subscribers of ``topic`` with the QoS to deliver at (the highest match wins)."""
        out: dict[K, int] = dict(self._exact.get(topic, {}))
        for subs in self._tree.match(topic):
            for key, qos in subs.items():
                if qos > out.get(key, -1):
                    out[key] = qos
        return out


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


S = TypeVar("S", bound=Subscriber)


MAX_QUEUED = "max-queued"
"""Why a QoS 1 or 2 message was dropped: its subscriber's outbox queue was full."""


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
        self.checks_reads = False
        """Ask each subscriber whether it may read a message's topic (an ACL is in force)."""

    @property
    def dropped(self) -> int:
        """Messages dropped, whatever the reason."""
        return self.held_dropped + sum(self.budget.dropped.values())

    @property
    def dropped_by(self) -> dict[str, int]:
        """Messages dropped, by reason: the subscriber's bytes, the worker's bytes, a full outbox."""
        dropped = self.budget.dropped
        return {
            SUBSCRIBER_BYTES: dropped[SUBSCRIBER_BYTES],
            TOTAL_BYTES: dropped[TOTAL_BYTES],
            MAX_QUEUED: self.held_dropped,
        }

    def deliver(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> int:
        """Queue a message for every local subscriber of ``topic``; returns how many.

        Persistent sessions' QoS 1 and 2 copies are left to the session store.
        """
        targets = self.subscriptions.route(topic)
        if not targets:
            return 0
        plain = b""
        count = 0
        checks = self.checks_reads
        for sub, granted in targets.items():
            if checks and not sub.may_read(topic):
                self.denied += 1
                continue
            level = min(qos, granted)
            if level == 0:
                if not plain:
                    plain = encode_publish(topic, payload, retain=retain)
                self.enqueue(sub, plain)
            elif sub.persistent:
                continue
            else:
                self.hold(sub, Message(topic, payload, level, retain))
            count += 1
        self.delivered += count
        return count

    def hold(self, sub: S, message: Message) -> None:
        """Give a QoS 1 or 2 message to the subscriber's outbox and queue what it releases."""
        box = sub.held
        if box is None:
            box = sub.held = Outbox(self.window, self.max_queued)
        lost = box.dropped
        self.write(sub, box.push(message))
        if box.dropped != lost:
            self.held_dropped += 1

    def write(self, sub: S, packets: list[bytes]) -> None:
        """Queue packets that must not be dropped: what an outbox released (it bounds
        those), or replies to the client's own packets. One that would take the
        subscriber past its hard cap cuts it off instead."""
        budget = self.budget
        for data in packets:
            if budget.offer(sub, sub.queued(), len(data), held=True) is not Offer.QUEUE:
                break
            sub.push(data, held=True)
            budget.settle(sub, sub.queued())
        if budget.cutting:
            self._cut()

    def enqueue(self, sub: S, data: bytes) -> None:
        """Queue a QoS 0 message for one subscriber, if its budget and the worker's allow."""
        budget = self.budget
        if budget.offer(sub, sub.queued(), len(data)) is Offer.QUEUE:
            sub.push(data)
            budget.settle(sub, sub.queued())
        elif budget.cutting:
            self._cut()

    def forget(self, sub: S) -> None:
        """The subscriber's connection ended: what was queued for it no longer counts."""
        self.budget.forget(sub)

    def _cut(self) -> None:
        for sub, detail in self.budget.take_cut():
            sub.overflow(detail)
