"""User callbacks (``on_expire`` hooks and timer callbacks), run by one rule.

Every callback runs in the trio thread. A plain function is called; an async one is
started as a task in the keeper's nursery and cut off after ``hook_timeout``. A
callback wrapped in :class:`in_thread` runs in a worker thread, because its caller
asked. Whatever the kind, a callback that raises or overruns is logged to the
``idlekeeper`` logger and counted in ``stats.hook_errors``; it never reaches the
reaper or the code around the keeper.

``on_expire`` hooks are not called by the reaper itself: they are queued, and a task
started once per reaper pass calls them after the pass's expiries are all done, so
that a slow hook cannot delay the expiry of another connection (guarantee 8). In
the trio thread rather than a worker thread so that a hook may touch trio objects
(``send_nowait`` on a channel, ``Event.set``) and so that a test's ``MockClock``
does not jump while a thread runs. A hook that blocks the thread blocks the whole
program, as any plain code in a trio program does: wrap such a hook in
:class:`in_thread`.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import trio

from .stats import KeeperStats

__all__ = ["CallbackRunner", "in_thread", "is_async"]

logger = logging.getLogger("idlekeeper")

# Plain hooks called between two checkpoints of the hook task: enough to make the
# task's start-up cost nothing per hook, few enough that a burst of expiries' hooks
# lets the reaper and the rest of the program run in between.
_HOOKS_PER_CHECKPOINT = 256


class in_thread:  # lower case: used like a function, as trio.to_thread.run_sync is
    """Wrap a plain callable so that the keeper runs it in a worker thread.

    For an ``on_expire`` hook or a timer callback that blocks (a file write, a
    blocking client library)::

        keeper.watch(stream, idle=30, on_expire=idlekeeper.in_thread(write_audit_log))

    It runs with ``trio.to_thread.run_sync``, at most ``hook_threads`` (an
    :func:`~idlekeeper.open_keeper` option) at once across the keeper. It runs at
    most once per call, and never after the keeper has closed: one not yet started
    when the keeper closes does not start (it is reported, see
    :attr:`~idlekeeper.KeeperStats.hooks_cancelled`), and one running holds the
    keeper's exit until it returns (logged), since a thread cannot be cancelled. For
    the same reason ``hook_timeout`` does not apply to it. In the thread it must not
    touch trio objects except through ``trio.from_thread``.
    """

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., object]) -> None:
        if is_async(function):
            raise TypeError(f"in_thread() takes a plain function, not the async {function!r}")
        self.function = function
        """The wrapped callable."""

    def __call__(self, *args: Any) -> None:
        """Call the function here, in this thread (what the keeper does in a worker thread)."""
        self.function(*args)

    def __repr__(self) -> str:
        return f"in_thread({self.function!r})"


def is_async(fn: Callable[..., object]) -> bool:
    """Whether calling ``fn`` gives an awaitable to run as a task (async functions and
    objects with an async ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
    )


