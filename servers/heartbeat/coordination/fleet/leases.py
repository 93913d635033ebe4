"""Node liveness: this node's lease kept (and taken again when it was lost), the gaps
between its renewals measured, and the members whose leases lapsed found.

A node counts as alive while its lease (``node:<node>``, a TTL of ``lease`` seconds)
exists; it renews it every ``renew`` seconds. A node that finds its lease gone
registers again and resynchronises (see :mod:`.claims`). So does one that finds Redis
to be another server than at its last renewal (its ``run_id`` changed): a Sentinel
failover promotes a replica that may lack the primary's last writes (replication is
asynchronous), and a restart may come back from an older snapshot. It then also
reconciles: what the new server has it holding that it no longer holds goes offline.

After either, and after any of its calls to Redis failed, this node declares no other
node lost for one lease (:meth:`LeaseKeeper.sweeps_held`): while Redis could not be
reached (a failover, a stall, a restart) nobody could renew, so every lease may have
lapsed at once, and a sweep then would end the sessions of gateways that are alive.
Each has a lease's time to renew on the server that answers now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import trio
from coredis import PureToken

from .filters import Filters
from .keys import FleetKeys
from .link import RedisLink
from .metrics import FleetCounts
from .queue import ReportQueue
from .shards import hash_slot
from .values import text

__all__ = ["LeaseKeeper"]

logger = logging.getLogger("servers.heartbeat.coordination.fleet")


class LeaseKeeper:
    """This node's lease and membership, and which other members are alive."""

    def __init__(
        self, link: RedisLink, keys: FleetKeys, counts: FleetCounts, *, node: str, lease: float, renew: float
    ) -> None:
        self.link = link
        self.keys = keys
        self.counts = counts
        self.node = node
        self.lease = lease
        self.renew_every = renew
        self._token = f"{node}@{time.time():.3f}"
        self._registered = False
        self._last_renewal: float | None = None
        self._run_id: set[str] | None = None
        # The hub's slot and each shard's, with a key in each: they never change.
        keys_in_slots = [keys.members, *(shard.stream for shard in keys.shards)] if keys.sharded else []
        self._slots = [(hash_slot(key), key) for key in keys_in_slots]
        self.sweep_hold_until = 0.0
        """``time.monotonic()`` before which no other node is declared lost: a lease after
        Redis was found to be another server (see :meth:`sweeps_held`)."""
        self.server_changed = False
        """Set by :meth:`renew` when Redis is another server than at the renewal before."""
        self.joined = trio.Event()
        """Set once the renewer's first round was answered: the lease and membership
        written, this node's filters published and the others' read."""

    async def renew(self) -> bool:
        """Renew the lease; False if it was gone (taken afresh: the first time, or lost),
        or if Redis is another server than at the last renewal (:attr:`server_changed`)."""
        changed = await self._server_changed()
        args = [self.node, self._token, str(int(self.lease * 1000))]
        kept = await self.link.call(self.link.scripts.renew([self.keys.lease, self.keys.members], args))
        if self.keys.sharded:
            await self._copy_lease()
        self.renewed()
        if changed:
            self.counts.server_changes += 1
            logger.warning(
                "node %s: redis is another server than at the last renewal (a failover or a restart); "
                "resynchronising and reconciling",
                self.node,
            )
            self._registered = True
            return False
        if kept == 1:
            return True
        if self._registered:
            logger.warning("node %s: lease was lost; registering again and resynchronising", self.node)
        self._registered = True
        return False

    def extend_request(self, client: Any) -> Any:
        """This node's lease extended for another ``lease`` seconds if it still holds it
        (``SET ... XX``: a lease lost stays lost, for :meth:`renew` to take afresh)."""
        if not self._registered:
            return None
        return client.set(self.keys.lease, self._token, px=int(self.lease * 1000), condition=PureToken.XX)

    async def _copy_lease(self) -> None:
        """On Redis Cluster, the lease's copy in each shard, which a sweep there checks
        in the same step as it ends sessions (one pipeline; a copy outlives the lease
        by at most the time between the two writes)."""
        redis = self.link.redis()
        ms = int(self.lease * 1000)
        with trio.fail_after(self.link.timeout * 2):
            async with redis.pipeline(transaction=False) as pipe:
                requests = [pipe.set(shard.lease, self._token, px=ms) for shard in self.keys.shards]
            for request in requests:
                await request

    async def _run_ids(self) -> set[str]:
        """The ``run_id`` of each Redis server this node's keys are on (several on a
        Redis Cluster: one per primary serving a shard or the hub)."""
        redis = self.link.redis()
        if not self.keys.sharded:
            server = await self.link.call(redis.info("server", "replication"))
            if str(server.get("role", "master")) != "master":
                # A connection made before a failover, to a primary since demoted (one that
                # hung, and runs again as a replica): new ones go where the Sentinels say.
                self.link.drop_connections()
                raise RuntimeError("redis answered as a replica (a demoted primary); reconnecting")
            return {str(server.get("run_id", ""))}
        layout = redis.connection_pool.cluster_layout  # type: ignore[union-attr]
        seen: dict[str, str] = {}  # a server's name -> a key it serves
        for slot, key in self._slots:
            seen.setdefault(layout.node_for_slot(slot).name, key)
        ids = set()
        for key in seen.values():
            info = await self.link.call(redis.info("server").route(key))
            if isinstance(info, BaseException):
                raise info  # coredis hands back an unreachable node's error as the reply
            ids.add(str(info.get("run_id", "")))
        return ids

    async def _server_changed(self) -> bool:
        """Whether Redis is another server than when this was last asked (its ``run_id``;
        on a Redis Cluster, a server serving our keys that was not among them before: a
        replica promoted or a node restarted, not a slot moved between known primaries);
        if so, sweeps wait and the next renewal resynchronises."""
        run_ids = await self._run_ids()
        changed = self._run_id is not None and not run_ids <= self._run_id
        self._run_id = run_ids if self._run_id is None or changed else self._run_id | run_ids
        if changed:
            self._hold_sweeps()
            self.server_changed = True
        return changed or self.server_changed

    def _hold_sweeps(self) -> None:
        self.sweep_hold_until = max(self.sweep_hold_until, time.monotonic() + self.lease)

    def sweeps_held(self) -> bool:
        """Whether declaring other nodes lost must wait: Redis failed a call of this node's,
        or changed under it, less than a lease ago (see the module's docstring)."""
        failed = self.link.last_failure
        now = time.monotonic()
        return now < self.sweep_hold_until or (failed is not None and now < failed + self.lease)

    def renewed(self) -> None:
        """Note the gap since the last renewal: one near the lease means this node is
        close to being declared lost while alive (too busy, or Redis too slow)."""
        now = time.monotonic()
        if self._last_renewal is not None:
            gap = now - self._last_renewal
            self.counts.renew_gap_max = max(self.counts.renew_gap_max, gap)
            if gap > self.lease / 2:
                logger.warning(
                    "node %s: lease renewed %.1f s after the last (lease %.0f s)", self.node, gap, self.lease
                )
        self._last_renewal = now

    async def members(self) -> set[str]:
        """Every node that registered and has not been swept."""
        return {text(m) for m in await self.link.call(self.link.redis().smembers(self.keys.members))}

    async def lapsed(self) -> list[str]:
        """The other members whose lease is gone (none while :meth:`sweeps_held`)."""
        if await self._server_changed() or self.sweeps_held():
            return []
        dead = await self.link.call(self.link.scripts.lapsed([self.keys.members], [self.keys.prefix, self.node]))
        return [text(m) for m in dead or []]

    async def keep(self, filters: Filters, queue: ReportQueue, moved_on: Callable[[], None]) -> None:
        """The renewer task: keep the lease; register again (and have ``queue``'s flusher
        resynchronise) when it was lost; publish this node's filters and read the others'."""
        attempt = 0
        while True:
            try:
                if not await self.renew():
                    filters.republish()
                    queue.resync_soon(reconcile=self.server_changed)
                    self.server_changed = False
                if await filters.publish():
                    moved_on()
                await filters.refresh()
                self.joined.set()
                attempt = 0
                with trio.move_on_after(self.renew_every):
                    # Woken early only to publish changed filters.
                    await filters.next_change()
            except (Exception, trio.TooSlowError) as exc:
                attempt += 1
                await self.link.failed_attempt(exc, attempt)
