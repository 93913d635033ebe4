"""A fleet node's queue of reports for Redis: what the worker's calls leave for the
flusher, bounded, in order, so that none of them waits for Redis.

While Redis is unreachable the queue holds the reports; past its limit new ones are
dropped and counted, and a resynchronisation is scheduled so the registry heals anyway.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ...broker.reports import Opened, Report
from ...presence.event import PresenceEvent
from .metrics import FleetCounts

__all__ = ["OpenQuestion", "Queued", "ReportQueue", "Request"]

Request = tuple[Any, Callable[[Any], None]]
"""How a queued report is applied: a script call (on a connection or a pipeline), and
what to do with its reply."""


class OpenQuestion:
    """An ``open_session`` waiting in the queue for its answer."""

    __slots__ = ("client_id", "username", "v5", "expiry", "create", "answer", "done", "abandoned")

    def __init__(
        self, client_id: str, username: str | None, v5: bool = False, expiry: int | None = None, create: bool = True
    ) -> None:
        self.client_id = client_id
        self.username = username
        self.v5 = v5
        """The client speaks MQTT 5.0: its session's messages are written so."""
        self.expiry = expiry
        """A new session's expiry, in seconds (None: the fleet's)."""
        self.create = create
        """False: resume a stored session, but make none."""
        self.answer: Opened | None = None
        self.done = trio.Event()
        self.abandoned = False
        """Its CONNECT was refused meanwhile: nobody waits for the answer any more."""


@dataclass(frozen=True, slots=True)
class Queued:
    """One queued report: an online/offline event, a message to route or retain, a
    persistent session's change, or the opening of one."""

    kind: str  # "online" | "offline" | "route" | "retain" | "session" | "open"
    event: PresenceEvent | None = None
    forget: bool = False
    topic: str = ""
    payload: bytes = b""
    qos: int = 0
    owner: str = ""
    properties: bytes = b""
    """A route's or a retained message's MQTT 5 properties, packed."""
    retain: bool = False
    """A route's retain flag as published (for Retain As Published)."""
    origin: str = ""
    """A route's publisher (its client id), for the No Local of its own persistent session."""
    plain: bool = True
    """False: a route for its ``shares`` only (a message a group's member left unacknowledged)."""
    shares: dict[str, list[str]] = field(default_factory=dict)
    """A route's shared subscriptions, by the node picked to serve each."""
    report: Report | None = None
    question: OpenQuestion | None = None


class ReportQueue:
    """The reports waiting for Redis, and whether a resynchronisation is due.

    The flusher takes reports off only once Redis confirmed them (``busy`` meanwhile),
    so ``enqueued`` and ``applied`` tell a caller when what it reported is in Redis.
    """

    def __init__(self, counts: FleetCounts, *, limit: int) -> None:
        self.counts = counts
        self.limit = limit
        self.items: deque[Queued] = deque()
        self.busy = False  # the flusher holds reports it has taken but not yet confirmed
        self.resync = False
        """The host's sessions are to be claimed again (the lease was lost, or reports dropped)."""
        self.reconcile = False
        """With the resynchronisation, end what Redis has this node holding that it no longer holds."""
        self.enqueued = 0  # reports queued, ever
        self.applied = 0  # reports the flusher has confirmed, ever
        self.queued_since: float | None = None
        self._wakeup = trio.Event()

    def put(self, report: Queued) -> bool:
        """Queue ``report`` for the flusher; False if the queue is full (dropped, counted)."""
        if len(self.items) >= self.limit:
            # Dropping the newest keeps the order of what is kept; a resync later
            # re-claims live sessions and ends the ones whose offline was dropped
            # (and detaches the persistent sessions this node no longer holds).
            self.counts.dropped += 1
            if report.kind not in ("route", "retain", "open"):
                self.resync = self.reconcile = True
            return False
        if not self.items:
            self.queued_since = time.monotonic()
        self.enqueued += 1
        self.items.append(report)
        self._wakeup.set()
        return True

    def resync_soon(self, *, reconcile: bool = False) -> None:
        """Have the flusher claim the host's sessions again before its next reports (and,
        with ``reconcile``, end what Redis has this node holding that it no longer holds)."""
        self.resync = True
        self.reconcile = self.reconcile or reconcile
        self._wakeup.set()

    async def wait(self) -> None:
        """Until a report is queued or a resynchronisation is asked for."""
        await self._wakeup.wait()
        self._wakeup = trio.Event()
