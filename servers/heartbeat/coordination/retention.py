"""Retained messages as a coordinator serves them: the retained store, and every
device's last presence, retained.

Pure. A late subscriber to ``$SYS/presence/#`` is owed the last presence event of every
device (then the live stream): those come from the registry the coordinator keeps
anyway, not from copies in the retained store, so retained presence costs no memory
per device. Offline entries stop being retained ``offline_ttl`` seconds after the
device went offline (None: while the registry keeps them).

A SUBSCRIBE may match a million of them, so they are served in pages: each call
examines a bounded number of entries and returns a cursor (a string, so it can cross
the supervisor's bus) to continue from. Presence pages walk a snapshot of the client
ids taken at the first page, each looked up afresh, so a device that changed state
meanwhile is sent as it is now.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...logs import OncePer, shown
from ..broker.persistent import SessionStore
from ..broker.retained import RetainedStore
from ..mqtt.filters import topic_matches
from ..mqtt.publication import Publication
from ..mqtt.v5.outbound import expiring, forwarded, message_expiry
from ..mqtt.v5.properties import Properties
from ..presence.event import PresenceEvent
from .registry import Registry

__all__ = [
    "RETAINED_PAGE",
    "MqttState",
    "RetainedMessage",
    "Retention",
    "exact_presence",
    "live_presence",
    "matches_every_presence_topic",
    "presence_possible",
    "presence_properties",
]

logger = logging.getLogger("servers.heartbeat.coordination")

RETAINED_PAGE = 500
"""Entries examined per page."""

# Snapshots of client ids kept for paging; a subscriber that never asks for the next
# page must not pin one forever.
_MAX_SNAPSHOTS = 64


_NONE, _SOME, _ALL = 0, 1, 2


def _presence_reach(topic_filter: str, presence_prefix: str) -> int:
    """Which presence topics (``<presence_prefix><client-id>``) ``topic_filter`` may match:
    none, some, or all of them whatever the client ids (which may hold ``/``)."""
    if presence_prefix[:1] == "$" and topic_filter[:1] in ("+", "#"):
        return _NONE  # a filter starting with a wildcard matches no $ topic (MQTT-4.7.2-1)
    levels = presence_prefix.split("/")
    if levels[-1]:
        # A prefix that does not end a level (the server refuses one; a test may make
        # one): the client id extends its last level, so only "#" is sure.
        return _ALL if topic_filter == "#" else _SOME
    parts = topic_filter.split("/")
    fixed = len(levels) - 1  # the prefix's levels; the client id's start after them
    for i in range(fixed):
        if i >= len(parts):
            return _NONE  # the filter ends inside the prefix
        part = parts[i]
        if part == "#":
            return _ALL
        if part != "+" and part != levels[i]:
            return _NONE
    if len(parts) == fixed:
        return _NONE  # it matches the prefix's own levels, where no presence is published
    return _ALL if parts[fixed] == "#" else _SOME


def presence_possible(topic_filter: str, presence_prefix: str) -> bool:
    """Whether ``topic_filter`` may match a presence topic (``<presence_prefix><client-id>``)."""
    return _presence_reach(topic_filter, presence_prefix) != _NONE


def matches_every_presence_topic(topic_filter: str, presence_prefix: str) -> bool:
    """Whether ``topic_filter`` matches the presence topic of every client id: ``#``
    when the prefix is not a ``$`` topic, ``<prefix>#``, ``$SYS/#``, ``$SYS/+/#``..."""
    return _presence_reach(topic_filter, presence_prefix) == _ALL


def exact_presence(topic_filter: str, presence_prefix: str) -> str | None:
    """The client id ``topic_filter`` names if it is one presence topic, else None."""
    if not topic_filter.startswith(presence_prefix):
        return None
    rest = topic_filter[len(presence_prefix) :]
    return None if "+" in rest or "#" in rest else rest


def presence_properties(event: PresenceEvent, offline_ttl: float | None, now: float) -> bytes:
    """What a presence event tells an MQTT 5 subscriber beside its payload: UTF-8 JSON
    (Payload Format Indicator 1, Content Type ``application/json``) and, for an offline
    event the server stops retaining ``offline_ttl`` seconds after it, that as the
    Message Expiry Interval left (at least 1 s), so a copy queued for an absent
    subscriber runs out when the retained one does."""
    expiry = None
    if event.status == "offline" and offline_ttl is not None:
        expiry = max(1, math.ceil(event.time + offline_ttl - now))
    return forwarded(
        Properties(payload_format_indicator=1, message_expiry_interval=expiry, content_type="application/json")
    )


def live_presence(topic: str, event: PresenceEvent, properties: bytes, retained: bool = True) -> Publication:
    """``event`` as it goes to the subscribers of ``topic`` as it happens: QoS 0 (what a
    late subscriber is owed is the registry's state, not a queue of events), flagged
    retained when presence is (``retained``). A subscriber with Retain As Published, a
    bridge above all, then keeps it retained, so a remote broker's retained view
    follows the edge's; every other subscriber gets it without the flag, as any live
    message (:meth:`~..broker.routing.Broker.deliver`)."""
    return Publication(topic, event.payload(), 0, retained, properties)


@dataclass(frozen=True, slots=True)
class RetainedMessage:
    """A retained message to send to a new subscription (with the retain flag).

    ``properties``: for MQTT 5 subscribers, packed, with the Message Expiry Interval
    (if any) already lowered to the time left."""

    topic: str
    payload: bytes
    qos: int
    properties: bytes = b""


