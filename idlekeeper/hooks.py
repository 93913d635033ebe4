"""``on_expire`` hooks, run off the reaper so that user code cannot hold it up.

An async hook runs as a task, cut off after ``hook_timeout``; plain hooks queued in
one reaper pass go to one worker thread together. A hook that raises or times out
is logged and counted in ``stats.hook_errors``; it never reaches the reaper.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable

import trio

from .stats import KeeperStats
from .watch import ExpireHook, Watch

__all__ = ["HookRunner", "is_async"]

logger = logging.getLogger("idlekeeper")


def is_async(fn: Callable[..., object]) -> bool:
    """Whether calling ``fn`` gives an awaitable to run as a task (async functions and
    objects with an async ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
    )


class HookRunner:
    """Runs a keeper's ``on_expire`` hooks in its nursery; see the module."""

    def __init__(self, nursery: trio.Nursery, stats: KeeperStats, *, timeout: float | None, threads: int) -> None:
        self._nursery = nursery
        self._stats = stats
        self._timeout = timeout
        self._limiter = trio.CapacityLimiter(threads)
        self._sync: list[tuple[Callable[[Watch], object], Watch]] = []
        self._idle: trio.Event | None = None
        self.pending = 0
        """Hooks queued or running."""

    def run(self, hook: ExpireHook, watch: Watch) -> None:
        """Queue ``hook(watch)``; returns at once."""
        self.pending += 1
        if is_async(hook):
            self._nursery.start_soon(self._async_hook, hook, watch)
            return
        if not self._sync:
            self._nursery.start_soon(self._sync_batch)
        self._sync.append((hook, watch))

    async def wait(self) -> None:
        """Wait until every hook queued so far has finished."""
        while self.pending:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    def _finished(self, count: int) -> None:
        self.pending -= count
        if not self.pending and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def _async_hook(self, hook: ExpireHook, watch: Watch) -> None:
        try:
            with trio.move_on_after(math.inf if self._timeout is None else self._timeout) as scope:
                result = hook(watch)
                if result is not None:
                    await result
            if scope.cancelled_caught:
                self._stats.hook_errors += 1
                logger.warning("idlekeeper: on_expire hook %r timed out after %ss", hook, self._timeout)
        except Exception:
            self._stats.hook_errors += 1
            logger.exception("idlekeeper: on_expire hook %r raised", hook)
        finally:
            self._finished(1)

    async def _sync_batch(self) -> None:
        # Started when the first hook of a reaper pass is queued; tasks start on a
        # later loop pass, so by then the whole reaper pass is queued, and one
        # worker thread handles all of it.
        batch, self._sync = self._sync, []
        try:
            errors = await trio.to_thread.run_sync(_call_all, batch, abandon_on_cancel=True, limiter=self._limiter)
            self._stats.hook_errors += errors
        finally:
            self._finished(len(batch))


def _call_all(batch: list[tuple[Callable[[Watch], object], Watch]]) -> int:
    errors = 0
    for hook, watch in batch:
        try:
            hook(watch)
        except Exception:
            errors += 1
            logger.exception("idlekeeper: on_expire hook %r raised", hook)
    return errors
