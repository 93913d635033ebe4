"""coredis's connection pools, keeping every slot they have.

A coredis pool holds ``max_connections`` slots (64 by default) in a queue: each is a
pooled connection or an empty place for one. A call takes a slot and gives it back
when it is done. In coredis 6.9 two things lose a slot for good:

- a connection that died while a call held it (a blocking read cancelled on its
  timeout, Redis restarted under it, the link dropping its connections after a
  timeout) is not put back, and no empty place is put in its stead;
- a call cancelled while its new connection is being made (Redis unreachable: the
  connect waits until our timeout cancels it) does not give back the slot it took.

So every outage cost a node slots: one or two for a Redis restart, one for each try
to connect during a partition. Once none were left, every call waited for one until
it timed out, and the node never heard Redis again, silently, until restarted. The
pools here count the slots held and give back what those two paths would lose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from coredis._concurrency import QueueFull
from coredis.connection import ClusterConnection, TCPLocation
from coredis.pool import ClusterConnectionPool, ConnectionPool, SentinelConnectionPool

__all__ = ["SlotKeepingClusterPool", "SlotKeepingPool", "SlotKeepingSentinelPool"]

T = TypeVar("T")


class _Slots:
    """One queue's slots held outside it: by calls holding a connection, and by calls
    still getting one (which may or may not have taken their slot yet)."""

    def __init__(self) -> None:
        self.leased = 0
        self.getting = 0

    async def take(self, getting: Awaitable[T], queue: Any) -> T:
        """What ``getting`` (coredis's own getting of a connection from ``queue``)
        gives, counted as held; if it fails, the slot it may have taken comes back."""
        self.getting += 1
        try:
            connection = await getting
        except BaseException:
            self.getting -= 1
            self.give_back_lost(queue)
            raise
        self.getting -= 1
        self.leased += 1
        return connection

    def released(self, usable: bool, queue: Any) -> None:
        """A held connection was given back to ``queue``; one that had died (not
        ``usable``, so coredis did not put it back) leaves an empty place instead."""
        self.leased -= 1
        if not usable:
            _give_back(queue)

    def give_back_lost(self, queue: Any) -> None:
        """Empty places back in ``queue`` for the slots that are neither in it nor held.

        A call still getting a connection counts as holding its slot, so this may
        leave a loss for a later repair, but never makes a slot that was not lost.
        """
        for _ in range(queue._maxsize - len(queue._queue) - self.leased - self.getting):
            _give_back(queue)


def _give_back(queue: Any) -> None:
    """An empty place back in a pool's ``queue``, where a lost slot was."""
    # Full: the queue was remade meanwhile (a node left the cluster's layout), nothing is lost.
    with contextlib.suppress(QueueFull):
        queue.put_nowait(None)


class SlotKeepingPool(ConnectionPool[Any]):
    """A one-server pool (``redis://``) that keeps its slots."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = _Slots()

    async def get_connection(self, **options: Any) -> Any:
        """A connection, as coredis gives one; if that fails, the slot it took comes back."""
        return await self._slots.take(super().get_connection(**options), self._available_connections)

    def release(self, connection: Any) -> None:
        """Back to the pool; a connection that died while held leaves an empty place."""
        usable = connection.usable
        super().release(connection)
        self._slots.released(usable, self._available_connections)

    @property
    def free_slots(self) -> int:
        """Slots not held by a call: pooled connections and empty places."""
        return len(self._available_connections._queue)


class SlotKeepingSentinelPool(SlotKeepingPool, SentinelConnectionPool):
    """The pool of a Sentinel-managed primary (``redis+sentinel://``) that keeps its slots."""


class SlotKeepingClusterPool(ClusterConnectionPool):
    """A Redis Cluster's pool (a queue of slots a node) that keeps its slots."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._node_slots: dict[TCPLocation, _Slots] = {}

    def _slots_of(self, location: TCPLocation) -> _Slots:
        return self._node_slots.setdefault(location, _Slots())

    async def _get_connection_by_node(self, node: Any) -> ClusterConnection:
        location = TCPLocation(node.host, node.port)
        getting = super()._get_connection_by_node(node)
        return await self._slots_of(location).take(getting, self._node_pool(location))

    def release(self, connection: ClusterConnection) -> None:
        """See :meth:`SlotKeepingPool.release`; in the queue of the connection's node."""
        location = connection.location
        usable = connection.usable
        super().release(connection)
        self._slots_of(location).released(usable, self._node_pool(location))
