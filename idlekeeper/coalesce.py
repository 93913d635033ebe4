"""When the dense engine runs its passes: at each wake-up, or once a coalescing window.

Interrupt moderation, as network cards do it: while traffic trickles in, a wake-up
of trio's loop per packet costs far more than the packet. With ``coalesce`` set,
the engine serves what came, then gathers for ``coalesce`` seconds and serves what
came meanwhile in one pass, until a pass finds nothing. What must not wait out a
window (a connection to accept, a drop to tell its protocol) still does not.

``coalesce_canned`` moderates only the traffic the engine answers itself: a window
follows a pass whose every read was a canned request (a keep-alive's PINGREQ), and
the first pass that serves anything else (a PUBLISH, an acknowledgement, a queue to
drain, a connection to accept) ends the run of windows. A fleet's heartbeats are
gathered; a flow of messages is served a wake-up a read, as without it. With
``canned_rate``, only while they come at least that fast (:class:`CannedPace`): a
lone probe is answered as it comes, which is what a window could not improve on.
"""

from __future__ import annotations

from typing import NoReturn

import trio

from .direct_wait import open_direct_wait
from .dispatch import Dispatcher

__all__ = ["CannedPace", "run_passes"]


class CannedPace:
    """Whether canned requests come fast enough to be worth a window: their rate, taken
    over spans of at least ``span`` seconds, at or above ``threshold`` a second (0:
    always). Pure: the count (the engine's ``canned``) and the time are given.

    Measured where the engine asks, after a pass that answered nothing else; a long
    quiet spell makes one long span, so the first probe after it is served alone."""

    __slots__ = ("threshold", "span", "_since", "_count", "_busy")

    def __init__(self, threshold: float, span: float = 0.5) -> None:
        self.threshold = threshold
        self.span = span
        self._since: float | None = None
        self._count = 0
        self._busy = False

    def busy(self, count: int, now: float) -> bool:
        """Whether a window should follow, ``count`` requests answered so far, at ``now``."""
        if not self.threshold:
            return True
        since = self._since
        if since is None:
            self._since, self._count = now, count
        elif now - since >= self.span:
            self._busy = count - self._count >= self.threshold * (now - since)
            self._since, self._count = now, count
        return self._busy


async def run_passes(engine: Dispatcher, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
    """The engine's task: a pass whenever its epoll set is readable, then, while passes
    find something and the engine's ``coalesce`` (seconds) is set, one a window; or,
    with ``coalesce_canned``, while they find nothing but canned requests."""
    epfd = engine._epoll.fileno()
    coalesce, canned = engine.coalesce, engine.coalesce_canned
    window = coalesce or canned
    arrivals = engine.arrivals
    pass_ = engine._pass
    pace = CannedPace(engine.canned_rate)
    direct = open_direct_wait(engine._epochs, engine.max_events) if engine.direct_wait else None
    if direct is not None:
        engine._mirror_into(direct.set)
    task_status.started()
    try:
        while True:
            polled = None if direct is None else direct.wait()
            if polled is None:
                await trio.lowlevel.wait_readable(epfd)
            else:
                engine.direct_passes += 1
                engine._direct_polled = polled
            # Read as soon as it is ready: its own epoch is a good enough stamp.
            engine._stamping = arrivals if coalesce else None
            began = trio.current_time() if window else 0.0  # a clock read only where windows follow
            handled = pass_()
            while handled and (
                coalesce or (canned and engine._only_canned and pace.busy(engine.canned, trio.current_time()))
            ):
                if engine._backlog:
                    # A listener had more waiting than a pass accepts: accepting must not
                    # be paced by the window (a ramp would queue in the kernel's backlog).
                    await trio.lowlevel.checkpoint()
                else:
                    engine.windows += 1
                    # A pass every window, its own time included: what comes just after a
                    # pass waits a window at most, however long the passes grow.
                    await _gather(engine, began + window, window)
                engine._stamping = arrivals
                began = trio.current_time()
                handled = pass_()
    finally:
        if direct is not None:
            engine._mirror_into(None)
            direct.close()


async def _gather(engine: Dispatcher, until: float, window: float) -> None:
    """Wait out a coalescing window, to ``until`` (at once if that has passed: a pass
    that took a window or more); end it early for a connection to accept.

    Drops from outside a pass (an expiry, a takeover) are told to their protocols
    as they happen, not a window later: that is when a presence server says
    "offline".
    """
    now = trio.current_time()
    if until <= now:
        await trio.lowlevel.checkpoint()
        return
    # One wake-up for the window's end and the reaper's: the window may end up to
    # half of it early (replies only come sooner).
    urgent = engine._urgent_fd
    with engine.keeper.shared_wakeup(until, max(now, until - window / 2)):
        while True:
            await trio.lowlevel.wait_readable(urgent)
            if engine._as_pass(engine._urgent_pass):
                return
