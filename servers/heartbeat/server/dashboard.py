"""The heartbeat server's side of the operator's page (:mod:`servers.page`): what one
snapshot says, and where each part comes from.

- The registry's part (devices online, the latest ends with their reasons, ends by
  reason, the event rate) from the coordinator, whichever process keeps the registry:
  this worker alone, the supervisor's authority for the whole box, or Redis and this
  node's reader for a fleet (:meth:`.Coordinator.overview`).
- Each worker's part (connections, devices, packets a second, memory, CPU, the keeper's
  reaper lag, and detection lateness: how far past its deadline each keep-alive timeout
  was declared) from the worker itself, and from the box's other workers through their
  status ports (``/presence/worker.json``), so any worker's page shows the whole box.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence, Sized
from typing import Any, Protocol

import trio

from idlekeeper import Keeper, LagHistogram

from ...page import Page
from ...prometheus import memory_bytes
from ...status import fetch_json
from ..coordination import Coordinator
from ..presence.overview import SEARCH_LIMIT

__all__ = ["LATENESS_STEPS", "Dashboard", "merge_lateness", "merge_listeners"]

LATENESS_STEPS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 5.0, 10.0, 50.0)
"""The lateness histogram's bucket bounds, in ticks: the promise (at most one tick late)
is a bucket's edge, and all above it is broken promise, from a stalled process."""

SIBLING_TIMEOUT = 1.0
"""Seconds a snapshot waits for another worker's figures (a stalled worker is shown
as not answering, not waited for)."""

_RATE_MIN_WINDOW = 1.0
"""Seconds a rate is measured over at least: several pages asking at once share it."""


class _Identity(Protocol):
    @property
    def worker(self) -> int: ...

    @property
    def node(self) -> str: ...


class _Door(Protocol):
    name: str
    online: int
    accepted: int
    refused: int


class Worker(Protocol):
    """What the page reads of its worker (the :class:`~.lifecycle.HeartbeatServer`): a
    protocol, so that this module needs nothing above it."""

    @property
    def keeper(self) -> Keeper: ...

    @property
    def config(self) -> _Identity: ...

    @property
    def connections(self) -> Sized: ...

    @property
    def online(self) -> Sized: ...

    @property
    def offline_by_reason(self) -> Mapping[str, int]: ...

    @property
    def coordinator(self) -> Coordinator: ...

    @property
    def doors(self) -> Sequence[_Door]: ...

    def packets_in(self) -> int:
        """Control packets read so far."""
        ...


