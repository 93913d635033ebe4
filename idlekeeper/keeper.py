"""The keeper: one timing wheel and one reaper task for every connection it watches.

``async with open_keeper() as keeper`` starts the reaper; ``keeper.watch(...)`` puts
a connection under it. The reaper sleeps until the earliest filed deadline (forever
while nothing is filed), wakes, advances the wheel to now, and for each due entry
either files it again (it had activity since it was filed) or expires it: a
synchronous ``CancelScope.cancel()`` and, by default, closing the socket. User
callbacks run by one rule (:mod:`.hooks`): in the trio thread, hooks after the
pass's expiries, so that none can hold up another connection's expiry. A long pass
stops every :data:`REAP_CHUNK` entries to let the rest of the program run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager
from time import perf_counter
from typing import Any

import trio

from . import _loop_epochs
from ._constructors import NoPublicConstructor
from .alarm import Alarm
from .deadlines import Reason
from .hooks import CallbackRunner
from .lookahead import LookaheadWheel
from .stall import SocketLike, send_would_progress, unread_bytes
from .stats import KeeperStats
from .timers import TimerHandle, Timers
from .watch import (
    GRACED,
    STALL_CHECK,
    ExpireHook,
    HalfCloseableWatchedStream,
    Watch,
    WatchedStream,
    WatchState,
    find_socket,
)
from .wheel import WheelEntry

__all__ = ["Keeper", "open_keeper"]

logger = logging.getLogger("idlekeeper")

DEFAULT_TICK = 0.1
_WATCHING = WatchState.WATCHING

REAP_CHUNK = 1024
"""The most entries a reaper pass handles between two checkpoints."""
REAP_BUDGET = 0.004
"""The longest (seconds) a reaper pass works between two checkpoints (checked every
64 entries). A mass disconnect hands the reaper every connection at once: the rest of
the program now runs every few ms, not after the whole pass (2 s for 200,000 expiries
here); later chunks expire later by that time, as the lag histogram shows."""
_REAP_GROUP = 64


class Keeper(metaclass=NoPublicConstructor):
    """Deadlines for many connections, kept by one reaper task.

    Made by :func:`open_keeper` only (``Keeper(...)`` raises ``TypeError``): it owns
    a task and a run-wide instrument that only the ``async with`` block cleans up.
    All methods are synchronous and O(1).
    """

    _OPENER = "idlekeeper.open_keeper()"

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
        self.stats = KeeperStats(self._wheel.__len__)
        """Live counters; see :class:`~idlekeeper.stats.KeeperStats`."""
        self._callbacks = CallbackRunner(nursery, self.stats, timeout=hook_timeout, threads=hook_threads)
        self._alarm = Alarm(lookahead / 2)
        self._timers = Timers(
            trio.current_time, wheel=self._wheel, on_error=self._timer_error, on_schedule=self._alarm.poke
        )
        self._epochs = _loop_epochs.acquire()
        self._stall_check = stall_check
        self._closed = False
        # Watches the wheel does not hold because none of their deadlines is set: the
        # keeper's close must still find them. Rare, so a set costs nothing per watch.
        self._unfiled: set[Watch] = set()
        # The entries of the pass under way not handled yet: a pass that stops at a
        # checkpoint holds entries no longer in the wheel.
        self._pass: list[WheelEntry] = []
        self._pass_at = 0

    # -- public ----------------------------------------------------------------

    @property
    def tick(self) -> float:
        """The lateness budget: no expiry runs more than one tick after its deadline
        (the wheel's slots are half a tick)."""
        return self._tick

    def late_with_unread(self, sock: SocketLike, when: float, now: float | None = None) -> bool:
        """Whether a deadline ``when`` on ``sock``'s connection, passing now, deserves one
        tick more: it was reached more than a tick late, so this process stalled (a long
        pass, a collection, SIGSTOP), and the peer's bytes wait unread, so they may have
        come before ``when`` and only we failed to read them.

        An absolute deadline is not moved by activity, or a trickle would extend it
        forever; but a stall of ours must not cost a peer whose bytes came in time. The
        keeper asks this once per :attr:`Watch.deadline <idlekeeper.Watch.deadline>`
        and, if so, looks again a tick later, after the connection's reader has run.
        A timer that stands for a deadline of the same kind (a request head's, say)
        asks it too, and calls itself again with :meth:`call_later` (``tick``) if so.
        Each True is counted in :attr:`~idlekeeper.KeeperStats.stall_graces`.
        """
        if now is None:
            now = trio.current_time()
        if now - when <= self._tick or unread_bytes(sock) <= 0:
            return False
        self.stats.stall_graces += 1
        return True

    @property
    def lookahead(self) -> float:
        """How far ahead the reaper visits entries when it wakes (see :func:`open_keeper`)."""
        return self._wheel.lookahead

    @property
    def closed(self) -> bool:
        """Whether the keeper's block has exited (it then refuses new watches and timers)."""
        return self._closed

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
        and closed on expiry when ``close`` is true. ``on_expire(watch)`` is called
        after an expiry, in the trio thread, once the reaper pass's expiries are
        done; an async one runs as a task (see :func:`open_keeper` for the rule,
        and :class:`~idlekeeper.in_thread` for a hook that must block). Once the
        keeper's block has exited it raises ``trio.ClosedResourceError``, as a closed
        trio resource does.
        """
        self._check_open()
        if socket is None:
            socket = find_socket(stream)
        check = self._stall_check if stall_check is None else stall_check
        watch: Watch
        if stream is None:
            watch = Watch(self, socket, close=close, stall_check=check, on_expire=on_expire)
        else:
            kind = HalfCloseableWatchedStream if isinstance(stream, trio.abc.HalfCloseableStream) else WatchedStream
            watch = kind(self, stream, socket, close=close, stall_check=check, on_expire=on_expire)
        watch._first_deadlines(idle, receive, send, deadline, max_age, trio.current_time())
        return watch

    def call_at(self, when: float, callback: Callable[..., object], *args: Any, slack: float = 0.0) -> TimerHandle:
        """Run ``callback(*args)`` once, no earlier than trio time ``when``.

        By the rule of :func:`open_keeper`: a plain callback is called by the reaper
        (keep it quick: it is the reaper's time), an async one is started as a task;
        one that raises is logged and counted, never passed on. ``slack`` (seconds)
        lets it run up to that much later, with whatever else the reaper wakes for in
        that time (re-filing visits come about once a ``lookahead``), instead of
        waking the process for it alone: for chores whose exact time does not matter.
        """
        self._check_open()
        return self._timers.call_at(when, self._callbacks.adapt(callback), *args, slack=slack)

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
        self._check_open()
        return self._timers.call_every(interval, self._callbacks.adapt(callback), *args, first=first, slack=slack)

    def shared_wakeup(self, latest: float, earliest: float) -> AbstractContextManager[trio.CancelScope]:
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
        return self._alarm.shared_wakeup(latest, earliest)

    @property
    def hooks_pending(self) -> int:
        """Callbacks queued or running: ``on_expire`` hooks, and timer callbacks that
        run as tasks."""
        return self._callbacks.pending

    async def wait_hooks(self) -> None:
        """Wait until every callback counted by :attr:`hooks_pending` has finished.

        For tests and graceful shutdown (so that "offline" notifications are out
        before the block exits, which would cancel the async ones still running).
        """
        await self._callbacks.wait()

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this keeper is closed")

    # -- called by Watch -------------------------------------------------------

    def _enter(self, watch: Watch) -> None:
        self._check_open()
        self.stats.watched += 1
        self._changed(watch)

    def _exit(self, watch: Watch) -> None:
        self.stats.watched -= 1
        self._wheel.cancel(watch)
        if self._unfiled:
            self._unfiled.discard(watch)

    def _timeout_set(self, watch: Watch, seconds: float) -> None:
        """A timeout of ``seconds`` counting from now was set on ``watch``."""
        # It ends no sooner than the last seal plus ``seconds`` (the seal is no later
        # than now), and the watch's filing already covered every other deadline: filed
        # no later than that, the filing stands, with no clock read and no resolution.
        # An HTTP connection sets one twice a request.
        due = self._wheel.due(watch)
        if due is not None and due <= self._epochs.sealed + seconds:
            return
        self._changed(watch)

    def _changed(self, watch: Watch) -> None:
        if watch._state is not _WATCHING or watch._expiry is not None or self._closed:
            return
        when = watch.check_time(trio.current_time())
        wheel = self._wheel
        if when == math.inf:
            # Loosened to no deadline at all: an entry already filed stays, and the
            # reaper drops it when it comes due (one visit, versus a wheel removal now
            # and an insertion when the next deadline is set, as a server does twice
            # per request).
            if not watch.filed:
                self._unfiled.add(watch)
            return
        due = wheel.due(watch)
        if due is not None and due <= when:
            return  # filed early enough already; the reaper will re-file it lazily
        if self._unfiled:
            self._unfiled.discard(watch)
        self._alarm.poke(wheel.schedule(watch, when))

    # -- the reaper --------------------------------------------------------------

    async def _reap(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        wheel = self._wheel
        stats = self.stats
        task_status.started()
        while True:
            await self._alarm.sleep_until(wheel.next_deadline())
            stats.wakeups += 1
            now = trio.current_time()
            entries = self._pass = wheel.advance(now)
            done, end = 0, len(entries)
            while True:
                started = perf_counter()
                limit, most = started + REAP_BUDGET, min(done + REAP_CHUNK, end)
                while done < most:
                    group = min(done + _REAP_GROUP, most)
                    for i in range(done, group):
                        self._handle(entries[i], now)
                    done = group
                    if perf_counter() >= limit:
                        break
                self._pass_at = done
                stats.busy_seconds += perf_counter() - started
                if done == end:
                    break
                stats.pass_yields += 1
                await trio.lowlevel.checkpoint()
                # Later than the pass's start: what is handed out was due by then
                # already, and a later time only measures its lag truly.
                now = trio.current_time()
            self._pass = []
            self._pass_at = 0
            stats.timers_fired = self._timers.fired

    def _handle(self, entry: WheelEntry, now: float) -> None:
        try:
            if isinstance(entry, Watch):
                self._due(entry, now)
            elif isinstance(entry, TimerHandle):
                self._timers.fire(entry, now)
        except Exception:  # pragma: no cover - a bug, but never the reaper's death
            logger.exception("idlekeeper: error handling %r", entry)

    def _due(self, watch: Watch, now: float) -> None:
        if watch._state is not _WATCHING or watch._expiry is not None:
            return
        when, reason = watch.resolve(now)
        if reason is None or when > now:
            self._refile(watch, now, when)
            return
        sock = watch._socket
        if sock is not None and watch._flags & STALL_CHECK:
            if reason is Reason.ABSOLUTE:
                if not watch._flags & GRACED and self.late_with_unread(sock, when, now):
                    watch._flags |= GRACED
                    self._refile(watch, now, now + self._tick)
                    return
            elif self._peer_kept_up(watch, sock, reason):
                self.stats.stall_saves += 1
                self._refile(watch, now)
                return
        watch._expire(reason, now - when)
        self.stats.expired[reason] += 1
        self.stats.lag.observe(now - when)
        if watch.on_expire is not None:
            self._callbacks.hook(watch.on_expire, watch)

    def _peer_kept_up(self, watch: Watch, sock: SocketLike, reason: Reason) -> bool:
        """Whether the kernel shows the peer active though our stamps are old.

        If so, stamp the activity now: it happened no later than now.
        """
        if reason is not Reason.SEND and unread_bytes(sock) > 0:
            watch._rx = self._epochs.current
            return True
        if watch._sending and reason is not Reason.RECEIVE and send_would_progress(sock):
            watch._tx = self._epochs.current
            return True
        return False

    def _refile(self, watch: Watch, now: float, resolved: float | None = None) -> None:
        when = watch.check_time(now, resolved)
        if when == math.inf:
            self._unfiled.add(watch)
            return
        if self._unfiled:
            self._unfiled.discard(watch)
        self.stats.refiles += 1
        self._wheel.schedule(watch, when)

    def _timer_error(self, handle: TimerHandle, exc: BaseException) -> None:
        self._callbacks.failed(handle.callback, exc)

    # -- closing -------------------------------------------------------------------

    def _close(self) -> None:
        """End everything the keeper still holds, synchronously (see :func:`open_keeper`)."""
        self._closed = True
        entries = [*self._wheel.clear(), *self._pass[self._pass_at :], *self._unfiled]
        self._pass, self._unfiled = [], set()
        ended = 0
        for entry in entries:
            if isinstance(entry, TimerHandle):
                entry.cancel()
            elif isinstance(entry, Watch) and entry._end_by_close():
                ended += 1
        self.stats.watched -= ended
        self.stats.closed_watches += ended
        if ended:
            logger.info("idlekeeper: keeper closed with %d connections watched; they are cancelled", ended)
        self._callbacks.close()


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
    inactivity expiry.

    Callbacks (``on_expire`` hooks and ``call_at`` / ``call_every`` callbacks) run
    by one rule: in the trio thread, a plain function called, an async one started
    as a task and cut off after ``hook_timeout`` seconds; one that raises or overruns
    is logged to the ``idlekeeper`` logger and counted in ``stats.hook_errors``. A
    hook is called once the expiries of its reaper pass are all done. Only a
    callback wrapped in :class:`~idlekeeper.in_thread` runs in a worker thread, up to
    ``hook_threads`` at once.

    ``lookahead`` (seconds; default the larger of 1 s and ``tick``) batches the
    reaper's work: when it wakes, it also visits what is filed up to ``lookahead``
    ahead. Most of what it visits is alive and only filed again further on (activity
    does not move an entry), and a visit costs far less than the wake-up it would
    otherwise need; an entry whose deadline is within the batch is filed back at it,
    exact to the tick. So the reaper wakes for re-filing about once a ``lookahead``
    rather than at every tick, and for real expiries on time. 0 visits each entry at
    its own tick.

    Leaving the block closes the keeper, synchronously and in this order: every
    connection still watched is *cancelled*, as :meth:`Watch.cancel` does (its cancel
    scope cancelled, its socket closed unless ``close=False``), without ``on_expire``
    since nothing expired, and its :attr:`~Watch.state` becomes ``DONE``; pending
    timers are cancelled; plain hooks still queued are called; async callbacks still
    running are cancelled, and logged and counted in ``stats.hooks_cancelled``
    (``await keeper.wait_hooks()`` first to let them finish). Then ``watch``,
    ``call_at`` and the like raise ``trio.ClosedResourceError``.

    The keeper stamps activity with the loop pass it happened in (a shared
    :mod:`epoch <idlekeeper.epochs>`, so that a receive costs one attribute store).
    For that, the first keeper of a ``trio.run`` installs a ``trio.abc.Instrument``
    for the whole run, whose ``before_io_wait`` reads the clock once per loop pass;
    the last keeper to close removes it.
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
        keeper = Keeper._create(
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
            try:
                keeper._close()
            finally:
                _loop_epochs.release()
                nursery.cancel_scope.cancel()
