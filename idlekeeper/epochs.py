"""Coarse activity stamps that can make an expiry late but never early.

Recording activity must cost about one attribute store, so it cannot read a clock
(``trio.current_time()`` is ~230 ns, twenty times a store). Instead an activity
stores a reference to the current :class:`Epoch`: one pass of the event loop. The
loop driver calls :meth:`EpochClock.seal` just before each I/O wait, which stamps
the epoch with the time its pass ended and starts a new one.

Why a sealed stamp can never make an expiry early
-------------------------------------------------
Let an activity happen at true time ``a``, stamping epoch ``e``.

1. ``e`` was current at ``a``, so ``e`` is sealed (if at all) at a later call to
   ``seal(now)``, whose ``now`` is read from the same monotonic clock after ``a``:
   ``e.end >= a``.
2. While ``e`` is unsealed, :func:`latest` answers with the reader's ``now``, and
   the reader runs at or after ``a``: again ``>= a``.

So ``latest(e, now) >= a``, and any deadline computed as ``latest + timeout`` is at
or after the true ``a + timeout``. The stamp can only err late, by at most the
length of the loop pass the activity happened in (``e.end - a``): microseconds to
milliseconds on a healthy server, which the keeper's lag histogram reports.
"""

from __future__ import annotations

import math

__all__ = ["Epoch", "EpochClock", "NEVER", "Stamp", "latest"]


class Epoch:
    """One pass of the event loop. ``end`` is when it finished; ``inf`` while it runs."""

    __slots__ = ("end",)

    def __init__(self, end: float = math.inf) -> None:
        self.end = end

    def __repr__(self) -> str:
        return f"<Epoch end={self.end}>"


_new_epoch = Epoch.__new__

NEVER = Epoch(-math.inf)
"""The stamp of a connection that has had no activity yet."""

Stamp = Epoch | float
"""An activity's stamp: the epoch it happened in, or, for a read stamped with when the
kernel received its bytes (:mod:`idlekeeper.arrival`), that time itself. An epoch of
its own would cost each such connection an object (48 bytes), a float costs 24."""


def latest(epoch: Stamp, now: float) -> float:
    """The latest time at which an activity stamped ``epoch`` can have happened."""
    # type(), not isinstance(): this is the reaper's path, and the test is 12 ns cheaper.
    end = epoch if type(epoch) is float else epoch.end  # type: ignore[union-attr]
    return end if end < now else now


class EpochClock:
    """Hands out the current epoch; ``seal(now)`` closes it and opens the next."""

    __slots__ = ("current", "sealed")

    def __init__(self) -> None:
        self.current = Epoch()
        self.sealed = -math.inf
        """When the last epoch was sealed: a time no later than now, read with no clock."""

    def seal(self, now: float) -> None:
        """Close the current epoch at ``now`` (monotonic, non-decreasing)."""
        self.sealed = now
        self.current.end = now
        # Made without running __init__: a Python frame less on every pass, which is
        # every heartbeat's wake-up (a compiled Epoch is made this way as well).
        epoch = _new_epoch(Epoch)
        epoch.end = math.inf
        self.current = epoch
