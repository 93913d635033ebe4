"""Waiting for the dense engine's sockets without a pass of trio's loop, while trio has
nothing else to do.

Where heartbeats come spread out, each one wakes the process on its own, and a wake-up
through trio's loop (the engine's task parked in ``wait_readable``, the loop's
deadline and instrument bookkeeping, the EPOLLONESHOT re-arming, the task switch)
costs about three times a plain ``epoll_wait`` and the pass it starts. So, after a
pass, when no other task is runnable, none waits for the loop to go idle, and no
deadline is due, the engine waits on an epoll set of its own that holds trio's own
epoll set and, beside the engine's main set, each of its sockets (one ``epoll_wait``
then says which are ready: a set nested in this one would cost a second, and its
wake-ups more). It runs the next pass itself with what came, and gives the loop back
at once when anything else happens:

- another task's socket, a signal, or a ``run_sync_soon`` from a thread makes trio's
  set readable (trio's wake-up socket is a member of it);
- the earliest of trio's deadlines (a ``sleep``, a cancel scope's, the keeper's
  reaper) bounds the wait, so every timer fires when it would have;
- a pass that wakes a task (a channel send, an event set) leaves it runnable, and the
  next check finds it.

Before waiting it seals the current epoch, as trio's loop does before its own wait
(:mod:`idlekeeper._loop_epochs`), so activity stamps stay never-early.

Only when it is alone in the batch of tasks trio is running, though: trio takes its
whole run queue as a batch, so a task woken in the same loop pass (the reaper, by its
deadline) is in no queue while it waits its turn, and a wait of the engine's would
hold it there. An instrument looks at the run queue after each of trio's I/O waits,
when the batch is all but made: the engine alone in it, and no deadline due (a task
woken by its deadline joins the batch after that look, and can only have been due
by then), is the one case in which it may wait.

This reads trio's run state (``runq``, the deadline heap, ``waiting_for_idle``, the
system clock's offset), which is not public API: the only module that does. The heap's
top is read without trio's pruning call: a cancelled deadline there only ends a wait
sooner. Anything it does not recognise
(another trio's internals, a guest run, a clock that is not the system clock, such as
the tests' ``MockClock``) turns it off, and the engine waits through trio as before.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
from time import perf_counter
from typing import Any

import trio

from .epochs import EpochClock

__all__ = ["DirectWait", "open_direct_wait"]

logger = logging.getLogger("idlekeeper.engine")

# The longest single wait, in seconds: a bound of our own on top of trio's deadlines,
# so that nothing unforeseen can hold the loop for long.
MAX_WAIT = 1.0


class _BatchWatch(trio.abc.Instrument):
    """After each of trio's I/O waits: whether the engine's task will run alone in the
    batch, and if so until when that holds (the earliest deadline then)."""

    def __init__(self, runner: Any, task: trio.lowlevel.Task) -> None:
        self._runner = runner
        self._task = task
        self.alone_until = -math.inf

    def after_io_wait(self, timeout: float) -> None:
        runner = self._runner
        runq = runner.runq
        if len(runq) == 1 and runq[0] is self._task and not runner.waiting_for_idle:
            # Trio reads its clock after this to expire deadlines: a task it wakes then
            # had a deadline at or before this one, due by the time the engine runs.
            self.alone_until = runner.deadlines.next_deadline()
        else:
            self.alone_until = -math.inf


class DirectWait:
    """An epoll set holding trio's set and, registered there by the engine beside its
    own set, the engine's sockets; see the module."""

    __slots__ = (
        "_batch",
        "_deadlines",
        "_epochs",
        "_give_back",
        "_idle_waiters",
        "_max_events",
        "_offset",
        "_runq",
        "_trio_fd",
        "set",
    )

    def __init__(self, runner: Any, trio_fd: int, epochs: EpochClock, max_events: int) -> None:
        # Read at every wait, so held here rather than reached through the runner (trio
        # keeps these objects for the whole run); the clock as the system clock's sum.
        self._runq = runner.runq
        self._idle_waiters = runner.waiting_for_idle
        self._deadlines = runner.deadlines
        self._offset: float = runner.clock.offset
        self._trio_fd = trio_fd
        self._epochs = epochs
        self._max_events = max_events + 1  # room for trio's set beside a full batch
        self.set = select.epoll()
        """The set to wait on: the engine registers each of its sockets here as in its own."""
        self.set.register(trio_fd, select.EPOLLIN)
        self._give_back = False
        self._batch = _BatchWatch(runner, trio.lowlevel.current_task())
        trio.lowlevel.add_instrument(self._batch)

    def wait(self) -> list[tuple[int, int]] | None:
        """Wait for the engine's sockets while trio has nothing to do: their events, for
        the next pass to serve; None to wait through trio instead (the engine is not alone
        in trio's batch, something else is runnable, a deadline is due, the wait timed
        out, or trio's set was ready: then after this pass, if sockets were ready too)."""
        if self._give_back:
            self._give_back = False
            return None
        if self._runq or self._idle_waiters:
            return None
        now = self._offset + perf_counter()
        if now >= self._batch.alone_until:
            return None
        # The top of trio's heap, without a call to prune it: a cancelled deadline there
        # is earlier than the next live one, so it only ends the wait sooner, and trio's
        # loop, which the engine then goes through, prunes it.
        heap = self._deadlines._heap
        timeout = (heap[0][0] if heap else math.inf) - now
        if timeout <= 0.0:
            return None
        # Stamps made in the pass just ended are sealed here, as trio's loop would
        # before its own wait; the epoch that opens is the next pass's.
        self._epochs.seal(now)
        # epoll rounds a timeout up to the millisecond: never before the deadline.
        events = self.set.poll(timeout if timeout < MAX_WAIT else MAX_WAIT, self._max_events)
        trio_fd = self._trio_fd
        for i, (fd, _) in enumerate(events):
            if fd == trio_fd:
                del events[i]
                if not events:
                    return None
                self._give_back = True
                break
        return events or None

    def close(self) -> None:
        """Release the epoll set and the instrument."""
        self.set.close()
        with contextlib.suppress(KeyError, RuntimeError):
            trio.lowlevel.remove_instrument(self._batch)


