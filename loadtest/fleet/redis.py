"""The fleet load test's reader of the fleet's presence stream, which keeps reading
across Redis restarts (the server itself: :mod:`loadtest.redis_server`).

The reader runs trio and coredis on a thread of its own, so the orchestrator's
loop (which starts, kills and restarts processes) never waits on it. Each entry
it reads is kept with the *incarnation* of Redis it came from: the server's
``run_id`` changes when it restarts, and a restarted server (no persistence)
starts an empty stream, so reading goes on from id 0. On Redis Cluster each shard's
stream has its own: a failover that promotes a replica to serve a shard's slot starts
a new one for that stream (the replica's copy may be short of the lost primary's last
writes, and the gateways re-claim their sessions into it), a slot moved whole to
another primary does not.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import coredis
import trio
from coredis.connection import TCPLocation
from coredis.response.types import ClusterNodeDetail

from servers.heartbeat.coordination.fleet.pools import SlotKeepingClusterPool
from servers.heartbeat.coordination.fleet.shards import hash_slot

__all__ = [
    "KEY_PREFIX",
    "PRESENCE_STREAM",
    "ClusterPresenceReader",
    "PresenceReader",
    "StreamEvent",
    "slot_owners",
    "stream_length",
]

KEY_PREFIX = "idlekeeper:"
"""The gateways' default ``--prefix``."""
PRESENCE_STREAM = KEY_PREFIX + "presence"
"""The fleet's presence stream (``servers.heartbeat.coordination.fleet``): one entry per
event, the event's JSON in the field ``event``, the emitting node in ``origin``."""


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One presence event as read from the stream."""

    incarnation: int
    """Which Redis run it was read from: 0, then 1 after the first restart, ..."""
    entry_id: str
    origin: str
    event: dict[str, Any]


@dataclass
class RedisStats:
    """INFO figures sampled once a second."""

    samples: list[tuple[float, float, int]] = field(default_factory=list)
    """(monotonic time, instantaneous_ops_per_sec, total_commands_processed)."""
    commands: int = 0
    """Commands processed, summed over incarnations (each restart starts at 0)."""
    peak_used_memory: int = 0

    def ops_per_s(self, start: float, end: float) -> float:
        """Commands per second between ``start`` and ``end`` (deltas within one run of Redis)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        total = sum(b[2] - a[2] for a, b in itertools.pairwise(inside) if b[2] >= a[2])
        span = inside[-1][0] - inside[0][0] if len(inside) > 1 else 0.0
        return total / span if span > 0 else math.nan


