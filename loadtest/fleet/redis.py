"""The fleet load test's reader of the fleet's presence stream, which keeps reading
across Redis restarts (the server itself: :mod:`loadtest.redis_server`).

The reader runs trio and coredis on a thread of its own, so the orchestrator's
loop (which starts, kills and restarts processes) never waits on it. Each entry
it reads is kept with the *incarnation* of Redis it came from: the server's
``run_id`` changes when it restarts, and a restarted server (no persistence)
starts an empty stream, so reading goes on from id 0.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import coredis
import trio
from coredis.connection import TCPLocation

__all__ = ["KEY_PREFIX", "PRESENCE_STREAM", "ClusterPresenceReader", "PresenceReader", "StreamEvent", "stream_length"]

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

    def count(self) -> int:
        """Entries read so far."""
        with self._lock:
            return len(self.events)

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

    def _take(self, res: Any, position: str) -> str:
        """Keep the events one XREAD returned; the position after them."""
        batch: list[StreamEvent] = []
        for entries in (res or {}).values():
            for entry in entries:
                position = _text(entry.identifier)
                fields = entry.field_values
                try:
                    event = json.loads(fields[b"event"])
                except (KeyError, ValueError):
                    continue
                batch.append(StreamEvent(self.incarnation, position, _text(fields.get(b"origin", b"")), event))
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
            self.last_event_at = time.monotonic()
        return position

    @staticmethod
    async def _resume(client: coredis.Redis[bytes], position: str) -> str:
        """Where to read a new server's stream from: ``position``, or its last entry if
        that is older (its top is where the two streams part), or the start if it has none."""
        last = await client.xrevrange(PRESENCE_STREAM, "+", "-", count=1)
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
    stopped (a task per stream; the cluster client follows slots that move), and samples
    INFO on every server, summed."""

    def __init__(self, ports: list[int], streams: list[str], *, block_ms: int = 300, max_seconds: float = 3600.0):
        super().__init__(ports[0], block_ms=block_ms, max_seconds=max_seconds)
        self.ports = ports
        self.streams = streams
        self.incarnation = 0  # nothing restarts: one run of the store

    async def _run(self) -> None:
        client: coredis.RedisCluster[bytes] = coredis.RedisCluster(
            startup_nodes=[TCPLocation("127.0.0.1", port) for port in self.ports],
            decode_responses=False,
            connect_timeout=1.0,
            stream_timeout=2.0 + self.block_ms / 1000,
        )
        async with client, trio.open_nursery() as nursery:
            nursery.start_soon(self._sample_servers)
            for stream in self.streams:
                nursery.start_soon(self._read_stream, client, stream)
            # The orchestrator's thread asks to stop through a threading.Event: polled.
            deadline = time.monotonic() + self.max_seconds
            while not self._stop.is_set() and time.monotonic() < deadline:  # noqa: ASYNC110
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    async def _read_stream(self, client: coredis.RedisCluster[bytes], stream: str) -> None:
        position = "0-0"
        while True:
            try:
                with trio.fail_after(5.0):
                    res = await client.xread({stream: position}, count=5000, block=self.block_ms)
            except (Exception, trio.TooSlowError):
                self.errors += 1
                await trio.sleep(0.1)
                continue
            position = self._take(res, position)

    async def _sample_servers(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    coredis.Redis(host="127.0.0.1", port=p, connect_timeout=1.0, stream_timeout=2.0)
                )
                for p in self.ports
            ]
            await self._sample_each(clients)

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


def stream_length(port: int, timeout: float = 2.0) -> int:
    """``XLEN`` of the presence stream, over a plain socket (from the orchestrator's thread); -1 if no answer."""
    key = PRESENCE_STREAM.encode()
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
