"""The figures behind ``$SYS/broker/...`` (Mosquitto's broker statistics), as plain
counts: one worker's, and a box's sum of its workers'.

A worker samples its own (:mod:`..server.sys_tree` does, every ``--sys-interval``); what
the persistent sessions and retained messages count is added by whoever keeps them
(:func:`with_store`): the worker's own coordinator when it is alone, the supervisor's
authority in a box, which sums every worker's latest sample (:class:`BoxTotals`) and
answers each with the totals, so that every worker of the box publishes the box's
figures, as one broker would. In a fleet each node publishes its own, as each Mosquitto
broker of a bridged set does. No I/O here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..broker.persistent import SessionStore
from .retention import Retention

__all__ = ["BoxTotals", "BrokerCounts", "with_store"]


@dataclass(slots=True)
class BrokerCounts:
    """One worker's (or a box's) counts; ``*_received``, ``*_sent`` and the like are
    totals since the start, the others are how many there are now."""

    connected: int = 0
    """Clients with a live, accepted connection."""
    away: int = 0
    """Persistent sessions whose client is away (they count in ``clients/total``)."""
    expired: int = 0
    """Persistent sessions ended by their expiry."""
    messages_received: int = 0
    """MQTT control packets received (of every kind)."""
    messages_sent: int = 0
    """MQTT control packets sent (of every kind)."""
    publish_received: int = 0
    publish_sent: int = 0
    publish_dropped: int = 0
    publish_bytes_received: int = 0
    """Payload bytes of the PUBLISHes received."""
    publish_bytes_sent: int = 0
    bytes_received: int = 0
    """MQTT bytes received (WebSocket and TLS framing not counted)."""
    bytes_sent: int = 0
    subscriptions: int = 0
    shared_subscriptions: int = 0
    retained: int = 0
    """Retained messages kept (presence not included)."""
    stored: int = 0
    """Messages kept: the retained ones and those queued for persistent sessions."""
    stored_bytes: int = 0
    heap_current: int = 0
    """The process's resident bytes now (the worker's; summed over a box)."""
    heap_maximum: int = 0
    """The most resident bytes the process has had."""
    sockets: int = 0
    """Connections accepted since the start."""
    connects: int = 0
    """CONNECT packets received since the start."""

    def values(self) -> tuple[int, ...]:
        """The counts in field order (for a frame)."""
        return dataclasses.astuple(self)

    @classmethod
    def from_values(cls, values: tuple[int, ...]) -> BrokerCounts:
        """The counts :meth:`values` gave (extra values from a newer sender are ignored,
        missing ones are 0: a worker and its supervisor may differ for a rolling restart)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: int(value) for name, value in zip(names, values, strict=False)})

    def plus(self, other: BrokerCounts) -> BrokerCounts:
        """The sum of two samples, field by field."""
        return BrokerCounts(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))


def with_store(own: BrokerCounts, store: SessionStore, retention: Retention) -> BrokerCounts:
    """``own`` with what the keeper of the persistent sessions and retained messages
    counts. Scans the sessions once (for those whose client is away): call it seldom."""
    retained = retention.store
    away, held = store.away()
    return dataclasses.replace(
        own,
        away=away,
        expired=own.expired + store.expired,
        retained=retained.count,
        stored=retained.count + held,
        stored_bytes=retained.bytes + store.queued_bytes,
    )


class BoxTotals:
    """The authority's sum of its workers' latest samples (one per link)."""

    def __init__(self) -> None:
        self._latest: dict[int, BrokerCounts] = {}

    def report(self, link: int, sample: BrokerCounts) -> BrokerCounts:
        """Worker ``link``'s new sample: the box's totals, with every other worker's latest."""
        self._latest[link] = sample
        total = BrokerCounts()
        for counts in self._latest.values():
            total = total.plus(counts)
        return total

    def forget(self, link: int) -> None:
        """The link is gone: its worker's figures leave the totals (a new worker starts at 0,
        so totals since the start may go down when a worker is replaced)."""
        self._latest.pop(link, None)
