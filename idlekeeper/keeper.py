"""The keeper: one timing wheel and one reaper task for every connection it watches.

``async with open_keeper() as keeper`` starts the reaper; ``keeper.watch(...)`` puts
a connection under it. The reaper sleeps until the earliest filed deadline (forever
while nothing is filed), wakes, advances the wheel to now, and for each due entry
either files it again (it had activity since it was filed) or expires it: a
synchronous ``CancelScope.cancel()`` and, by default, closing the socket. User
hooks run elsewhere (tasks, worker threads: :mod:`.hooks`), so they cannot hold the
reaper up.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from time import perf_counter
from typing import Any, cast

import trio

from . import _loop_epochs
from .deadlines import Reason
from .epochs import EpochClock
from .hooks import HookRunner, is_async
from .lookahead import LookaheadWheel
from .stall import SocketLike, send_would_progress, unread_bytes
from .stats import KeeperStats
from .timers import TimerHandle, Timers
from .watch import STALL_CHECK, ExpireHook, HalfCloseableWatchedStream, Watch, WatchedStream, WatchState, find_socket
from .wheel import WheelEntry

__all__ = ["Keeper", "open_keeper"]

logger = logging.getLogger("idlekeeper")

DEFAULT_TICK = 0.1
_WATCHING = WatchState.WATCHING


class Keeper:
    """Deadlines for many connections, kept by one reaper task.

    Create it with :func:`open_keeper`. All methods are synchronous and O(1).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        tick: float,
        stall_check: bool,
        hook_timeout: float | None,
        hook_threads: int,
        lookahead: float = 0.0,
    ) -> None:
        self._nursery = nursery
        self._tick = tick
        # The wheel rounds deadlines up to its slots, so its resolution is half the
        # promised lateness: rounding takes at most half a tick, and the other half is
        # left for the reaper's wake-up and the loop pass that stamped the activity.
        self._wheel: LookaheadWheel[WheelEntry] = LookaheadWheel(tick / 2, trio.current_time(), lookahead)
        self._timers = Timers(trio.current_time, wheel=self._wheel, on_error=self._timer_error, on_schedule=self._poke)
        self._epochs = _loop_epochs.acquire()
        self._stall_check = stall_check
        self._sleep_scope: trio.CancelScope | None = None
        self._window: tuple[trio.CancelScope, float] | None = None
        """Another task's wait to share wake-ups with (see :meth:`shared_wakeup`)."""
        self._closed = False
        self.stats = KeeperStats(self._wheel.__len__)
        """Live counters; see :class:`~idlekeeper.stats.KeeperStats`."""
        self._hooks = HookRunner(nursery, self.stats, timeout=hook_timeout, threads=hook_threads)

    # -- public ----------------------------------------------------------------

    @property
    def tick(self) -> float:
        """The lateness budget: no expiry runs more than one tick after its deadline
        (the wheel's slots are half a tick)."""
        return self._tick

    @property
    def lookahead(self) -> float:
        """How far ahead the reaper visits entries when it wakes (see :func:`open_keeper`)."""
        return self._wheel.lookahead

    @property
    def epochs(self) -> EpochClock:
        """The run's activity clock (for code that records activity by hand)."""
        return self._epochs

    def watch(
        self,
        stream: trio.abc.Stream | None = None,
        *,
        idle: float | None = None,
        receive: float | None = None,
        send: float | None = None,
        deadline: float | None = None,
        max_age: float | None = None,
        socket: SocketLike | None = None,
        close: bool = True,
        stall_check: bool | None = None,
        on_expire: ExpireHook | None = None,
    ) -> Watch:
        """Put a connection under watch; use the result as a ``with`` block.

        With a ``stream``, the result is a :class:`WatchedStream`: read and write it
        instead of ``stream``, and its activity is recorded. ``idle``, ``receive``
        and ``send`` are timeouts in seconds; ``deadline`` is an absolute trio time
        and ``max_age`` the same relative to now (the earlier one wins).
        ``socket`` defaults to the socket under ``stream``; it is used to check for
        unread bytes before an inactivity expiry (unless ``stall_check`` is false),
        and closed on expiry when ``close`` is true. ``on_expire(watch)`` runs after
        an expiry, as a task if async, in a worker thread if not. Once the keeper's
        block has exited it raises ``trio.ClosedResourceError``, as a closed trio
        resource does.
        """
        if self._closed:
            raise trio.ClosedResourceError("this keeper is closed")
        if socket is None:
            socket = find_socket(stream)
        check = self._stall_check if stall_check is None else stall_check
        watch: Watch
        if stream is None:
            watch = Watch(self, socket, close=close, stall_check=check, on_expire=on_expire)
        else:
            kind = HalfCloseableWatchedStream if isinstance(stream, trio.abc.HalfCloseableStream) else WatchedStream
            watch = kind(self, stream, socket, close=close, stall_check=check, on_expire=on_expire)
        self._configure(watch, idle, receive, send, deadline, max_age)
        return watch

    def _configure(
        self,
        watch: Watch,
        idle: float | None,
        receive: float | None,
        send: float | None,
        deadline: float | None,
        max_age: float | None,
    ) -> None:
        """Set a new watch's first deadlines (before it is started, so nothing is filed yet)."""
        now = trio.current_time()
        if idle is not None:
            watch.set_idle_timeout(idle, now)
        if receive is not None:
            watch.set_receive_timeout(receive, now)
        if send is not None:
            watch.set_send_timeout(send, now)
        when = math.inf if deadline is None else deadline
        if max_age is not None:
            when = min(when, now + max_age)
        watch.set_deadline(when)

    def call_at(self, when: float, callback: Callable[..., object], *args: Any, slack: float = 0.0) -> TimerHandle:
        """Run ``callback(*args)`` from the reaper once, no earlier than trio time ``when``.

        A plain callback runs inline in the reaper and must be quick; an async one
        is started as a task. ``slack`` (seconds) lets it run up to that much later,
        with whatever else the reaper wakes for in that time (re-filing visits come
        about once a ``lookahead``), instead of waking the process for it alone: for
        chores whose exact time does not matter.
        """
        return self._timers.call_at(when, self._adapt(callback), *args, slack=slack)

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any, slack: float = 0.0) -> TimerHandle:
        """Like :meth:`call_at`, ``delay`` seconds from now."""
        return self.call_at(trio.current_time() + delay, callback, *args, slack=slack)

    def call_every(
        self,
        interval: float,
        callback: Callable[..., object],
        *args: Any,
        first: float | None = None,
        slack: float = 0.0,
    ) -> TimerHandle:
        """Run ``callback(*args)`` every ``interval`` seconds until the handle is
        cancelled (each call up to ``slack`` late, as for :meth:`call_at`)."""
        return self._timers.call_every(interval, self._adapt(callback), *args, first=first, slack=slack)

    @contextmanager
    def shared_wakeup(self, latest: float, earliest: float) -> Iterator[trio.CancelScope]:
        """A cancel scope for a wait that must end by ``latest`` and may end as early as
        ``earliest``, kept in step with the reaper so that trio wakes the process once
        for both.

        For as long as the block runs, whenever the reaper's alarm is set (when it goes
        to sleep, or is brought forward) the two are aligned: an alarm that falls in
        ``[earliest, latest)`` ends the wait with it, and one that falls a little after
        the wait's end (within half a ``lookahead``) is brought forward to that end. A
        visit that comes early only files live connections again, and a real deadline
        found in it is filed back exactly, so nothing expires early and nothing is
        missed. Done whenever either is set, not only when the wait begins: the reaper
        sets its alarm after each visit, and in the same instant as the wait's owner
        may or may not have begun its next wait. For waits that may end early, such as
        the dense engine's coalescing window; one such wait at a time (a new one takes
        the place of the last). On a box shared by 60 processes, every wake-up starts
        with cold caches.
        """
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
        window, sleep = self._window, self._sleep_scope
        if window is None or sleep is None:
            return
        scope, earliest = window
        alarm, latest = sleep.deadline, scope.deadline
        if latest <= trio.current_time():
            return  # over, though its owner has not run yet to leave the block
        if earliest <= alarm < latest:
            scope.deadline = alarm
        elif latest < alarm <= latest + self._wheel.lookahead / 2:
            sleep.deadline = latest

    @property
    def hooks_pending(self) -> int:
        """``on_expire`` hooks queued or running."""
        return self._hooks.pending

    async def wait_hooks(self) -> None:
        """Wait until every ``on_expire`` hook queued so far has finished.

        For tests and graceful shutdown (so that "offline" notifications are out
        before the process exits). A sync hook blocked forever blocks this too.
        """
        await self._hooks.wait()

    # -- called by Watch -------------------------------------------------------

    def _enter(self, watch: Watch) -> None:
        self.stats.watched += 1
        self._changed(watch)

    def _exit(self, watch: Watch) -> None:
        self.stats.watched -= 1
        self._wheel.cancel(watch)

    def _changed(self, watch: Watch) -> None:
        if watch._state is not _WATCHING or watch.reason is not None or self._closed:
            return
        when = watch.check_time(trio.current_time())
        wheel = self._wheel
        if when == math.inf:
            # Loosened to no deadline at all: an entry already filed stays, and the
            # reaper drops it when it comes due (one visit, versus a wheel removal now
            # and an insertion when the next deadline is set, as a server does twice
            # per request).
            return
        due = wheel.due(watch)
        if due is not None and due <= when:
            return  # filed early enough already; the reaper will re-file it lazily
        self._poke(wheel.schedule(watch, when))

    # -- the reaper --------------------------------------------------------------

    def _poke(self, due: float) -> None:
        """Wake the reaper sooner if ``due`` is before its alarm."""
        scope = self._sleep_scope
        if scope is not None and due < scope.deadline:
            scope.deadline = due
            self._align()

    async def _reap(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        wheel = self._wheel
        stats = self.stats
        task_status.started()
        while True:
            alarm = wheel.next_deadline()
            with trio.CancelScope(deadline=math.inf if alarm is None else alarm) as scope:
                self._sleep_scope = scope
                self._align()
                await trio.sleep_forever()
            self._sleep_scope = None
            stats.wakeups += 1
            started = perf_counter()
            now = trio.current_time()
            for entry in wheel.advance(now):
                try:
                    if isinstance(entry, Watch):
                        self._due(entry, now)
                    elif isinstance(entry, TimerHandle):
                        self._timers.fire(entry, now)
                except Exception:  # pragma: no cover - a bug, but never the reaper's death
                    logger.exception("idlekeeper: error handling %r", entry)
            stats.timers_fired = self._timers.fired
            stats.busy_seconds += perf_counter() - started

    def _due(self, watch: Watch, now: float) -> None:
        if watch._state is not _WATCHING or watch.reason is not None:
            return
        when, reason = watch.resolve(now)
        if reason is None or when > now:
            self._refile(watch, now, when)
            return
        sock = watch._socket
        if sock is not None and watch._flags & STALL_CHECK and self._peer_kept_up(watch, sock, reason):
            self.stats.stall_saves += 1
            self._refile(watch, now)
            return
        watch._expire(reason, now - when)
        self.stats.expired[reason] += 1
        self.stats.lag.observe(now - when)
        if watch.on_expire is not None:
            self._hooks.run(watch.on_expire, watch)

    def _peer_kept_up(self, watch: Watch, sock: SocketLike, reason: Reason) -> bool:
        """Whether the kernel shows the peer active though our stamps are old.

        If so, stamp the activity now: it happened no later than now.
        """
        if reason is Reason.ABSOLUTE:
            return False
        if reason is not Reason.SEND and unread_bytes(sock) > 0:
            watch.rx = self._epochs.current
            return True
        if watch.sending and reason is not Reason.RECEIVE and send_would_progress(sock):
            watch.tx = self._epochs.current
            return True
        return False

    def _refile(self, watch: Watch, now: float, resolved: float | None = None) -> None:
        when = watch.check_time(now, resolved)
        if when != math.inf:
            self.stats.refiles += 1
            self._wheel.schedule(watch, when)

    # -- timer callbacks, kept off the reaper ----------------------------------

    def _adapt(self, callback: Callable[..., object]) -> Callable[..., object]:
        if not is_async(callback):
            return callback
        nursery = self._nursery
        task = cast(Callable[..., Awaitable[object]], callback)

        def start(*args: Any) -> None:
            nursery.start_soon(task, *args)

        return start

    def _timer_error(self, handle: TimerHandle, exc: BaseException) -> None:
        self.stats.hook_errors += 1
        logger.error("idlekeeper: timer callback %r raised", handle.callback, exc_info=exc)


@asynccontextmanager
async def open_keeper(
    *,
    tick: float = DEFAULT_TICK,
    stall_check: bool = True,
    hook_timeout: float | None = 30.0,
    hook_threads: int = 4,
    lookahead: float | None = None,
) -> AsyncIterator[Keeper]:
    """Start a keeper and its reaper task; stop them when the block exits.

    ``tick`` (seconds) is the lateness budget: an expiry runs after its deadline
    and less than one tick later, while the process is not starved of CPU. The
    wheel's slots are half a tick wide, which leaves half a tick for wake-up
    latency; the reaper wakes at most twice per tick, and only for due slots.
    ``stall_check`` looks for unread bytes (and a drained send buffer) before an
    inactivity expiry. Async ``on_expire`` hooks are cut off after
    ``hook_timeout``; plain ones run in up to ``hook_threads`` worker threads.

    ``lookahead`` (seconds; default the larger of 1 s and ``tick``) batches the
    reaper's work: when it wakes, it also visits what is filed up to ``lookahead``
    ahead. Most of what it visits is alive and only filed again further on (activity
    does not move an entry), and a visit costs far less than the wake-up it would
    otherwise need; an entry whose deadline is within the batch is filed back at it,
    exact to the tick. So the reaper wakes for re-filing about once a ``lookahead``
    rather than at every tick, and for real expiries on time. 0 visits each entry at
    its own tick.
    """
    # Checked before the nursery opens, as trio checks its own arguments: inside it a
    # ValueError would come out wrapped in an ExceptionGroup that `except ValueError` misses.
    if not (isinstance(tick, (int, float)) and math.isfinite(tick) and tick > 0):
        raise ValueError(f"tick must be a positive finite number of seconds, not {tick!r}")
    if hook_timeout is not None and not hook_timeout > 0:
        raise ValueError(f"hook_timeout must be None or more than 0 seconds, not {hook_timeout!r}")
    if hook_threads < 1:
        raise ValueError("hook_threads must be at least 1")
    if lookahead is None:
        lookahead = max(1.0, tick)
    if not (math.isfinite(lookahead) and lookahead >= 0):
        raise ValueError(f"lookahead must be 0 or a positive finite number of seconds, not {lookahead!r}")
    async with trio.open_nursery() as nursery:
        keeper = Keeper(
            nursery,
            tick=tick,
            stall_check=stall_check,
            hook_timeout=hook_timeout,
            hook_threads=hook_threads,
            lookahead=lookahead,
        )
        try:
            await nursery.start(keeper._reap)
            yield keeper
        finally:
            keeper._closed = True
            _loop_epochs.release()
            nursery.cancel_scope.cancel()