@dataclass
class MqttState:
    """The MQTT state a coordinator keeps for its workers, with its bounds: persistent
    sessions, retained messages, and whether (and how long) presence is retained."""

    store: SessionStore = dataclasses.field(default_factory=SessionStore)
    retained: RetainedStore = dataclasses.field(default_factory=RetainedStore)
    retain_presence: bool = True
    presence_offline_ttl: float | None = None

    def retention(self, registry: Registry, presence_prefix: str, clock: Callable[[], float]) -> Retention:
        """The retained messages over ``registry`` (whose records are the retained presence)."""
        return Retention(
            registry,
            presence_prefix=presence_prefix,
            store=self.retained,
            presence=self.retain_presence,
            offline_ttl=self.presence_offline_ttl,
            clock=clock,
        )


class Retention:
    """The retained messages of one coordinator and the retained presence of its registry.

    ``clock`` is the wall clock (presence events carry wall-clock times); the store's
    own expiry uses the same clock.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        presence_prefix: str,
        store: RetainedStore | None = None,
        presence: bool = True,
        offline_ttl: float | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.store = store if store is not None else RetainedStore()
        self.presence_prefix = presence_prefix
        self.presence = presence
        self.offline_ttl = offline_ttl
        self._clock = clock
        self._snapshots: dict[int, list[str]] = {}
        self._numbers = itertools.count(1)
        self._logged = OncePer()
        self.changed: Callable[[str], None] | None = None
        """Told every topic whose retained message may have changed (a durable store's journal)."""
        self.writable = True
        """False while a durable store cannot write (a full disk): updates are refused."""
        self.unkept = 0
        """Retained updates refused because the durable store could not write."""

    def retain(self, topic: str, payload: bytes, qos: int, owner: str = "", properties: bytes = b"") -> bool:
        """A PUBLISH with RETAIN=1 from ``owner``: stored, or cleared by an empty payload.
        False if the store's bounds or the owner's share refused it (counted there, and
        logged once per owner per spell). An MQTT 5 publisher's ``properties`` are kept
        with it; a Message Expiry Interval among them ends its retention (§3.3.2.3.3)."""
        if not self.writable:
            self.unkept += 1
            if self._logged.due("unwritable", time.monotonic()):
                logger.warning(
                    "retained message on %s from %s refused: the durable store cannot write (see /healthz);"
                    " the topic keeps its message; more are counted, not logged",
                    shown(topic),
                    shown(owner),
                )
            return False
        now = self._clock()
        expiry = message_expiry(properties) if properties else None
        expires_at = None if expiry is None else now + expiry
        stored = self.store.store(topic, payload, qos, now, expires_at, owner, properties)
        if self.changed is not None:
            self.changed(topic)
        if not stored and self._logged.due(owner, time.monotonic()):
            count, size = self.store.held_by(owner)
            logger.warning(
                "retained message on %s from %s refused: the store is full, or the client's share is"
                " (it holds %d messages, %d bytes; --max-retained-per-client, --max-retained-bytes-per-client);"
                " the topic keeps its message; more are counted, not logged",
                shown(topic),
                shown(owner),
                count,
                size,
            )
        return stored

    def presence_properties(self, event: PresenceEvent) -> bytes:
        """:func:`presence_properties` of ``event`` here and now."""
        return presence_properties(event, self.offline_ttl, self._clock())

    def page(
        self, topic_filter: str, cursor: str | None, limit: int = RETAINED_PAGE
    ) -> tuple[list[RetainedMessage], str | None]:
        """The next retained messages for ``topic_filter`` after ``cursor`` (None: from
        the start); returns them and the cursor of the rest (None: that was all)."""
        if cursor is None or cursor.startswith("s:"):
            after = None if cursor is None else cursor[2:]
            now = self._clock()
            page = self.store.page(topic_filter, now, after=after, budget=limit)
            out = [
                RetainedMessage(r.topic, r.payload, r.qos, expiring(r.properties, r.expires_at, now))
                for r in page.messages
            ]
            if page.cursor is not None:
                return out, "s:" + page.cursor
            if not self.presence or not presence_possible(topic_filter, self.presence_prefix):
                return out, None
            exact = exact_presence(topic_filter, self.presence_prefix)
            if exact is not None:
                message = self._presence_message(exact)
                return out + ([message] if message is not None else []), None
            return out, self._start_snapshot()
        number, _, start = cursor[2:].partition(":")
        ids = self._snapshots.get(int(number))
        if ids is None:
            return [], None  # forgotten (too many at once): the subscriber gets what it got
        index = int(start)
        end = min(index + limit, len(ids))
        prefix = self.presence_prefix
        everything = matches_every_presence_topic(topic_filter, prefix)
        out = []
        for client_id in ids[index:end]:
            if everything or topic_matches(topic_filter, prefix + client_id):
                message = self._presence_message(client_id)
                if message is not None:
                    out.append(message)
        if end >= len(ids):
            del self._snapshots[int(number)]
            return out, None
        return out, f"p:{number}:{end}"

    def _start_snapshot(self) -> str | None:
        if len(self._snapshots) >= _MAX_SNAPSHOTS:
            del self._snapshots[next(iter(self._snapshots))]
        number = next(self._numbers)
        self._snapshots[number] = [e.client_id for e in self.registry if e.client_id is not None]
        return f"p:{number}:0"

    def _presence_message(self, client_id: str) -> RetainedMessage | None:
        event = self.registry.get(client_id)
        if event is None:
            return None
        ttl, now = self.offline_ttl, self._clock()
        if event.status == "offline" and ttl is not None and event.time + ttl <= now:
            return None
        return RetainedMessage(
            self.presence_prefix + client_id, event.payload(), 0, presence_properties(event, ttl, now)
        )
