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
gathered; a flow of messages is served a wake-up a read, as without it.
"""

from __future__ import annotations

from typing import NoReturn

import trio

from .direct_wait import open_direct_wait
from .dispatch import Dispatcher

__all__ = ["run_passes"]


async def run_passes(engine: Dispatcher, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
    """The engine's task: a pass whenever its epoll set is readable, then, while passes
    find something and the engine's ``coalesce`` (seconds) is set, one a window; or,
    with ``coalesce_canned``, while they find nothing but canned requests."""
    epfd = engine._epoll.fileno()
    coalesce, canned = engine.coalesce, engine.coalesce_canned
    window = coalesce or canned
    arrivals = engine.arrivals
    pass_ = engine._pass
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
            handled = pass_()
            while handled and (coalesce or (canned and engine._only_canned)):
                if engine._backlog:
                    # A listener had more waiting than a pass accepts: accepting must not
                    # be paced by the window (a ramp would queue in the kernel's backlog).
                    await trio.lowlevel.checkpoint()
                else:
                    engine.windows += 1
                    await _gather(engine, window)
                engine._stamping = arrivals
                handled = pass_()
    finally:
        if direct is not None:
            engine._mirror_into(None)
            direct.close()


async def _gather(engine: Dispatcher, seconds: float) -> None:
    """Wait out a coalescing window; end it early for a connection to accept.

    Drops from outside a pass (an expiry, a takeover) are told to their protocols
    as they happen, not a window later: that is when a presence server says
    "offline".
    """
    now = trio.current_time()
    # One wake-up for the window's end and the reaper's: the window may end up to
    # half of it early (replies only come sooner).
    urgent = engine._urgent_fd
    with engine.keeper.shared_wakeup(now + seconds, now + seconds / 2):
        while True:
            await trio.lowlevel.wait_readable(urgent)
            if engine._as_pass(engine._urgent_pass):
                return
