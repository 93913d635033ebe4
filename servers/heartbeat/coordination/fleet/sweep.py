"""Declaring nodes lost: the sweep of a member whose lease lapsed, this node's own
leave at shutdown, and the sweeper task that also expires persistent sessions and
reads the fleet-wide figures.

Each node checks the members' leases every ``renew`` seconds; for a member whose lease
lapsed, one survivor takes ``sweep:<node>`` (SET NX PX) and ends every session the
dead node held with reason ``node-lost``, a batch per Lua call (per shard, on Redis
Cluster). Each device is compare-and-set on (online, owner = the dead node) and
removed from ``owned:<node>`` in the same call, so a retry, a second sweeper or a
sweep resumed after its sweeper died never emits twice; the membership goes only
once the owned sets are empty. A node that renews again stops the sweep (each call
checks its lease, or on Redis Cluster the copy of it in that shard). No node sweeps for a lease after Redis
failed it or changed under it (see :mod:`.leases`).

A node leaving while Redis is down or stalled leaves without it
(:meth:`Sweeper.leave_within`): what it could not settle, its sessions still owned there,
is what a survivor's sweep is for, once its lease lapses, as if it had died.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import coredis
import trio

from ...mqtt.endings import Offline
from .. import LEAVE_TIMEOUT
from .claims import Claims
from .filters import Filters
from .keys import FleetKeys
from .leases import LeaseKeeper
from .link import RedisLink
from .metrics import STATS_EVERY
from .queue import ReportQueue
from .sessions import PersistentSessions
from .values import text

__all__ = ["Sweeper"]

logger = logging.getLogger("servers.heartbeat.coordination.fleet")


class Sweeper:
    """Ends the sessions of nodes that are gone (or going), online and persistent alike."""

    def __init__(
        self,
        link: RedisLink,
        keys: FleetKeys,
        claims: Claims,
        sessions: PersistentSessions,
        filters: Filters,
        *,
        node: str,
    ) -> None:
        self.link = link
        self.keys = keys
        self.claims = claims
        self.sessions = sessions
        self.filters = filters
        self.node = node

    async def run(self, lease: LeaseKeeper, refresh_figures: Callable[[], Awaitable[None]]) -> None:
        """The sweeper task. Every ``renew`` seconds: declare the sessions of members whose
        lease lapsed lost, discard the persistent sessions that expired; every few
        seconds, read the figures."""
        attempt = 0
        next_figures = 0.0
        while True:
            try:
                await trio.sleep(lease.renew_every)
                for dead in await lease.lapsed():
                    await self.sweep(dead)
                await self.sessions.expire()
                if time.monotonic() >= next_figures:
                    next_figures = time.monotonic() + STATS_EVERY
                    await refresh_figures()
                attempt = 0
            except (Exception, trio.TooSlowError) as exc:
                attempt += 1
                await self.link.failed_attempt(exc, attempt)

    async def sweep(self, dead: str, *, lock: bool = True, batch: int = 200) -> int:
        """End every session ``dead`` held with reason ``node-lost``; returns how many this call ended.

        With ``lock`` (the sweeper's way), only whoever holds ``sweep:<dead>`` sweeps;
        the lock expires after a few leases, so a sweep whose sweeper died is resumed
        by the next node to take it. Safe to run concurrently without it.
        """
        redis, call, keys = self.link.redis(), self.link.call, self.keys
        k_lock = keys.sweep_prefix + dead
        lock_ms = self.claims.sweep_lock_ms
        if lock:
            got = await call(redis.set(k_lock, self.node, condition=coredis.PureToken.NX, px=int(lock_ms)))
            if not got and text(await call(redis.get(k_lock)) or b"") != self.node:
                return 0
        total = 0
        held_key = keys.held_prefix + dead
        owned_keys = [shard.owned_prefix + dead for shard in keys.shards]
        while True:
            for owned_key in owned_keys:
                members = sorted(text(m) for m in await call(redis.smembers(owned_key)))
                for i in range(0, len(members), batch):
                    if lock and not await call(self.link.scripts.keep_lock([k_lock], [self.node, lock_ms])):
                        return total  # the lock lapsed and another sweeper took it
                    ended = members[i : i + batch]
                    n = await self.claims.lose(dead, ended, Offline.NODE_LOST, f"node {dead} lost", True)
                    if n < 0:
                        return total  # it renewed its lease: alive after all
                    total += n
            # Its persistent sessions wait for their clients, unacknowledged messages kept.
            held = sorted(text(m) for m in await call(redis.smembers(held_key)))
            for i in range(0, len(held), batch):
                if await self.sessions.detach_lost(dead, held[i : i + batch], True) < 0:
                    return total
            finish = [keys.lease_prefix + dead, keys.members, keys.filters, k_lock, keys.route_prefix + dead, held_key]
            if keys.sharded:
                # Each shard's set is checked here; the script checks the hub's keys at once.
                if any([await call(redis.scard(k)) for k in owned_keys]):
                    continue
            else:
                finish += owned_keys
            if await call(self.link.scripts.finish(finish, [dead, self.node])) == 1:
                break
            if not any([await call(redis.scard(k)) for k in [*owned_keys, held_key]]):
                break  # the lease is back (finish refused): leave the rest to the node itself
        self.filters.forget(dead)
        return total

    async def leave(self) -> None:
        """End what this node still holds in Redis (``shutdown``) and drop its lease.

        A worker stopping with reports still queued would otherwise leave sessions
        owned by a node nobody renews: a survivor would sweep them as ``node-lost``
        seconds later, the wrong reason for a clean stop. Compare-and-set as always,
        so a session whose report did get through is not ended twice.
        """
        if self.link.client is None:
            return
        redis, call = self.link.redis(), self.link.call
        owned = await self.claims.owned(self.node)
        for start in range(0, len(owned), 1000):
            batch = owned[start : start + 1000]
            await self.claims.lose(self.node, batch, Offline.SHUTDOWN, "the gateway stopped", False)
        held = sorted(text(m) for m in await call(redis.smembers(self.keys.held)))
        for start in range(0, len(held), 1000):
            await self.sessions.detach_lost(self.node, held[start : start + 1000], False)
        # The others finish our keys at once. One key per call: on Redis Cluster each
        # shard's copy of the lease is in its own slot.
        for key in [self.keys.lease, *(shard.lease for shard in self.keys.shards if self.keys.sharded)]:
            await call(redis.delete([key]))

    async def leave_within(self, queue: ReportQueue, seconds: float = LEAVE_TIMEOUT) -> bool:
        """:meth:`leave`, tried again after failures for up to ``seconds``; False if Redis
        did not let it finish. Then the node leaves without Redis, and says so in one
        WARNING (what failed, and who ends its sessions instead); never raises, so a
        stop ends the process with 0 whatever Redis does (issue 61).

        Redis silent for ``seconds`` already (the stop's drain waited for it meanwhile)
        gets one try, not ``seconds`` more of them."""
        link = self.link
        retry = link.connected or link.down_since is None or time.monotonic() - link.down_since < seconds
        attempt = 0
        error = ""
        with trio.move_on_after(seconds):
            while True:
                try:
                    await self.leave()
                    return True
                except (Exception, trio.TooSlowError) as exc:
                    attempt += 1
                    error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    if not retry:
                        link.failed(exc)
                        break
                    await link.failed_attempt(exc, attempt)
        if error:
            silent = 0.0 if link.down_since is None else time.monotonic() - link.down_since
            why = f"silent for {silent:.1f} s: {error[:200]}"  # a client may quote a call's arguments
        else:
            why = f"no answer within {seconds:.1f} s"  # a call still waiting (a stall) when time ran out
        logger.warning(
            "node %s: could not reach Redis at shutdown (%s): leaving without it, %d reports unsent; "
            "its devices' offline events are left to the fleet's sweeper, which ends what Redis "
            "still has this node holding (node-lost) once its lease lapses",
            self.node,
            why,
            len(queue.items),
        )
        return False
