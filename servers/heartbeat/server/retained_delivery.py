"""Retained messages for a new subscription: paged from the coordinator's store to the
subscriber, each by the path its QoS and the subscriber's session take.

A connection's subscriptions are served one after another by one task, and at most
:data:`READS_AT_ONCE` pages are read at once on a worker: a client that subscribes to
a thousand filters in one packet must not start a thousand tasks that trio would run
in one batch (in a fleet each is a Redis call: 60-110 ms in which no healthy device's
PINGREQ was answered, before).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import trio

from ..broker.outbox import Message
from ..broker.routing import Broker
from ..coordination import Coordinator
from ..mqtt.effects import AddSubscription
from ..mqtt.v5.outbound import subscription_identifier
from .connection import Connection

__all__ = ["READS_AT_ONCE", "RetainedDelivery"]


def _identifier(options: int) -> bytes:
    """The subscription's MQTT 5 Subscription Identifier, as a property (or nothing)."""
    return subscription_identifier(options >> 2) if options >> 2 else b""


READS_AT_ONCE = 8
"""Pages of retained messages a worker reads from its coordinator at once."""


class RetainedDelivery:
    """Sends a new subscription the retained messages it matches, a page at a time."""

    def __init__(
        self,
        coordinator: Coordinator,
        broker: Broker[Connection],
        nursery: trio.Nursery,
        pending: Callable[[Connection], bool] = lambda conn: False,
    ) -> None:
        self.coordinator = coordinator
        self.broker = broker
        self.nursery = nursery
        self.pending = pending
        """Whether a connection has subscriptions not started yet (their SUBACK waits)."""
        self._waiting: dict[Connection, collections.deque[AddSubscription]] = {}
        """The subscriptions each connection's task has yet to serve."""
        self._reads = trio.CapacityLimiter(READS_AT_ONCE)
        self.own: Callable[[str], Iterable[tuple[str, bytes]]] | None = None
        """The broker's own retained values a filter matches (``$SYS/broker``, kept by
        :mod:`.sys_tree` and never in the coordinator's store); None: none."""

    def expect(self, conn: Connection, effect: AddSubscription) -> None:
        """``conn`` just subscribed (its filter is routed to from now on): what it is
        sent live until its retained messages are all out is noted, so that none is
        sent to it again as retained. The retained ones are read later, in a task, and
        a message published meanwhile is in the store too."""
        if effect.retained:
            self.broker.sent_live.setdefault(conn, set())

    def start(self, conn: Connection, effect: AddSubscription) -> None:
        """Send ``effect``'s retained messages, after those of ``conn``'s earlier
        subscriptions (call it once the SUBACK is written); none if the subscription
        asked for none (MQTT 5's Retain Handling)."""
        if not effect.retained:
            return
        waiting = self._waiting.get(conn)
        if waiting is not None:
            waiting.append(effect)
            return
        self._waiting[conn] = collections.deque([effect])
        self.nursery.start_soon(self._serve, conn)

    async def _serve(self, conn: Connection) -> None:
        waiting = self._waiting[conn]
        try:
            while waiting and not conn.finished:
                await self.send(conn, waiting.popleft())
        finally:
            del self._waiting[conn]
            if not self.pending(conn):
                self.broker.sent_live.pop(conn, None)

    async def send(self, conn: Connection, effect: AddSubscription) -> None:
        """The retained messages the new subscription matches, page by page, with the
        retain flag, at min(their QoS, granted); a page waits while the client's queue
        is long, so a million of them never sit in memory at once."""
        own = self.own
        if own is not None and effect.topic_filter.startswith("$"):
            for topic, payload in own(effect.topic_filter):
                self._give(conn, topic, payload, 0, b"", effect.options)  # QoS 0, as they go live
        cursor: str | None = None
        while True:
            async with self._reads:
                messages, cursor = await self.coordinator.retained(effect.topic_filter, cursor)
            if conn.finished:
                return
            for m in messages:
                self._give(conn, m.topic, m.payload, min(m.qos, effect.qos), m.properties, effect.options)
            if cursor is None:
                return
            # Polled: an event on every write of every connection would cost more.
            while conn.congested() and not conn.finished:  # noqa: ASYNC110
                await trio.sleep(0.05)

    def _give(self, conn: Connection, topic: str, payload: bytes, qos: int, properties: bytes, options: int) -> None:
        """One retained message for one subscriber, by the path its QoS and session take;
        an MQTT 5 one gets its properties (the Message Expiry left) and the
        subscription's identifier."""
        broker = self.broker
        if not conn.may_read(topic):
            broker.denied += 1
            return
        seen = broker.sent_live.get(conn)
        if seen is not None and (topic, payload) in seen:
            broker.retained_resent_skipped += 1  # it went out live after the subscription
            return
        # A persistent session's QoS 1 and 2 ones go to its store (the broker's persist).
        message = Message(topic, payload, qos, True, properties + _identifier(options))
        broker.give_message(conn, message, shape=False)
        broker.delivered += 1