class Dashboard:
    """One worker's figures and the snapshots of its page (a :class:`servers.page.PageSource`).

    ``siblings``: the status ports of the box's other workers (on ``host``), asked for
    their own figures with the asking request's credentials.
    """

    def __init__(self, server: Worker, *, siblings: Sequence[int] = (), host: str = "127.0.0.1") -> None:
        self.server = server
        self.siblings = list(siblings)
        self.host = host
        self.page: Page | None = None
        """The page serving these figures, whose own cost they include."""
        tick = server.keeper.tick
        self.lateness = LagHistogram(tuple(round(step * tick, 9) for step in LATENESS_STEPS))
        """How far past its deadline (last packet + 1.5 x keep-alive) each keep-alive
        timeout was declared, in seconds."""
        self._started = time.time()
        self._sample = (time.monotonic(), _cpu_seconds(), 0)
        self._rates = (0.0, 0.0)

    def detected(self, lag: float) -> None:
        """A device was declared dead ``lag`` seconds after its deadline."""
        self.lateness.observe(lag)

    def worker(self) -> dict[str, Any]:
        """This worker's figures (``/presence/worker.json``)."""
        server = self.server
        packets = server.packets_in()
        now, cpu = time.monotonic(), _cpu_seconds()
        then, cpu_then, packets_then = self._sample
        if now - then >= _RATE_MIN_WINDOW:
            self._rates = ((cpu - cpu_then) / (now - then), (packets - packets_then) / (now - then))
            self._sample = (now, cpu, packets)
        cpu_share, packets_rate = self._rates
        stats = server.keeper.stats
        lag = stats.lag
        return {
            "worker": server.config.worker,
            "node": server.config.node,
            "pid": os.getpid(),
            "up_for": round(time.time() - self._started, 1),
            "connections": len(server.connections),
            "online": len(server.online),
            "packets_in": packets,
            "packets_per_s": round(packets_rate, 1),
            "cpu": round(cpu_share, 4),
            "rss_bytes": memory_bytes()[1],
            "tick": server.keeper.tick,
            "expired": stats.expired_total,
            "stall_saves": stats.stall_saves,
            "reaper_lag": {
                "count": lag.count,
                "p50": lag.quantile(0.5),
                "p99": lag.quantile(0.99),
                "max": round(lag.max, 6),
            },
            "lateness": _histogram(self.lateness),
            "offline_by_reason": dict(server.offline_by_reason),
            "listeners": [
                {"name": d.name, "online": d.online, "accepted": d.accepted, "refused": d.refused}
                for d in server.doors
            ],
            "page": None if self.page is None else self.page.figures(),
        }

    async def snapshot(self, query: str = "", limit: int = 100, authorization: str | None = None) -> dict[str, Any]:
        """The page's snapshot: the registry's overview and every worker's figures."""
        limit = max(0, min(limit, SEARCH_LIMIT))
        others: list[dict[str, Any]] = [{} for _ in self.siblings]
        found: dict[str, Any] | None = None

        async def overview() -> None:
            nonlocal found
            with trio.move_on_after(SIBLING_TIMEOUT):
                found = await self.server.coordinator.overview(query, limit)

        async def sibling(i: int, port: int) -> None:
            with trio.move_on_after(SIBLING_TIMEOUT):
                answer = await fetch_json(self.host, port, "/presence/worker.json", authorization)
                if isinstance(answer, dict):
                    others[i] = answer
            if not others[i]:
                others[i] = {"status_port": port, "answering": False}

        async with trio.open_nursery() as nursery:
            nursery.start_soon(overview)
            for i, port in enumerate(self.siblings):
                nursery.start_soon(sibling, i, port)
        workers = sorted([self.worker(), *others], key=lambda w: (w.get("worker", math.inf), w.get("status_port", 0)))
        answering = [w for w in workers if "lateness" in w]
        return {
            "time": round(time.time(), 3),
            "registry": found,
            "workers": workers,
            "tick": self.server.keeper.tick,
            "lateness": merge_lateness([w["lateness"] for w in answering]),
            "listeners": merge_listeners([w.get("listeners", []) for w in answering]),
            "query": query,
        }


def merge_listeners(parts: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The box's listeners: each one's figures summed over the workers that answered, in
    the order the first worker lists them."""
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for one in part:
            into = merged.setdefault(one["name"], {"name": one["name"], "online": 0, "accepted": 0, "refused": 0})
            for key in ("online", "accepted", "refused"):
                into[key] += int(one.get(key, 0))
    return list(merged.values())


def _cpu_seconds() -> float:
    # CLOCK_PROCESS_CPUTIME_ID, every thread's: os.times() counts in 10 ms ticks, too
    # coarse for a share of a core over one second.
    return time.process_time()


def _histogram(h: LagHistogram) -> dict[str, Any]:
    return {"bounds": list(h.bounds), "counts": list(h.counts), "count": h.count, "max": round(h.max, 6)}


def merge_lateness(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several workers' lateness histograms as one (they share bounds when they share a tick;
    a worker with other bounds is left out rather than mixed in wrongly)."""
    if not parts:
        return {"bounds": [], "counts": [], "count": 0, "max": 0.0}
    bounds = parts[0]["bounds"]
    counts = [0] * (len(bounds) + 1)
    total, most = 0, 0.0
    for part in parts:
        if part["bounds"] != bounds:
            continue
        counts = [a + b for a, b in zip(counts, part["counts"], strict=True)]
        total += part["count"]
        most = max(most, part["max"])
    return {"bounds": bounds, "counts": counts, "count": total, "max": most}