class PresenceReader:
    """Reads the presence stream from id 0 until stopped, through restarts of Redis and
    failovers (``port`` may be a callable: where the primary is now)."""

    def __init__(self, port: int | Callable[[], int], *, block_ms: int = 300, max_seconds: float = 3600.0) -> None:
        self.port: Callable[[], int] = port if callable(port) else (lambda: port)
        self.block_ms = block_ms
        self.max_seconds = max_seconds
        self.events: list[StreamEvent] = []
        self.stats = RedisStats()
        self.errors = 0
        self.lag: list[float] = []
        """Seconds from each event's own time stamp to its reading here (wall clocks)."""
        self.write_lag: list[float] = []
        """Seconds from each event's time stamp to its entry in Redis (the entry id's
        milliseconds, Redis's clock): how far behind the gateways wrote."""
        self.incarnation = -1
        self.per_stream: collections.Counter[str] = collections.Counter()
        """Entries read from each stream."""
        self.last_event_at = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="presence-reader", daemon=True)

    def start(self) -> PresenceReader:
        """Start reading on a thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading (within one BLOCK) and join the thread."""
        self._stop.set()
        self._thread.join(timeout=10 + self.block_ms / 1000)

    def count(self, streams: list[str] | None = None) -> int:
        """Entries read so far (from ``streams`` only, if given)."""
        with self._lock:
            return len(self.events) if streams is None else sum(self.per_stream[s] for s in streams)

    def wait_quiet(self, quiet: float = 2.0, limit: float = 30.0) -> None:
        """Return once nothing new was read for ``quiet`` seconds (or after ``limit``)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and time.monotonic() - self.last_event_at < quiet:
            time.sleep(0.1)

    def _main(self) -> None:
        trio.run(self._run)

    async def _run(self) -> None:
        position = "0-0"
        run_id = ""
        deadline = time.monotonic() + self.max_seconds
        # A client per server: after a failover the primary is another port.
        while not self._stop.is_set() and time.monotonic() < deadline:
            port = self.port()
            client: coredis.Redis[bytes] = coredis.Redis(
                host="127.0.0.1", port=port, db=0, connect_timeout=1.0, stream_timeout=2.0 + self.block_ms / 1000
            )

            def moved(connected_to: int = port) -> bool:
                return self.port() != connected_to

            async with client, trio.open_nursery() as nursery:
                nursery.start_soon(self._sample, client)
                position, run_id = await self._read(client, position, run_id, moved)
                nursery.cancel_scope.cancel()

    async def _run_id(self, client: coredis.Redis[bytes]) -> str:
        info = await client.info("server")
        return str(info.get("run_id", ""))

    async def _read(
        self, client: coredis.Redis[bytes], position: str, run_id: str, moved: Callable[[], bool]
    ) -> tuple[str, str]:
        """Read from ``position`` until stopped, or until ``moved()`` after a failure;
        where reading stopped, and the server's run_id."""
        connected = False
        deadline = time.monotonic() + self.max_seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                with trio.fail_after(5.0):
                    if not connected:
                        now_id = await self._run_id(client)
                        if now_id != run_id:
                            # Another server: a restart (its stream starts over, empty) or a
                            # promoted replica (its stream is the old one's, maybe short of the
                            # last entries). Reading goes on from where both agree, and the
                            # gateways announce their sessions again into a new run.
                            position = await self._resume(client, position)
                            run_id = now_id
                            self.incarnation += 1
                        connected = True
                    res = await client.xread({PRESENCE_STREAM: position}, count=5000, block=self.block_ms)
            except (Exception, trio.TooSlowError):
                self.errors += 1
                connected = False
                if moved():
                    return position, run_id
                await trio.sleep(0.1)
                continue
            position = self._take(res, position)
        return position, run_id

    def _take(self, res: Any, position: str, incarnation: int | None = None) -> str:
        """Keep the events one XREAD returned, as of ``incarnation`` (default: the
        reader's); the position after them."""
        batch: list[StreamEvent] = []
        run = self.incarnation if incarnation is None else incarnation
        counts: collections.Counter[str] = collections.Counter()
        for name, entries in (res or {}).items():
            counts[_text(name)] += len(entries)
            for entry in entries:
                position = _text(entry.identifier)
                fields = entry.field_values
                try:
                    event = json.loads(fields[b"event"])
                except (KeyError, ValueError):
                    continue
                batch.append(StreamEvent(run, position, _text(fields.get(b"origin", b"")), event))
        if batch:
            now = time.time()
            # How far behind the feed this reader is: if a restart comes, what it has
            # not read yet is gone with the old Redis.
            self.lag.extend(now - float(e.event.get("time", now)) for e in batch)
            self.write_lag.extend(
                int(e.entry_id.partition("-")[0]) / 1000 - float(e.event.get("time", now)) for e in batch
            )
            with self._lock:
                self.events.extend(batch)
                self.per_stream.update(counts)
            self.last_event_at = time.monotonic()
        return position

    @staticmethod
    async def _resume(
        client: coredis.Redis[bytes] | coredis.RedisCluster[bytes], position: str, stream: str = PRESENCE_STREAM
    ) -> str:
        """Where to read a new server's stream from: ``position``, or its last entry if
        that is older (its top is where the two streams part), or the start if it has none."""
        last = await client.xrevrange(stream, "+", "-", count=1)
        if not last:
            return "0-0"
        top = _text(last[0].identifier)
        return top if _stream_id(top) < _stream_id(position) else position

    async def _sample(self, client: coredis.Redis[bytes]) -> None:
        last_run = ""
        base = 0
        last_total = 0
        deadline = time.monotonic() + self.max_seconds
        while time.monotonic() < deadline:
            await trio.sleep(1.0)
            try:
                with trio.fail_after(2.0):
                    info = await client.info("server", "stats", "memory")
            except (Exception, trio.TooSlowError):
                continue
            total = _int(info.get("total_commands_processed", 0))
            run = str(info.get("run_id", ""))
            if run != last_run:
                # Counters restart with the server: carry what the last run had counted.
                base += last_total
                last_run = run
            last_total = total
            self.stats.commands = base + total
            self.stats.samples.append((time.monotonic(), float(_int(info.get("instantaneous_ops_per_sec", 0))), total))
            self.stats.peak_used_memory = max(self.stats.peak_used_memory, _int(info.get("used_memory", 0)))


