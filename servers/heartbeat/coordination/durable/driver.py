"""The durable store on a trio worker: commits in a thread, PUBACKs that wait for them.

:class:`Committer` is the lone worker's: its task collects what changed on trio's
thread, writes it on a worker thread (so a slow disk never holds up keep-alive), and
wakes the PUBACKs its commit covered; whatever changed meanwhile is the next group.
The supervisor's authority commits on its own thread instead (it serves no socket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import trio

from ....prometheus import Families, Metric
from ...broker.persistent import SessionStore
from ...presence.event import PresenceEvent, PresenceLog, PresenceSink
from ...presence.overview import RecentEnds
from ..registry import Registry
from ..retention import Retention
from .keeper import Batch, Durability

__all__ = ["RETRY_AFTER", "Committer", "durability_figures", "restored"]

logger = logging.getLogger("servers.heartbeat.durable")

RETRY_AFTER = 1.0
"""Seconds between tries while commits fail (a full disk)."""


def restored(
    durability: Durability,
    registry: Registry,
    retention: Retention,
    store: SessionStore,
    recent: RecentEnds,
    sinks: Iterable[PresenceSink],
) -> list[PresenceEvent]:
    """Restore the state from ``durability``'s file (logged in one line), the operator's
    page's recent ends too; returns the offline events of the devices that were online
    when the server stopped or died, for the coordinator to publish. The presence log
    among ``sinks``, if any, is what the store reads after a crash (:mod:`.telling`)."""
    durability.telling.log = next((s for s in sinks if isinstance(s, PresenceLog)), None)
    found = durability.restore(registry, retention, store)
    durability.commit()  # the ends on disk before they are told: a crash now tells none twice
    told = {event.epoch for event in found.ended} | {event.epoch for event in found.untold}
    recent.restore(e for e in registry if e.status == "offline" and e.epoch not in told)
    logger.info(
        "durable store %s: %d device records, %d retained messages, %d persistent sessions with %d messages"
        " restored in %.2f s (%d sessions expired while the server was down); %d devices were online: %s",
        durability.path,
        found.devices,
        found.retained,
        found.sessions,
        found.messages,
        found.seconds,
        found.expired_sessions,
        len(found.ended),
        found.ended[0].reason if found.ended else "none to end",
    )
    if found.untold:
        logger.info(
            "durable store %s: %d events committed and not told before the crash, told now",
            durability.path,
            len(found.untold),
        )
    return found.untold + found.ended


class Committer:
    """Commits ``durability`` on a trio worker (see the module's docstring)."""

    def __init__(self, durability: Durability) -> None:
        self.durability = durability
        self.stopping = False
        """The server was asked to stop: the last commit marks the file stopped."""
        self._done = trio.Event()
        self._rearm()
        self.runner: Callable[[Callable[[Batch], None], Batch], Awaitable[None]] = trio.to_thread.run_sync
        """How a commit's write is run: in a thread (a test may run it in line, where
        trio's MockClock would jump past a thread's real time)."""

    def _rearm(self) -> None:
        self._dirty = trio.Event()
        self.durability.journal.on_dirty = self._dirty.set

    def mark(self) -> int | None:
        """The change count a PUBACK must see committed, or None if it need not wait
        (nothing uncommitted, or the sync mode does not wait)."""
        durability = self.durability
        if durability.sync != "always" or durability.committed >= durability.changes:
            return None
        return durability.changes

    async def committed(self, mark: int) -> bool:
        """Wait until a commit covers change ``mark``; False as soon as a commit fails."""
        durability = self.durability
        while durability.committed < mark:
            if durability.failure is not None:
                return False
            await self._done.wait()
        return True

    async def run(self) -> None:
        """Commit as the sync mode says until cancelled; then commit the rest, and mark
        the file stopped if the server was asked to stop."""
        durability = self.durability
        try:
            while True:
                if durability.sync == "always":
                    await self._dirty.wait()
                else:
                    await trio.sleep(durability.interval if durability.sync == "interval" else durability.autosave)
                if not durability.due():
                    self._rearm()
                    continue
                ok = await self._commit()
                if not ok:
                    await trio.sleep(RETRY_AFTER)
        finally:
            durability.close(clean=self.stopping)

    async def _commit(self) -> bool:
        durability = self.durability
        self._rearm()  # a change from now on wakes the next commit
        batch = durability.collect()
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            await self.runner(durability.write, batch)
        except Exception as exc:  # sqlite3.Error, OSError: a full disk, an I/O error
            error = exc
        durability.done(batch, error, time.perf_counter() - started)
        done, self._done = self._done, trio.Event()
        done.set()
        return error is None


def durability_figures(durability: Durability, store: SessionStore, retention: Retention) -> list[Metric]:
    """Prometheus families of a durable store."""
    f = Families({})
    f.gauge(
        "heartbeat_durable_writable", "1 while the durable store's commits succeed.", int(durability.failure is None)
    )
    f.counter("heartbeat_durable_commits_total", "Commits of the durable store (one per group).", durability.commits)
    f.counter(
        "heartbeat_durable_commit_failures_total",
        "Commits that failed (a full disk, an I/O error).",
        durability.failures,
    )
    f.counter("heartbeat_durable_rows_total", "Rows written or deleted by commits.", durability.rows)
    f.counter("heartbeat_durable_commit_seconds_total", "Seconds spent writing commits.", durability.commit_seconds)
    f.counter(
        "heartbeat_durable_refused_total",
        "Retained updates and messages for absent sessions refused: the durable store could not write.",
        retention.unkept + store.unkept,
    )
    return f.families
