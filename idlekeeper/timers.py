"""Delayed and repeating callbacks on a timing wheel, the job of Kafka's SystemTimer.

Pure: no trio, no I/O. The clock is a callable handed in, and ``run_due`` is called
by whoever owns the loop (the keeper's reaper, a test, a plain ``while`` loop).
A million pending callbacks cost a million small objects and O(1) per call.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from .lookahead import LookaheadWheel
from .wheel import TimingWheel, WheelEntry

__all__ = ["TimerHandle", "Timers"]

logger = logging.getLogger("idlekeeper.timers")


class TimerHandle(WheelEntry):
    """A pending call. ``cancel()`` it to stop it; ``when`` is its due time, and it
    runs no later than ``when + slack``."""

    __slots__ = ("when", "interval", "callback", "args", "slack", "_timers")

    def __init__(
        self,
        timers: Timers,
        when: float,
        interval: float | None,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        slack: float = 0.0,
    ) -> None:
        super().__init__()
        self.when = when
        self.interval = interval
        self.callback = callback
        self.args = args
        self.slack = slack
        self._timers: Timers | None = timers

    @property
    def cancelled(self) -> bool:
        """True once cancelled (or, for a one-shot timer, once it has run)."""
        return self._timers is None

    def cancel(self) -> bool:
        """Stop the call if it has not happened yet. Returns whether it was pending."""
        timers = self._timers
        if timers is None:
            return False
        self._timers = None
        timers._wheel.cancel(self)
        return True

    def __repr__(self) -> str:
        state = "cancelled" if self._timers is None else f"when={self.when:.3f}"
        return f"<TimerHandle {getattr(self.callback, '__qualname__', self.callback)} {state}>"


def _check_slack(slack: float) -> float:
    if not (slack >= 0 and math.isfinite(slack)):
        raise ValueError(f"slack must be a finite number >= 0, not {slack!r}")
    return float(slack)


def _log_error(handle: TimerHandle, exc: BaseException) -> None:
    logger.error("timer callback %r raised", handle.callback, exc_info=exc)


class Timers:
    """call_at / call_later / call_every over a :class:`TimingWheel`.

    ``clock`` returns the current time; ``wheel`` may be shared with other kinds of
    entries (the keeper files its connections in the same wheel), in which case
    the owner hands due :class:`TimerHandle` s to :meth:`fire`. ``on_schedule(due)``
    is told, each time a handle is filed, when the wheel will hand it back: an owner
    that sleeps between wake-ups uses it to wake sooner.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        tick: float = 0.01,
        *,
        wheel: TimingWheel[Any] | LookaheadWheel[Any] | None = None,
        on_error: Callable[[TimerHandle, BaseException], None] = _log_error,
        on_schedule: Callable[[float], None] | None = None,
    ) -> None:
        self._clock = clock
        self._wheel: TimingWheel[Any] | LookaheadWheel[Any] = wheel if wheel is not None else TimingWheel(tick, clock())
        self._on_error = on_error
        self._on_schedule = on_schedule
        self.fired = 0
        """How many callbacks have run."""

    def __len__(self) -> int:
        return len(self._wheel)

    def call_at(self, when: float, callback: Callable[..., object], *args: Any, slack: float = 0.0) -> TimerHandle:
        """Call ``callback(*args)`` once, no earlier than ``when``.

        ``slack`` (seconds) lets the call run up to that much later, so that it can
        share a wake-up its owner makes anyway: the handle is filed at ``when +
        slack``, and a :class:`~idlekeeper.lookahead.LookaheadWheel` that hands it out
        early, with whatever else it visits, runs it if ``when`` has come. With a
        plain wheel it simply runs at ``when + slack``.
        """
        handle = TimerHandle(self, when, None, callback, args, _check_slack(slack))
        self._file(handle)
        return handle

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> TimerHandle:
        """Call ``callback(*args)`` once, no earlier than ``delay`` from now."""
        return self.call_at(self._clock() + delay, callback, *args)

    def call_every(
        self,
        interval: float,
        callback: Callable[..., object],
        *args: Any,
        first: float | None = None,
        slack: float = 0.0,
    ) -> TimerHandle:
        """Call ``callback(*args)`` every ``interval`` until cancelled.

        The first call is at ``first`` (default: one interval from now). Calls keep
        to the original grid, so they do not drift; if the loop fell behind by
        several intervals, the missed ones collapse into a single call. ``slack``
        lets each call run up to that much after its time, as for :meth:`call_at`.
        """
        if not (interval > 0 and math.isfinite(interval)):
            raise ValueError(f"interval must be positive and finite, not {interval!r}")
        when = self._clock() + interval if first is None else first
        handle = TimerHandle(self, when, interval, callback, args, _check_slack(slack))
        self._file(handle)
        return handle

    def _file(self, handle: TimerHandle) -> None:
        due = self._wheel.schedule(handle, handle.when + handle.slack)
        if self._on_schedule is not None:
            self._on_schedule(due)

    def next_deadline(self) -> float | None:
        """When :meth:`run_due` will next have work, or None."""
        return self._wheel.next_deadline()

    def run_due(self, now: float | None = None) -> int:
        """Run every callback that is due at ``now`` (default: the clock). Returns the count."""
        if now is None:
            now = self._clock()
        ran = 0
        for handle in self._wheel.advance(now):
            ran += self.fire(handle, now)
        return ran

    def fire(self, handle: TimerHandle, now: float) -> bool:
        """Run one handle the wheel handed out and re-arm it if it repeats; returns
        whether it ran. A handle handed out before its time (a
        :class:`~idlekeeper.lookahead.LookaheadWheel` does that) is filed again instead.
        Errors go to ``on_error``."""
        if handle._timers is None:
            return False
        if handle.when > now:
            self._file(handle)
            return False
        interval = handle.interval
        if interval is None:
            handle._timers = None
        else:
            # The next grid point after now: calls whose time has come collapse into this one.
            missed = math.floor((now - handle.when) / interval)
            handle.when += interval * (missed + 1)
            self._file(handle)
        self.fired += 1
        try:
            handle.callback(*handle.args)
        except Exception as exc:
            self._on_error(handle, exc)
        return True
