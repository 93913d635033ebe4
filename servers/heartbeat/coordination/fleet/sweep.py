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
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import coredis
import trio

from ...mqtt.endings import Offline
from .claims import Claims
from .filters import Filters
from .keys import FleetKeys
from .leases import LeaseKeeper
from .link import RedisLink
from .metrics import STATS_EVERY
from .sessions import PersistentSessions
from .values import text

__all__ = ["Sweeper"]


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
