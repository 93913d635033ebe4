"""A fleet node's connection to Redis (one server, a Sentinel-managed primary, or a
Redis Cluster): each call bounded and timed, whether Redis answers, and the pause
before a task tries again after a failure."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeAlias

import coredis
import trio
from coredis.connection import TCPLocation

from .pools import SlotKeepingClusterPool, SlotKeepingPool, SlotKeepingSentinelPool
from .scripts import FleetScripts
from .target import RedisTarget, parse_target

__all__ = ["CALLS_IN_FLIGHT", "Client", "RedisLink", "cluster_connections", "first_of"]

Client: TypeAlias = "coredis.Redis[bytes] | coredis.RedisCluster[bytes]"
"""What a node talks to Redis through: one server's client or a cluster's."""

# One logger for the whole fleet coordinator, whichever of its modules logs.
logger = logging.getLogger("servers.heartbeat.coordination.fleet")


class _CutHandshakes(logging.Filter):
    """Drops coredis's ERROR, with a traceback, for a connection whose handshake did not
    finish: Redis stalled (or a partition) and our call's timeout cancelled it. Every
    try logged one, a hundred lines of traceback each, several a second through a stall
    (measured: 1,300 lines in 8 s); the call fails with a ConnectionError all the same,
    which :meth:`RedisLink.failed` reports once an outage."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Connection attempt failed unexpectedly!"


_CUT_HANDSHAKES = _CutHandshakes()


def cluster_connections(shards: int) -> int:
    """Connections a gateway may hold to one node of a Redis Cluster: a blocking read per
    presence shard (all of them, were every shard's slot on that node), the hub's, and
    room for the calls made meanwhile (claims, renewals, pipelines)."""
    return shards + 1 + CALLS_IN_FLIGHT


CALLS_IN_FLIGHT = 16
"""Connections a gateway's calls (besides its blocking reads) may hold to one node at once."""


