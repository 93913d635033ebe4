"""What the operator's page shows of the registry: the devices that went offline lately,
the ends counted by reason, and the rate of presence events.

:class:`RecentEnds` is a presence sink kept wherever presence is decided (a lone
worker's coordinator, the supervisor's authority, every fleet node's stream reader), so
it sees every session's end once, whoever declared it: a keep-alive timeout here, a
worker lost by the supervisor, a node lost by another gateway. Each event costs an
append to a bounded ring and two counter increments; nothing else happens until
someone asks (:meth:`RecentEnds.search`), so a server nobody watches pays no more.

Pure data, no I/O: the coordinators feed it and answer for it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..mqtt.endings import Offline
from .event import OFFLINE, ONLINE, PresenceEvent

__all__ = [
    "INITIATORS",
    "RECENT_KEPT",
    "SEARCH_LIMIT",
    "RecentEnds",
    "end_entry",
    "initiator_of",
    "registry_overview",
]

RECENT_KEPT = 5_000
"""Offline events kept, newest last: at 5,000 devices a minute going offline, the last
minute; the page shows the first hundred and searches all of them."""

SEARCH_LIMIT = 500
"""The most entries one answer carries, whatever is asked (the page is never a list of
all devices)."""

_RATE_WINDOW = 60
"""Seconds of per-second event counts kept for the event rate."""

INITIATORS: dict[Offline, str] = {
    Offline.DISCONNECT: "device",
    Offline.CONNECTION_LOST: "device",
    Offline.KEEPALIVE_TIMEOUT: "server",
    Offline.CONNECT_TIMEOUT: "server",
    Offline.PROTOCOL_ERROR: "server",
    Offline.SEND_TIMEOUT: "server",
    Offline.SEND_OVERFLOW: "server",
    Offline.SHUTDOWN: "server",
    Offline.REFUSED: "server",
    Offline.SUPERSEDED: "server",
    Offline.TAKEOVER: "new-connection",
    Offline.WORKER_LOST: "supervisor",
    Offline.NODE_LOST: "fleet",
    Offline.SERVER_SHUTDOWN: "server",
    Offline.SERVER_LOST: "restart",
}
"""Who ended a session, by its reason: the device (it said goodbye or its TCP ended),
the server (a deadline, a violation, a shutdown), the device's next connection (a
takeover), the supervisor (the worker that held it died), another gateway of the
fleet (the node that held it stopped renewing its lease) or the server's restart
from its durable store (it died while the device was online)."""


def initiator_of(reason: Offline | None) -> str:
    """Who ended a session that ended for ``reason`` (see :data:`INITIATORS`)."""
    return "unknown" if reason is None else INITIATORS.get(reason, "unknown")


def end_entry(event: PresenceEvent) -> dict[str, Any]:
    """One offline event as the page lists it: who, why, who ended it, when last heard."""
    return {
        "client_id": event.client_id,
        "reason": None if event.reason is None else event.reason.value,
        "initiator": initiator_of(event.reason),
        "detail": event.detail,
        "time": round(event.time, 3),
        "last_seen": round(event.time - event.silent_for, 3),
        "silent_for": round(event.silent_for, 3),
        "worker": event.worker,
        "node": event.node,
        "peer": event.peer,
        "epoch": event.epoch,
    }


class RecentEnds:
    """A presence sink: the last :data:`RECENT_KEPT` offline events, the ends counted by
    reason and the sessions started since this process began, and the event rate."""

    __slots__ = ("_clock", "_rate", "ends", "kept", "recent", "sessions", "since")

    def __init__(self, kept: int = RECENT_KEPT, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.kept = kept
        self.recent: collections.deque[PresenceEvent] = collections.deque(maxlen=kept)
        self.ends: collections.Counter[str] = collections.Counter()
        """Sessions ended since :attr:`since`, by reason."""
        self.sessions = 0
        """Sessions started since :attr:`since`."""
        self.since = clock()
        # (second, online events, offline events), the last _RATE_WINDOW seconds that had any.
        self._rate: collections.deque[list[int]] = collections.deque(maxlen=_RATE_WINDOW)

    def __call__(self, event: PresenceEvent) -> None:
        """Take one presence event (refusals and sockets that never identified themselves
        are not presence, and are passed over)."""
        if event.client_id is None:
            return
        if event.status == ONLINE:
            self.sessions += 1
            self._count(1)
        elif event.status == OFFLINE:
            self.recent.append(event)
            self.ends[event.reason.value if event.reason is not None else "unknown"] += 1
            self._count(2)

    def restore(self, ends: Iterable[PresenceEvent]) -> None:
        """Take back the latest of ``ends`` (offline events kept by a durable store, in any
        order) as the recent ones, without counting them as ends of this process's."""
        latest = sorted(ends, key=lambda e: e.time)[-self.kept :] if self.kept else []
        self.recent.extend(latest)

    def _count(self, column: int) -> None:
        second = int(self._clock())
        rate = self._rate
        if not rate or rate[-1][0] != second:
            rate.append([second, 0, 0])
        rate[-1][column] += 1

    def rates(self, window: int = 10) -> tuple[float, float]:
        """Online and offline events a second, over the last ``window`` whole seconds."""
        now = int(self._clock())
        online = offline = 0
        for second, up, down in self._rate:
            if now - window <= second < now:
                online += up
                offline += down
        return online / window, offline / window

    def search(self, query: str = "", limit: int = 100, since: float = 0.0) -> list[dict[str, Any]]:
        """The offline events newest first, of client ids containing ``query`` (any case),
        at ``since`` or later; at most ``limit`` (and :data:`SEARCH_LIMIT`)."""
        limit = max(0, min(limit, SEARCH_LIMIT))
        needle = query.casefold()
        out: list[dict[str, Any]] = []
        for event in reversed(self.recent):
            if len(out) >= limit:
                break
            if event.time < since:
                continue  # a fleet's events arrive nearly, not exactly, in time order
            if needle and needle not in (event.client_id or "").casefold():
                continue
            out.append(end_entry(event))
        return out

    def answer(self, query: str, limit: int) -> dict[str, Any]:
        """The registry-independent half of a coordinator's overview (see
        :meth:`~servers.heartbeat.coordination.Coordinator.overview`)."""
        online_rate, offline_rate = self.rates()
        return {
            "recent": self.search(query, limit),
            "recent_kept": len(self.recent),
            "ends": dict(self.ends),
            "sessions": self.sessions,
            "since": round(self.since, 3),
            "rate": {"online_per_s": online_rate, "offline_per_s": offline_rate},
        }


def registry_overview(
    scope: str, online: int, records: int | None, recent: RecentEnds, query: str, limit: int
) -> dict[str, Any]:
    """A coordinator's overview (:meth:`~servers.heartbeat.coordination.Coordinator.overview`):
    the registry's counts, taken together with ``recent``'s answer at one instant."""
    return {"scope": scope, "as_of": round(time.time(), 3), "online": online, "records": records} | recent.answer(
        query, limit
    )