def _as_task(fn: Callable[..., object]) -> bool:
    # Async callables and thread hooks run as tasks of their own; plain ones are called.
    return isinstance(fn, in_thread) or is_async(fn)


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class CallbackRunner:
    """Runs a keeper's callbacks in its nursery, by the module's rule."""

    def __init__(self, nursery: trio.Nursery, stats: KeeperStats, *, timeout: float | None, threads: int) -> None:
        self._nursery = nursery
        self._stats = stats
        self._timeout = math.inf if timeout is None else timeout
        self._limiter = trio.CapacityLimiter(threads)
        # The threads themselves are limited by self._limiter, taken before each starts.
        self._unlimited = trio.CapacityLimiter(math.inf)
        self._in_thread: set[int] = set()
        """Serials of the tasks whose thread has started (a close waits for those)."""
        self._queued: deque[tuple[Callable[..., object], tuple[Any, ...]]] = deque()
        self._caller_started = False
        self._tasks: dict[int, Callable[..., object]] = {}
        """Callbacks started as tasks and not finished, by serial number."""
        self._serial = 0
        self._idle: trio.Event | None = None
        self._closed = False
        self.pending = 0
        """Callbacks queued or running (hooks, and timer callbacks that run as tasks)."""

    # -- entry points ------------------------------------------------------------

    def hook(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue an ``on_expire`` hook; returns at once (see the module for when it runs)."""
        if _as_task(fn):
            self._start(fn, args)
            return
        self.pending += 1
        self._queued.append((fn, args))
        if not self._caller_started:
            # Tasks start on a later loop pass, so by then the whole reaper pass is
            # queued and one task calls all of it.
            self._caller_started = True
            self._nursery.start_soon(self._call_queued)

    def adapt(self, fn: Callable[..., object]) -> Callable[..., object]:
        """A timer callback as the reaper calls it: a plain one as it is (errors are
        reported by the timers, through :meth:`failed`), another one as a starter of
        its task."""
        if not _as_task(fn):
            return fn

        def start(*args: Any) -> None:
            self._start(fn, args)

        return start

    def failed(self, fn: object, exc: BaseException) -> None:
        """Report a callback that raised: the one place every kind is reported."""
        self._stats.hook_errors += 1
        logger.error("idlekeeper: callback %s raised", _name(fn), exc_info=exc)

    async def wait(self) -> None:
        """Wait until every callback queued so far has finished."""
        while self.pending:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    def close(self) -> None:
        """The keeper is closing: call the plain hooks still queued, now, and report
        the callbacks whose tasks are about to be cancelled with the keeper's nursery."""
        self._closed = True
        while self._queued:
            self._call(*self._queued.popleft())
            self._finished(1)
        running = [fn for serial, fn in self._tasks.items() if serial in self._in_thread]
        cancelled = [fn for serial, fn in self._tasks.items() if serial not in self._in_thread]
        if running:
            names = ", ".join(sorted({_name(fn) for fn in running})[:10])
            logger.warning("idlekeeper: keeper closing; waiting for %d callbacks in threads: %s", len(running), names)
        if cancelled:
            self._stats.hooks_cancelled += len(cancelled)
            names = ", ".join(sorted({_name(fn) for fn in cancelled})[:10])
            logger.warning(
                "idlekeeper: keeper closed with %d callbacks unfinished, cancelled: %s", len(cancelled), names
            )

    # -- running -------------------------------------------------------------------

    def _call(self, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self.failed(fn, exc)

    async def _call_queued(self) -> None:
        queued = self._queued
        try:
            done = 0
            while queued:
                self._call(*queued.popleft())
                self._finished(1)
                done += 1
                if done % _HOOKS_PER_CHECKPOINT == 0:
                    await trio.lowlevel.checkpoint()
        finally:
            self._caller_started = False

    def _start(self, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.pending += 1
        self._serial += 1
        self._tasks[self._serial] = fn
        self._nursery.start_soon(self._task, self._serial, fn, args)

    async def _task(self, serial: int, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        try:
            if isinstance(fn, in_thread):
                async with self._limiter:
                    if self._closed:
                        return
                    # No checkpoint from here until the thread runs: a close finds this
                    # serial exactly when the thread has started, and waits for it.
                    self._in_thread.add(serial)
                    await trio.to_thread.run_sync(fn.function, *args, limiter=self._unlimited)
                return
            with trio.move_on_after(self._timeout) as scope:
                await cast(Callable[..., Awaitable[object]], fn)(*args)
            if scope.cancelled_caught:
                self._stats.hook_errors += 1
                logger.warning("idlekeeper: callback %s overran hook_timeout (%ss)", _name(fn), self._timeout)
        except Exception as exc:
            self.failed(fn, exc)
        finally:
            del self._tasks[serial]
            self._in_thread.discard(serial)
            self._finished(1)

    def _finished(self, count: int) -> None:
        self.pending -= count
        if not self.pending and self._idle is not None:
            self._idle.set()
            self._idle = None
