"""The reaper's alarm, and the waits of other tasks that share its wake-ups.

The reaper sleeps in a cancel scope whose deadline is the wheel's next deadline; a
filing earlier than that brings the deadline forward (:meth:`Alarm.poke`). Another
task's wait that may end anywhere in a span (the dense engine's coalescing window)
is kept in step with it (:meth:`Alarm.shared_wakeup`), so that trio wakes the
process once for both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["Alarm"]


class Alarm:
    """When the reaper wakes next; see the module. ``slack`` is how far (seconds) a
    reaper visit may be brought forward to a shared wait's end (half a lookahead)."""

    def __init__(self, slack: float) -> None:
        self._slack = slack
        self._sleep: trio.CancelScope | None = None
        self._window: tuple[trio.CancelScope, float] | None = None
        """Another task's wait to share wake-ups with."""

    async def sleep_until(self, deadline: float | None) -> None:
        """The reaper's sleep: until ``deadline`` (None: until poked), or sooner if poked."""
        with trio.CancelScope(deadline=math.inf if deadline is None else deadline) as scope:
            self._sleep = scope
            self._align()
            try:
                await trio.sleep_forever()
            finally:
                self._sleep = None

    def poke(self, due: float) -> None:
        """Wake the reaper sooner if ``due`` is before its alarm."""
        scope = self._sleep
        if scope is not None and due < scope.deadline:
            scope.deadline = due
            self._align()

    @contextmanager
    def shared_wakeup(self, latest: float, earliest: float) -> Iterator[trio.CancelScope]:
        """A cancel scope for a wait that must end by ``latest`` and may end as early as
        ``earliest``; see :meth:`idlekeeper.Keeper.shared_wakeup`."""
        with trio.CancelScope(deadline=latest) as scope:
            window = (scope, earliest)
            self._window = window
            self._align()
            try:
                yield scope
            finally:
                if self._window is window:
                    self._window = None

    def _align(self) -> None:
        window, sleep = self._window, self._sleep
        if window is None or sleep is None:
            return
        scope, earliest = window
        alarm, latest = sleep.deadline, scope.deadline
        if latest <= trio.current_time():
            return  # over, though its owner has not run yet to leave the block
        if earliest <= alarm < latest:
            scope.deadline = alarm
        elif latest < alarm <= latest + self._slack:
            sleep.deadline = latest