class RedisLink:
    """The client of one node (``node`` names it in the log) and what its calls showed.

    A task that fails waits ``failed_attempt``'s backoff (at most ``renew`` seconds)
    and tries again; nothing here retries by itself.
    """

    def __init__(self, url: str, node: str, *, timeout: float, renew: float) -> None:
        logging.getLogger("coredis").addFilter(_CUT_HANDSHAKES)  # once: the same filter object
        self.url = url
        self.target: RedisTarget = parse_target(url)
        """One Redis, or the primary of a Sentinel-monitored service."""
        self.node = node
        self.timeout = timeout
        self.renew = renew
        self.scripts = FleetScripts()
        self.client: Client | None = None
        self.connected = False
        self.down_since: float | None = time.monotonic()
        self.last_error = "not connected yet"
        self.last_failure: float | None = None
        """``time.monotonic()`` of the last call that failed, any task's."""
        self.unreachable = trio.Event()
        """Set when a call fails; a fresh one once a call is answered again."""
        self.rtt_last = 0.0
        """Round trip of the last call, in seconds."""
        self.rtt_avg = 0.0
        """Moving average of the round trips."""

    def connect(self) -> AbstractAsyncContextManager[Any]:
        """A new client, the scripts registered with it; the caller enters what is
        returned (``async with``), which is the client, or the Sentinels and the client."""
        target = self.target
        timeouts: dict[str, Any] = {"connect_timeout": self.timeout, "stream_timeout": self.timeout + 1.0}
        if target.cluster:
            cluster: coredis.RedisCluster[bytes] = coredis.RedisCluster(
                startup_nodes=[TCPLocation(host, port) for host, port in target.cluster_nodes],
                username=target.username,
                password=target.password,
                connection_pool_cls=SlotKeepingClusterPool,
                # Per node, not coredis's 32 shared out over every node it knows, replicas
                # included: with a replica a primary, a primary had 5, fewer than the
                # blocking reads it serves, and every other call waited a read's second
                # (a lease renewed 9.8 s apart against 10 s, a resync of 18 s).
                max_connections=cluster_connections(target.shards),
                max_connections_per_node=True,
                **timeouts,
            )
            self.client = cluster
            self.scripts.register(cluster)
            return cluster
        if not target.sentinel:
            # Redis.from_url would make coredis's own pool, which loses slots (see .pools).
            client: coredis.Redis[bytes] = coredis.Redis(connection_pool=SlotKeepingPool.from_url(self.url, **timeouts))
            self.client = client
            self.scripts.register(client)
            return client
        sentinel: coredis.Sentinel[bytes] = coredis.Sentinel(
            [TCPLocation(host, port) for host, port in target.sentinels], **timeouts
        )
        # Each new connection asks the Sentinels where the primary is: after a
        # failover the calls that failed are tried again by their tasks, and reach it.
        primary: coredis.Redis[bytes] = sentinel.primary_for(
            target.service,
            connection_pool_class=SlotKeepingSentinelPool,
            db=target.db,
            username=target.username,
            password=target.password,
            **timeouts,
        )
        self.client = primary
        self.scripts.register(primary)
        return _entered(sentinel, primary)

    def drop_connections(self) -> None:
        """Close the client's pooled connections: the next call makes new ones (through
        the Sentinels, to the primary they name now)."""
        pool = getattr(self.client, "connection_pool", None)
        if pool is not None:
            pool.disconnect()

    def disconnected(self) -> None:
        """The client is closed: nothing is sent until the next :meth:`connect`."""
        self.client = None
        self.connected = False

    def redis(self) -> Client:
        """The current client; RuntimeError when the coordinator is not running."""
        if self.client is None:
            raise RuntimeError("not running")
        return self.client

    def ok(self, started: float) -> None:
        """A call begun at ``started`` (``time.perf_counter``) was answered."""
        rtt = time.perf_counter() - started
        self.rtt_last = rtt
        self.rtt_avg = rtt if self.rtt_avg == 0.0 else 0.9 * self.rtt_avg + 0.1 * rtt
        if not self.connected:
            self.connected = True
            self.down_since = None
            if self.unreachable.is_set():
                self.unreachable = trio.Event()
            logger.info("node %s: redis reachable", self.node)

    def failed(self, exc: BaseException) -> None:
        """A call failed with ``exc``: Redis counts as unreachable until one is answered."""
        self.last_failure = time.monotonic()
        self.unreachable.set()
        if self.target.sentinel or _unanswered(exc):
            # The next call makes a new connection. Behind the Sentinels, a pooled one may
            # lead to a primary that hung or was demoted. And a call not answered in time
            # leaves its connection open and pooled, with the client's later calls
            # written behind it: after a partition, TCP retransmits on it with a backoff
            # that grows to minutes, so the node would hear Redis again only then, long
            # after the network healed. A new connection is answered as soon as it has.
            self.drop_connections()
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        # A client library may quote a call's arguments (a 64 KB client id) in its error.
        self.last_error = error if len(error) <= 300 else f"{error[:300]}... ({len(error)} characters)"
        if self.connected:
            logger.warning("node %s: redis unreachable: %s", self.node, self.last_error)
            self.connected = False
            self.down_since = time.monotonic()

    async def call(self, request: Any) -> Any:
        """Await one coredis request within ``timeout``; records the round trip."""
        started = time.perf_counter()
        with trio.fail_after(self.timeout):
            result = await request
        self.ok(started)
        return result

    async def failed_attempt(self, exc: BaseException, attempt: int) -> None:
        """Note a task's failure (its ``attempt``-th in a row) and wait before its next try."""
        self.failed(exc)
        await trio.sleep(min(self.renew, 0.05 * 2 ** min(attempt, 6)))


def _unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` is a call that timed out: our bound's, or the client's stream timeout."""
    return isinstance(exc, (trio.TooSlowError, TimeoutError))


@asynccontextmanager
async def _entered(sentinel: coredis.Sentinel[bytes], primary: coredis.Redis[bytes]) -> AsyncIterator[None]:
    async with sentinel, primary:
        yield


async def first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Until the first of ``waits`` returns; the others are cancelled."""
    async with trio.open_nursery() as nursery:
        for wait in waits:
            nursery.start_soon(_then_cancel, wait, nursery.cancel_scope)


async def _then_cancel(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()
