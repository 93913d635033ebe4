"""Topic matching, subscriptions and routing: which subscribers get a message published on a topic.

Pure (no I/O). :func:`topic_matches` is the one implementation of MQTT's filter rules (4.7).
Exact filters (no wildcards) sit in a dict, so a device subscribed to its own command
topic costs O(1) per publish however many devices there are; wildcard filters
(``presence/#``) are few and are matched one by one.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Generic, Protocol, TypeVar

from .encoders import encode_publish
from .outbox import DEFAULT_MAX_QUEUED, DEFAULT_WINDOW, Message, Outbox

__all__ = ["Broker", "Subscriber", "Subscriptions", "matches_any", "topic_matches"]

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


def matches_any(filters: Collection[str], topic: str) -> bool:
    """Whether any of ``filters`` matches ``topic`` (an exact filter is found at once)."""
    return topic in filters or any(topic_matches(f, topic) for f in filters)


def _is_wildcard(topic_filter: str) -> bool:
    return "+" in topic_filter or "#" in topic_filter


class Subscriptions(Generic[K]):
    """Topic filters per subscriber key, with the granted QoS of each, at most ``max_qos``."""

    def __init__(self, max_qos: int) -> None:
        self._max_qos = max_qos
        self._exact: dict[str, dict[K, int]] = {}
        self._wild: dict[str, dict[K, int]] = {}
        self._by_key: dict[K, set[str]] = {}

    def __len__(self) -> int:
        return sum(len(filters) for filters in self._by_key.values())

    def subscribe(self, key: K, topic_filter: str, qos: int) -> int:
        """Add or replace a subscription; returns the granted QoS (capped)."""
        granted = min(qos, self._max_qos)
        table = self._wild if _is_wildcard(topic_filter) else self._exact
        table.setdefault(topic_filter, {})[key] = granted
        self._by_key.setdefault(key, set()).add(topic_filter)
        return granted

    def unsubscribe(self, key: K, topic_filter: str) -> bool:
        """Remove one subscription; returns whether it existed."""
        table = self._wild if _is_wildcard(topic_filter) else self._exact
        subs = table.get(topic_filter)
        if not subs or key not in subs:
            return False
        del subs[key]
        if not subs:
            del table[topic_filter]
        filters = self._by_key.get(key)
        if filters is not None:
            filters.discard(topic_filter)
            if not filters:
                del self._by_key[key]
        return True

    def drop(self, key: K) -> None:
        """Remove every subscription of ``key`` (its connection ended)."""
        for topic_filter in list(self._by_key.get(key, ())):
            self.unsubscribe(key, topic_filter)

    def filters(self) -> set[str]:
        """Every filter that has at least one subscriber."""
        return set(self._exact) | set(self._wild)

    def has(self, key: K) -> bool:
        """Whether ``key`` has any subscription."""
        return key in self._by_key

    def route(self, topic: str) -> dict[K, int]:
        """Subscribers of ``topic`` with the QoS to deliver at (the highest match wins)."""
        out: dict[K, int] = dict(self._exact.get(topic, {}))
        for topic_filter, subs in self._wild.items():
            if topic_matches(topic_filter, topic):
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

    def push(self, data: bytes, limit: int, *, held: bool = False) -> bool:
        """Queue ``data`` to be written; False if it was dropped (more than ``limit``
        queued). ``held`` bytes are never dropped: the outbox already bounds them."""

    def may_read(self, topic: str) -> bool:
        """Whether access rules let a message on ``topic`` reach this subscriber."""


S = TypeVar("S", bound=Subscriber)


class Broker(Generic[S]):
    """This process's subscribers: who gets a message, encoded once, queued per subscriber.

    Writing the queues out is the server's job (a writer task per subscriber, or
    the dense engine's write queue); the broker only decides and queues, so it
    stays free of I/O. QoS 0 messages beyond ``outbox_limit`` queued for one
    subscriber are dropped; QoS 1 and 2 go through the subscriber's outbox, whose
    window and queue bounds (``window``, ``max_queued``) hold them until acknowledged.
    Both kinds of loss are counted.
    """

    def __init__(
        self,
        max_qos: int,
        outbox_limit: int = 50_000,
        window: int = DEFAULT_WINDOW,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        self.subscriptions: Subscriptions[S] = Subscriptions(max_qos=max_qos)
        self.outbox_limit = outbox_limit
        self.window = window
        self.max_queued = max_queued
        self.delivered = 0
        self.dropped = 0
        self.denied = 0
        self.checks_reads = False
        """Ask each subscriber whether it may read a message's topic (an ACL is in force)."""

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
            self.dropped += 1

    def write(self, sub: S, packets: list[bytes]) -> None:
        """Queue packets an outbox released (never dropped: the outbox bounds them)."""
        for data in packets:
            sub.push(data, self.outbox_limit, held=True)

    def enqueue(self, sub: S, data: bytes) -> None:
        """Queue bytes for one subscriber."""
        if not sub.push(data, self.outbox_limit):
            self.dropped += 1
