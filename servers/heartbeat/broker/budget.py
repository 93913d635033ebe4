"""Bytes queued for subscribers' sockets, bounded per subscriber and per worker: the policy, sans-IO.

A subscriber that does not read must not make a worker hold its messages without
limit (issue 11: one stuck subscriber and 256 KiB publishes took a worker from
862 MB to 8.4 GB of RSS in 12 s, while the bound counted messages). A
:class:`SendBudget` decides, for each packet about to be queued for a subscriber's
socket, whether it is queued or dropped, and which subscribers have fallen so far
behind that their connection is cut (``send-overflow``). Both engines ask it the
same questions (the broker does); it never touches a socket, and its clock is passed
in and read only on the drop path.

The rules:

- **Per subscriber** (``per_subscriber``, ``--max-subscriber-bytes``): a QoS 0
  message that would take the bytes queued for a subscriber past its bound is
  dropped (reason ``subscriber-bytes``). An empty queue always takes one message,
  so a bound below the largest packet cannot starve a subscriber that reads.
- **Per worker** (``total``, ``--max-outbox-bytes``): a QoS 0 message that would
  take the bytes queued for all subscribers past it is dropped (``total-bytes``);
  the subscriber holding the most bytes is then cut if it is behind by more than
  its own bound.
- **Held packets** are never dropped: QoS 1 and 2 messages an outbox released (the
  outbox bounds those) and the replies to a client's own packets (CONNACK, SUBACK,
  PINGRESP, PUBACK...). They are counted; one that would take a subscriber's queue
  past the hard cap (``2 × per_subscriber``) cuts it instead, unless the queue is at
  half its bound or less (then it is keeping up, and the packet is only large).
- **Behind**: a subscriber is behind from its first dropped message while more than
  half its bound is queued, until its queue is back at half its bound or less. Its
  *backlog* is the bytes queued plus the bytes dropped for it since it fell behind:
  how far it trails what it was sent. It is cut when its backlog passes the hard
  cap (it lost a whole bound's worth in one stretch), or when it has been behind
  for longer than ``grace`` (the send timeout) however slowly it loses. A subscriber
  whose queue is at half its bound or less is never cut: it is keeping up.

Queued bytes are the engine's own figure for each subscriber (``measure``; the
dense engine's transport buffer, the streams engine's queue and the batch being
sent), read when a packet is offered and noted when the engine reports a drain.
Between those reports a queue can only shrink, so the worker's :attr:`total` is an
upper bound; when it reaches ``total`` it is recounted exactly, at most every
``recount_every`` seconds (a recount costs one look per subscriber holding bytes).
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = [
    "CONGESTED_BYTES",
    "DEFAULT_MAX_OUTBOX_BYTES",
    "DEFAULT_MAX_SUBSCRIBER_BYTES",
    "HARD_FACTOR",
    "SUBSCRIBER_BYTES",
    "TOTAL_BYTES",
    "Offer",
    "SendBudget",
]

DEFAULT_MAX_SUBSCRIBER_BYTES = 16 * 1024 * 1024
"""Bytes queued for one subscriber's socket before its QoS 0 messages are dropped
(as Mosquitto's ``max_queued_bytes``, which it applies to QoS 1 and 2 only)."""
DEFAULT_MAX_OUTBOX_BYTES = 256 * 1024 * 1024
"""Bytes queued for all subscribers of one worker: sixteen subscribers at their
default bound. With the 11 workers that hold 200,000 devices on a 24 GiB machine,
at most 2.75 GiB of queues, beside ~2 KiB per device."""
HARD_FACTOR = 2
"""A subscriber's hard cap, as a multiple of its bound."""
CONGESTED_BYTES = 256 * 1024
"""Bulk sends (retained messages for a new subscription) wait while this much is
queued for the subscriber, on either engine (the dense engine's high-water mark)."""
RECOUNT_EVERY = 0.05
"""Seconds between exact recounts of the worker's total, while it is at its bound."""

SUBSCRIBER_BYTES = "subscriber-bytes"
"""Why a QoS 0 message was dropped: its subscriber's queue was at its bound."""
TOTAL_BYTES = "total-bytes"
"""Why a QoS 0 message was dropped: the worker's queues were at their bound."""

K = TypeVar("K", bound=Hashable)


class Offer(enum.Enum):
    """What becomes of a packet offered for a subscriber's queue."""

    QUEUE = "queue"
    """Queue it (then :meth:`SendBudget.settle` what the subscriber holds)."""
    DROP = "drop"
    """Drop it (counted by reason in :attr:`SendBudget.dropped`)."""
    CUT = "cut"
    """Drop it: the subscriber is cut off (:meth:`SendBudget.take_cut` says why)."""


class _Behind:
    """When a subscriber fell behind, and the bytes dropped for it since."""

    __slots__ = ("since", "lost")

    def __init__(self, since: float) -> None:
        self.since = since
        self.lost = 0


class SendBudget(Generic[K]):
    """The byte bounds on what is queued for subscribers' sockets, per subscriber and in total.

    ``measure(key)`` is what the engine holds for a subscriber now; ``clock`` is the
    server's monotonic clock (read only when a message is dropped). See the module
    docs for the rules. Keys are forgotten with :meth:`forget` when their connection ends.
    """

    def __init__(
        self,
        measure: Callable[[K], int],
        clock: Callable[[], float],
        per_subscriber: int = DEFAULT_MAX_SUBSCRIBER_BYTES,
        total: int = DEFAULT_MAX_OUTBOX_BYTES,
        grace: float = 30.0,
        *,
        hard_factor: int = HARD_FACTOR,
        recount_every: float = RECOUNT_EVERY,
    ) -> None:
        if per_subscriber < 1 or total < 1:
            raise ValueError("the byte bounds must be at least 1")
        if hard_factor < 1:
            raise ValueError("the hard cap cannot be below the bound")
        self.measure = measure
        self.clock = clock
        self.per_subscriber = per_subscriber
        self.limit = total
        self.hard = per_subscriber * hard_factor
        self.grace = grace
        self.recount_every = recount_every
        self._low = per_subscriber // 2
        self.total = 0
        """Bytes queued for every subscriber, at most (exact after a recount)."""
        self.peak_subscriber = 0
        """The most bytes one subscriber held after a packet was queued for it."""
        self.peak_total = 0
        """The most :attr:`total` reached after a packet was queued."""
        self.dropped: collections.Counter[str] = collections.Counter()
        """QoS 0 messages dropped, by reason (:data:`SUBSCRIBER_BYTES`, :data:`TOTAL_BYTES`)."""
        self.cuts = 0
        """Subscribers cut off (send-overflow)."""
        self._queued: dict[K, int] = {}
        self._behind: dict[K, _Behind] = {}
        self._cut: list[tuple[K, str]] = []
        self._recounted = -math.inf

    def __len__(self) -> int:
        """Subscribers known to hold queued bytes."""
        return len(self._queued)

    @property
    def behind(self) -> int:
        """Subscribers behind now (losing messages with more than half their bound queued)."""
        return len(self._behind)

    @property
    def cutting(self) -> bool:
        """Whether subscribers wait to be cut off (:meth:`take_cut`)."""
        return bool(self._cut)

    def offer(self, key: K, queued: int, size: int, *, held: bool = False) -> Offer:
        """A packet of ``size`` bytes for ``key``, which holds ``queued`` bytes now:
        whether to queue it. ``held``: a packet that must not be dropped."""
        # Every QoS 0 delivery comes here: the common case (nothing known, nothing
        # queued) costs two dict lookups and no call.
        known = self._queued.get(key, 0)
        if queued != known:
            self._note(key, queued)
        if queued <= self._low and self._behind and key in self._behind:
            del self._behind[key]  # it caught up
        if held:
            if queued > self._low and queued + size > self.hard:
                self._cut_off(key, f"{queued} bytes queued, a {size}-byte packet would pass the hard cap ({self.hard})")
                return Offer.CUT
            return Offer.QUEUE
        if queued and queued + size > self.per_subscriber:
            return self._drop(key, queued, size, SUBSCRIBER_BYTES)
        if self.total + size > self.limit:
            largest = self._recount_due()
            if self.total + size > self.limit:
                outcome = self._drop(key, queued, size, TOTAL_BYTES)
                if largest is not None and self._shed(largest) and largest == key:
                    outcome = Offer.CUT
                return outcome
        return Offer.QUEUE

    def settle(self, key: K, queued: int) -> None:
        """What ``key`` holds now: after a packet was queued for it, or after the engine wrote some."""
        if queued != self._queued.get(key, 0):
            self._note(key, queued)
        if queued > self.peak_subscriber:
            self.peak_subscriber = queued
        if self.total > self.peak_total:
            self.peak_total = self.total

    def forget(self, key: K) -> None:
        """``key``'s connection ended: what it held is no longer queued."""
        self.total -= self._queued.pop(key, 0)
        self._behind.pop(key, None)

    def take_cut(self) -> list[tuple[K, str]]:
        """The subscribers to cut off (send-overflow), each with why, once each."""
        cut, self._cut = self._cut, []
        return cut

    def backlog(self, key: K) -> int:
        """Bytes queued for ``key`` plus those dropped for it since it fell behind."""
        behind = self._behind.get(key)
        return self._queued.get(key, 0) + (0 if behind is None else behind.lost)

    # -- inside ----------------------------------------------------------------------

    def _note(self, key: K, queued: int) -> None:
        known = self._queued.get(key, 0)
        if queued != known:
            self.total += queued - known
            if queued:
                self._queued[key] = queued
            else:
                del self._queued[key]

    def _drop(self, key: K, queued: int, size: int, reason: str) -> Offer:
        self.dropped[reason] += 1
        if queued <= self._low:
            return Offer.DROP  # keeping up; dropped only because the worker is full
        now = self.clock()
        behind = self._behind.get(key)
        if behind is None:
            behind = self._behind[key] = _Behind(now)
        behind.lost += size
        if queued + behind.lost > self.hard:
            self._cut_off(
                key, f"{queued} bytes queued and {behind.lost} dropped since it fell behind (hard cap {self.hard})"
            )
            return Offer.CUT
        if now - behind.since > self.grace:
            self._cut_off(key, f"behind for {now - behind.since:.1f} s (longer than {self.grace:g} s), {queued} queued")
            return Offer.CUT
        return Offer.DROP

    def _recount_due(self) -> K | None:
        """Recount the total exactly unless that was done lately; returns the subscriber
        holding the most bytes if it was recounted."""
        now = self.clock()
        if now - self._recounted < self.recount_every:
            return None
        self._recounted = now
        measure = self.measure
        total = 0
        largest: K | None = None
        most = 0
        queued = self._queued
        behind = self._behind
        low = self._low
        for key in list(queued):
            held = measure(key)
            if held <= low and key in behind:
                del behind[key]  # it caught up since it was last looked at
            if held:
                queued[key] = held
                total += held
                if held > most:
                    most, largest = held, key
            else:
                del queued[key]
        self.total = total
        return largest

    def _shed(self, key: K) -> bool:
        """The worker is full: the subscriber holding the most is cut if it is behind
        by more than its bound; returns whether it was."""
        if key not in self._behind or self.backlog(key) <= self.per_subscriber:
            return False
        self._cut_off(
            key, f"holds the most of a full worker ({self._queued.get(key, 0)} bytes), behind by {self.backlog(key)}"
        )
        return True

    def _cut_off(self, key: K, why: str) -> None:
        self.cuts += 1
        self._cut.append((key, why))
        self.forget(key)  # it is being closed: what it holds is on its way out