class ClusterPresenceReader(PresenceReader):
    """Reads every shard's presence stream of a fleet on Redis Cluster from id 0 until
    stopped (a task per stream; the cluster client follows slots that move, and finds a
    primary's promoted replica), and samples INFO on every server, summed.

    Each stream's events carry the incarnation of the primary they were read from: 0,
    until a failover hands the stream's slot to a replica, whose copy starts the next
    (one per primary promoted, shared by the streams it took over)."""

    def __init__(self, ports: list[int], streams: list[str], *, block_ms: int = 300, max_seconds: float = 3600.0):
        super().__init__(ports[0], block_ms=block_ms, max_seconds=max_seconds)
        self.ports = ports
        self.streams = streams
        self.incarnation = 0
        self._promoted: dict[str, int] = {}  # node id of a promoted primary -> its incarnation
        self._topology: tuple[dict[int, str | None], frozenset[str]] = ({}, frozenset())
        self._topology_at = -math.inf

    async def _run(self) -> None:
        client: coredis.RedisCluster[bytes] = coredis.RedisCluster(
            startup_nodes=[TCPLocation("127.0.0.1", port) for port in self.ports],
            decode_responses=False,
            connect_timeout=1.0,
            stream_timeout=2.0 + self.block_ms / 1000,
            # coredis 6.9's own pool loses a slot to each call cut short on a lost primary
            # (the gateways' pool keeps them, see its module), and a node's share of its
            # default 32 (replicas count as nodes) is fewer than the blocking reads one
            # primary serves: room for every stream's read on any node.
            connection_pool_cls=SlotKeepingClusterPool,
            max_connections=2 * len(self.streams) + 8,
            max_connections_per_node=True,
        )
        async with client, contextlib.AsyncExitStack() as stack:
            # Entered before the nursery opens, so that they close after it does.
            servers = [
                await stack.enter_async_context(
                    coredis.Redis(host="127.0.0.1", port=p, connect_timeout=1.0, stream_timeout=2.0)
                )
                for p in self.ports
            ]
            lock = trio.Lock()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sample_each, servers)
                for stream in self.streams:
                    nursery.start_soon(self._read_stream, client, stream, lambda: self._owners(servers, lock))
                # The orchestrator's thread asks to stop through a threading.Event: polled.
                deadline = time.monotonic() + self.max_seconds
                while not self._stop.is_set() and time.monotonic() < deadline:  # noqa: ASYNC110
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()

    async def _read_stream(
        self,
        client: coredis.RedisCluster[bytes],
        stream: str,
        owners: Callable[[], Awaitable[tuple[dict[int, str | None], frozenset[str]]]],
    ) -> None:
        slot = hash_slot(stream)
        position = "0-0"
        incarnation = 0
        serving: str | None = None  # the node id of the primary last read from
        unsure = True
        while True:
            try:
                with trio.fail_after(5.0):
                    if unsure:
                        # After a failed read, learn who serves the slot before reading again.
                        # Only a primary that every server names and none suspects counts:
                        # a lost primary is suspected seconds before its replica can be
                        # promoted, so no read in between comes from a server not yet seen.
                        found, primaries = await owners()
                        owner = found.get(slot)
                        if owner is None:
                            await trio.sleep(0.1)
                            continue
                        if serving is not None and owner != serving and serving not in primaries:
                            # Its primary is lost, not its slot moved (a migration leaves the
                            # old primary serving others): the replica's copy is a new run.
                            position = await self._resume(client, position, stream)
                            incarnation = self._promoted.setdefault(owner, self.incarnation + 1)
                            self.incarnation = max(self.incarnation, incarnation)
                        serving, unsure = owner, False
                    res = await client.xread({stream: position}, count=5000, block=self.block_ms)
            except (Exception, trio.TooSlowError):
                self.errors += 1
                unsure = True
                await trio.sleep(0.1)
                continue
            position = self._take(res, position, incarnation)

    async def _owners(
        self, servers: list[coredis.Redis[bytes]], lock: trio.Lock
    ) -> tuple[dict[int, str | None], frozenset[str]]:
        """:func:`slot_owners` of the streams' slots, as every server that answers sees
        them; one look shared by the streams for a quarter of a second."""
        async with lock:
            if time.monotonic() - self._topology_at >= 0.25:
                views = []
                for server in servers:
                    try:
                        with trio.fail_after(1.0):
                            views.append(await server.cluster_nodes())
                    except (Exception, trio.TooSlowError):
                        continue  # a server lost answers nothing
                self._topology = slot_owners(views, [hash_slot(s) for s in self.streams])
                self._topology_at = time.monotonic()
            return self._topology

    async def _sample_each(self, clients: list[coredis.Redis[bytes]]) -> None:
        while True:
            await trio.sleep(1.0)
            total = ops = memory = 0
            for c in clients:
                try:
                    with trio.fail_after(2.0):
                        info = await c.info("stats", "memory")
                except (Exception, trio.TooSlowError):
                    continue
                total += _int(info.get("total_commands_processed", 0))
                ops += _int(info.get("instantaneous_ops_per_sec", 0))
                memory += _int(info.get("used_memory", 0))
            self.stats.commands = max(self.stats.commands, total)
            self.stats.samples.append((time.monotonic(), float(ops), total))
            self.stats.peak_used_memory = max(self.stats.peak_used_memory, memory)


