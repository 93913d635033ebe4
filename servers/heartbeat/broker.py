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
    """A connection that receives messages: where they are queued, and the counter
    of its QoS 1 packet ids."""

    msg_id: int

    def push(self, data: bytes, limit: int) -> bool:
        """Queue ``data`` to be written; False if a message was dropped to make room
        (more than ``limit`` queued)."""


S = TypeVar("S", bound=Subscriber)


class Broker(Generic[S]):
    """This process's subscribers: who gets a message, encoded once, queued per subscriber.

    Writing the queues out is the server's job (a writer task per subscriber, or
    the dense engine's write queue); the broker only decides and queues, so it
    stays free of I/O. A subscriber that falls ``outbox_limit`` messages behind
    loses messages (counted).
    """

    def __init__(self, max_qos: int, outbox_limit: int = 50_000) -> None:
        self.subscriptions: Subscriptions[S] = Subscriptions(max_qos=max_qos)
        self.outbox_limit = outbox_limit
        self.delivered = 0
        self.dropped = 0

    def deliver(self, topic: str, payload: bytes, qos: int) -> int:
        """Queue a message for every local subscriber of ``topic``; returns how many."""
        targets = self.subscriptions.route(topic)
        if not targets:
            return 0
        plain = b""
        for sub, granted in targets.items():
            if min(qos, granted) == 0:
                if not plain:
                    plain = encode_publish(topic, payload)
                self.enqueue(sub, plain)
            else:
                sub.msg_id = sub.msg_id % 65535 + 1
                self.enqueue(sub, encode_publish(topic, payload, qos=1, packet_id=sub.msg_id))
        self.delivered += len(targets)
        return len(targets)

    def enqueue(self, sub: S, data: bytes) -> None:
        """Queue bytes for one subscriber."""
        if not sub.push(data, self.outbox_limit):
            self.dropped += 1