def _trio_state() -> tuple[Any, int] | None:
    """The run's state and trio's epoll descriptor, where this run can be waited on
    directly; None where it cannot."""
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT, SystemClock

        runner = GLOBAL_RUN_CONTEXT.runner
        if runner.is_guest or type(runner.clock) is not SystemClock:
            return None
        trio_fd = runner.io_manager._epoll.fileno()
        # The attributes wait() reads, read once here: a trio that lacks any of them
        # turns the feature off instead of failing in a pass.
        runner.runq.__len__()
        runner.waiting_for_idle.__len__()
        deadline = runner.deadlines.next_deadline()
        heap, offset = runner.deadlines._heap, runner.clock.offset
    except (ImportError, AttributeError, TypeError) as exc:
        # Not a choice of the caller's (as a MockClock is): this trio is not the one
        # this module reads. Said once an engine, so that the CPU it costs is explained.
        logger.info("idlekeeper: the engine waits through trio's loop only (trio's run state: %r)", exc)
        return None
    kinds = ((trio_fd, int), (deadline, float), (heap, list), (offset, float))
    if not all(isinstance(value, kind) for value, kind in kinds):
        logger.info("idlekeeper: the engine waits through trio's loop only (trio's run state not recognised)")
        return None
    return runner, trio_fd


def open_direct_wait(epochs: EpochClock, max_events: int) -> DirectWait | None:
    """A :class:`DirectWait` in the current trio run, for an engine whose passes take up
    to ``max_events`` events; None where this run cannot be waited on directly (see the
    module)."""
    state = _trio_state()
    if state is None:
        return None
    runner, trio_fd = state
    return DirectWait(runner, trio_fd, epochs, max_events)