def slot_owners(views: list[list[ClusterNodeDetail]], slots: list[int]) -> tuple[dict[int, str | None], frozenset[str]]:
    """Who serves each of ``slots`` by ``CLUSTER NODES`` as several servers see it: the
    id of the primary that every view names, or None while they differ or any suspects
    it (``fail?``, ``fail``); and the ids every view takes for a healthy primary."""
    healthy: set[str] | None = None
    named: dict[int, set[str | None]] = {slot: set() for slot in slots}
    for view in views:
        primaries = {n["id"] for n in view if "master" in n["flags"] and not {"fail", "fail?"} & set(n["flags"])}
        healthy = primaries if healthy is None else healthy & primaries
        served = {n["id"]: set(n["slots"]) for n in view if "master" in n["flags"]}
        for slot in slots:
            named[slot].add(next((node for node, held in served.items() if slot in held), None))
    sure = frozenset(healthy or ())
    owners: dict[int, str | None] = {}
    for slot, ids in named.items():
        (owner,) = ids if len(ids) == 1 else {None}
        owners[slot] = owner if owner in sure else None
    return owners, sure


def stream_length(port: int, timeout: float = 2.0, stream: str = PRESENCE_STREAM) -> int:
    """``XLEN`` of ``stream``, over a plain socket (from the orchestrator's thread); -1 if no answer."""
    key = stream.encode()
    request = b"*2\r\n$4\r\nXLEN\r\n$%d\r\n%s\r\n" % (len(key), key)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(request)
            reply = s.recv(64)
    except OSError:
        return -1
    return int(reply[1:].split(b"\r\n", 1)[0]) if reply.startswith(b":") else -1


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _int(value: object) -> int:
    """An INFO figure as an int (coredis parses them into numbers already)."""
    return int(value) if isinstance(value, (int, float, str, bytes)) else 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
