"""Who holds each client id, and the rules that make every offline event exactly once.

Pure. A *session* is one accepted connection, named by its epoch (unique fleet-wide).
The registry keeps each client id's last presence event; the rules are the same
whichever coordinator applies them (the supervisor's authority on one machine,
a Lua script on Redis for a fleet):

- ``online``: the new session becomes the owner. If another session was online, it
  is ended here, once, with reason ``takeover`` (its holder is told to close it).
  Reports from different workers can cross on the way: a session accepted *before*
  the current owner (by its event's clock) loses at once, unpublished, and its
  holder is told to close it, so subscribers never see an older session win.
- ``offline``: emitted only if it ends the session the record names and that
  session is still online (or the record is gone, so nobody else can have
  emitted it). A late report for a session already ended is dropped.
- ``lose``: every session a dead worker or node held goes offline with the loss
  reason, once; reports the dead one sent before dying are taken first by whoever
  applies this (they are compare-and-set the same way, so order is all that matters).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..mqtt.endings import Offline
from ..presence.event import PresenceEvent

__all__ = ["Claim", "Registry", "takeover_of"]


@dataclass(frozen=True, slots=True)
class Claim:
    """What an ``online`` report decided."""

    emit: list[PresenceEvent]
    """Events to publish, in order (the displaced session's offline, then the new online)."""
    evict: PresenceEvent | None
    """The displaced session, whose holder must close it; None if there was none."""


def takeover_of(old: PresenceEvent, new: PresenceEvent) -> PresenceEvent:
    """The offline event of ``old``, displaced by ``new`` (held elsewhere)."""
    where = f"node {new.node} worker {new.worker}" if new.node else f"worker {new.worker}"
    return dataclasses.replace(
        old,
        status="offline",
        reason=Offline.TAKEOVER,
        time=new.time,
        silent_for=0.0,
        detail=f"reconnected on {where}",
    )


RECORD_BYTES = 384
"""What a record costs in memory besides its client id (tracemalloc, CPython 3.11:
the event, its strings, the dict slot): 392 bytes with a 10-byte id, 638 with 256."""
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
"""Bytes of records kept at most unless told otherwise (about a million of them)."""


def record_size(client_id: str) -> int:
    """The bytes a record of ``client_id`` counts against the budget."""
    return RECORD_BYTES + (len(client_id) if client_id.isascii() else len(client_id.encode()))


class Registry:
    """The last presence event of each client id, bounded to ``max_records`` records and
    ``max_bytes`` of them (:func:`record_size`).

    Online devices are never forgotten; past a bound, offline records go, the ids seen
    only once first (a flood of made-up ids must not push out devices that come back),
    then the longest-offline (the dict is kept oldest-first by re-inserting on every
    change).
    """

    def __init__(self, max_records: int = 1_000_000, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.bytes = 0
        """Bytes of records held, as counted against ``max_bytes``."""
        self._records: dict[str, PresenceEvent] = {}
        self._once: dict[str, None] = {}
        """Client ids with one session so far, in the order they first came."""
        self.online_count = 0
        self.changed: Callable[[str], None] | None = None
        """Told the client id of every record written or forgotten (a durable store's journal)."""

    def restore(self, event: PresenceEvent, once: bool) -> None:
        """Take back a record a durable store kept (``once``: its id had one session),
        oldest first, as if it had just been written; nothing is told to :attr:`changed`."""
        assert event.client_id is not None
        changed, self.changed = self.changed, None
        try:
            self._store(event)
        finally:
            self.changed = changed
        if event.status == "online":
            self.online_count += 1
        if once:
            self._once[event.client_id] = None

    def seen_once(self, client_id: str) -> bool:
        """Whether ``client_id`` has had one session so far (shed first past a bound)."""
        return client_id in self._once

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[PresenceEvent]:
        return iter(list(self._records.values()))

    def get(self, client_id: str) -> PresenceEvent | None:
        """The device's last event, or None if it is unknown (or forgotten)."""
        return self._records.get(client_id)

    def online(self, event: PresenceEvent) -> Claim:
        """A session was accepted."""
        assert event.client_id is not None and event.status == "online"
        old = self._records.get(event.client_id)
        if old is not None and old.status == "online" and old.epoch == event.epoch:
            return Claim([], None)  # a report sent twice (a resend after a reconnect)
        if old is not None and old.status == "online" and event.time < old.time:
            return Claim([], event)  # it crossed a newer session's report: it lost already
        emit: list[PresenceEvent] = []
        evict = None
        if old is None:
            self._once[event.client_id] = None
        else:
            self._once.pop(event.client_id, None)
        if old is not None and old.status == "online":
            emit.append(takeover_of(old, event))
            evict = old
            self.online_count -= 1
        self._store(event)
        self.online_count += 1
        emit.append(event)
        return Claim(emit, evict)

    def offline(self, event: PresenceEvent, *, forget: bool = False) -> PresenceEvent | None:
        """A session ended; returns the event to publish, or None if it was already ended.

        ``forget``: drop the record instead of keeping it (a server-assigned client id
        cannot be looked up again).
        """
        assert event.client_id is not None and event.status == "offline"
        old = self._records.get(event.client_id)
        if old is not None and (old.epoch != event.epoch or old.status != "online"):
            return None
        if old is not None:
            self.online_count -= 1
        if forget:
            self._forget(event.client_id)
        else:
            self._store(event)
        return event

    def lose(
        self, held: Callable[[PresenceEvent], bool], reason: Offline, detail: str, now: float
    ) -> list[PresenceEvent]:
        """End every online session for which ``held(event)`` is true; returns their events."""
        lost = [e for e in self._records.values() if e.status == "online" and held(e)]
        out = []
        for old in lost:
            event = dataclasses.replace(old, status="offline", reason=reason, time=now, silent_for=0.0, detail=detail)
            self._store(event)
            self.online_count -= 1
            out.append(event)
        return out

    def _store(self, event: PresenceEvent) -> None:
        client_id = event.client_id
        assert client_id is not None
        if self._records.pop(client_id, None) is None:
            self.bytes += record_size(client_id)
        self._records[client_id] = event
        if self.changed is not None:
            self.changed(client_id)
        excess = len(self._records) - self.max_records
        if excess > 0 or self.bytes > self.max_bytes:
            self._shed(max(excess, 1))

    def _shed(self, excess: int) -> None:
        """Forget ``excess`` offline records (or more, until the bytes fit), ids seen once
        first. Only a few records at the old end of each order are looked at: online
        ones there are skipped, and a call costs O(excess), never O(records)."""
        for order in (self._once, self._records):
            while excess > 0 or self.bytes > self.max_bytes:
                window = itertools.islice(order, excess * 2 + 16)
                gone = [k for k in window if self._records[k].status != "online"][: max(excess, 16)]
                if not gone:
                    break
                for key in gone:
                    self._forget(key)
                    excess -= 1
                    if excess <= 0 and self.bytes <= self.max_bytes:
                        return

    def _forget(self, client_id: str) -> None:
        if self._records.pop(client_id, None) is not None:
            self.bytes -= record_size(client_id)
            if self.changed is not None:
                self.changed(client_id)
        self._once.pop(client_id, None)
