"""The coordinator of a fleet of gateways sharing one Redis (≥ 7), through coredis.

Every worker process of every gateway is one *node* of the fleet and talks to
Redis itself. The registry's rules (:mod:`.registry`) are applied by Lua scripts,
so each decision (claim, offline, loss) and the presence events it emits are one
atomic step on the server, whichever node asks and however often it retries.

Keys, under ``prefix`` (default ``idlekeeper:``)::

    members               set: every node id that registered
    node:<node>           the node's lease (a string with a TTL of ``lease`` s)
    owned:<node>          set: client ids whose online session the node holds
    dev:<client-id>       hash: the device's record (status, epoch, node, worker,
                          peer, time, reason, keep_alive, owner, event = its JSON)
    presence              stream: every presence event, in order (MAXLEN ~ stream_maxlen)
    filters               hash: node -> JSON list of its subscribers' topic filters
    sweep:<node>          the lock of whoever declares a dead node's devices lost
    route:<node>          stream: device messages for that node's subscribers
                          (bounded, expires when idle; deleted with a dead node)
    filters-changed       stream: ids of nodes whose filters just changed

**The presence stream** ``<prefix>presence`` is the fleet's presence feed. Each
entry has the fields ``event`` (the event's JSON, as :meth:`PresenceEvent.to_dict`),
``origin`` (the node that emitted it) and ``evict`` (for a takeover: the node that
must close the displaced session, else empty). Every node reads the whole stream
with ``XREAD`` and delivers each event to its own MQTT subscribers; external
consumers read it with a consumer group of their own
(``XGROUP CREATE idlekeeper:presence mine $ MKSTREAM``, then ``XREADGROUP``).
Telling the previous owner of a taken-over session through the same stream (rather
than a Pub/Sub message) means the eviction is never lost by a node that was
briefly disconnected, and it is ordered with the events its subscribers see. The
same goes for routed messages: a node reads the presence stream, its own route
stream and ``filters-changed`` in one blocking ``XREAD``.

**Nothing blocks the worker.** :meth:`RedisCoordinator.online`, ``offline``,
``route``, ``note`` and ``filters_changed`` return at once: reports go into a
bounded queue that one task flushes in order; while Redis is unreachable the
queue holds them (past ``queue_limit`` new ones are dropped and counted, and a
resynchronisation is scheduled so the registry heals anyway).

**Resynchronisation.** When a node finds its lease gone (Redis restarted empty,
or the node was cut off longer than its lease and declared lost), it registers
again, republishes its filters and re-claims every session its host holds; if
reports were dropped, devices the registry has it holding that it no longer holds
go offline (``connection-lost``). A re-claim never displaces a newer session of
the same device held elsewhere (the later ``time`` wins); the local one, stale,
is evicted instead.

**Node loss.** Each node checks the members' leases every ``renew`` seconds; for
a member whose lease lapsed, one survivor takes ``sweep:<node>`` (SET NX PX) and
ends every session the dead node held with reason ``node-lost``, a batch per Lua
call. Each device is compare-and-set on (online, owner = the dead node) and
removed from ``owned:<node>`` in the same call, so a retry, a second sweeper or
a sweep resumed after its sweeper died never emits twice; the owned set and the
membership go only once it is empty. A node that renews again stops the sweep.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import coredis
import trio

from ...prometheus import Families, Metric
from ..broker import matches_any
from ..presence import Offline, PresenceEvent, PresenceSink
from . import Coordinator, Health, Host, publish_to_sinks
from .registry import takeover_of

__all__ = ["RedisCoordinator"]

logger = logging.getLogger("servers.heartbeat.coordination.fleet")

# --------------------------------------------------------------------------- Lua
# Every script names the device keys it derives from its arguments through the
# prefix (ARGV), which is fine on one Redis; a Redis Cluster would need hash tags.

_CLAIM = """
local dev, stream, owned = KEYS[1], KEYS[2], KEYS[3]
local prefix, me, cid, epoch, ev = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local maxlen, mode, detail, now = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local cur = redis.call('HMGET', dev, 'status', 'epoch', 'owner', 'event', 'time')
local status, cur_epoch, cur_owner = cur[1], cur[2], cur[3]
if cur_epoch == epoch then
  if status == 'online' then
    if cur_owner == me then redis.call('SADD', owned, cid) end
    return {}
  end
  -- A session, once ended, never comes back online: this is a resend. Only a
  -- resynchronisation re-announces a session still held (declared lost meanwhile).
  if mode ~= 'reclaim' then return {} end
end
local out = {}
if status == 'online' then
  -- Claims from different nodes can cross on the way (the registry's rule): one
  -- accepted before the current owner's loses at once, unpublished.
  if tonumber(cur[5] or '0') > tonumber(now) then
    return {'stale'}
  end
  local old = cjson.decode(cur[4])
  old['status'] = 'offline'
  old['reason'] = 'takeover'
  old['time'] = tonumber(now)
  old['silent_for'] = 0
  old['detail'] = detail
  old['keep_alive'] = nil
  out[#out + 1] = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
    'event', cjson.encode(old), 'origin', me, 'evict', cur_owner)
  if cur_owner ~= me then redis.call('SREM', prefix .. 'owned:' .. cur_owner, cid) end
end
redis.call('HSET', dev, unpack(ARGV, 10))
redis.call('PERSIST', dev)
redis.call('SADD', owned, cid)
out[#out + 1] = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'event', ev, 'origin', me, 'evict', '')
return out
"""

_OFFLINE = """
local dev, stream, owned = KEYS[1], KEYS[2], KEYS[3]
local prefix, me, cid, epoch, ev = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local maxlen, forget, ttl, tomb = ARGV[6], ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local cur = redis.call('HMGET', dev, 'status', 'epoch', 'owner')
if cur[1] and (cur[2] ~= epoch or cur[1] ~= 'online') then return {} end
local id = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'event', ev, 'origin', me, 'evict', '')
if cur[3] and cur[3] ~= '' and cur[3] ~= me then redis.call('SREM', prefix .. 'owned:' .. cur[3], cid) end
redis.call('SREM', owned, cid)
if forget == '1' then
  -- A tombstone, not nothing: a resent online of this epoch must stay a no-op.
  redis.call('DEL', dev)
  redis.call('HSET', dev, 'status', 'forgotten', 'epoch', epoch)
  redis.call('PEXPIRE', dev, tomb)
else
  redis.call('HSET', dev, unpack(ARGV, 10))
  if ttl > 0 then redis.call('PEXPIRE', dev, ttl) end
end
return {id}
"""

_LOSE = """
local stream, owned, lease, lock = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, me, dead, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local reason, detail, now, ttl = ARGV[5], ARGV[6], ARGV[7], tonumber(ARGV[8])
if ARGV[9] == '1' and redis.call('EXISTS', lease) == 1 then return -1 end
if redis.call('GET', lock) == me then redis.call('PEXPIRE', lock, ARGV[10]) end
local n = 0
for i = 11, #ARGV do
  local cid = ARGV[i]
  local dev = prefix .. 'dev:' .. cid
  local cur = redis.call('HMGET', dev, 'status', 'owner', 'event')
  if cur[1] == 'online' and cur[2] == dead then
    local e = cjson.decode(cur[3])
    e['status'] = 'offline'
    e['reason'] = reason
    e['time'] = tonumber(now)
    e['silent_for'] = 0
    e['detail'] = detail
    e['keep_alive'] = nil
    local js = cjson.encode(e)
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'event', js, 'origin', me, 'evict', '')
    redis.call('HSET', dev, 'status', 'offline', 'owner', '', 'event', js, 'reason', reason, 'time', now)
    if ttl > 0 then redis.call('PEXPIRE', dev, ttl) end
    n = n + 1
  end
  redis.call('SREM', owned, cid)
end
return n
"""

_FINISH = """
local owned, lease, members, filters, lock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if redis.call('EXISTS', lease) == 1 or redis.call('SCARD', owned) > 0 then return 0 end
redis.call('DEL', owned)
redis.call('SREM', members, ARGV[1])
redis.call('HDEL', filters, ARGV[1])
redis.call('DEL', KEYS[6])
if redis.call('GET', lock) == ARGV[2] then redis.call('DEL', lock) end
return 1
"""

_RENEW = """
if redis.call('SET', KEYS[1], ARGV[2], 'XX', 'PX', ARGV[3]) then
  redis.call('SADD', KEYS[2], ARGV[1])
  return 1
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
return 0
"""

_ROUTE = """
for _, key in ipairs(KEYS) do
  redis.call('XADD', key, 'MAXLEN', '~', ARGV[2], '*', 'm', ARGV[1])
  redis.call('PEXPIRE', key, ARGV[3])
end
return #KEYS
"""

_DEAD = """
local dead = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if m ~= ARGV[2] and redis.call('EXISTS', ARGV[1] .. 'node:' .. m) == 0 then dead[#dead + 1] = m end
end
return dead
"""

# ------------------------------------------------------------------------ helpers

ROUTE_MAXLEN = 10_000
"""Messages kept in a node's route stream: a node that falls this far behind loses the oldest."""
ROUTE_TTL_MS = 60_000
"""A route stream nobody writes to for this long goes (its node is gone or has no remote senders)."""
FLUSH_BATCH = 256
"""Reports in flight at once: applied concurrently, each device's (and the routes) in order."""


@dataclass(frozen=True, slots=True)
class _Report:
    """One queued report: an online/offline event, or a message to route."""

    kind: str  # "online" | "offline" | "route"
    event: PresenceEvent | None = None
    forget: bool = False
    topic: str = ""
    payload: bytes = b""
    qos: int = 0


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _record_fields(event: PresenceEvent, owner: str) -> list[str]:
    """The device hash's fields for ``event`` (flattened name/value pairs for HSET)."""
    return [
        "status", event.status,
        "epoch", event.epoch,
        "node", event.node,
        "worker", str(event.worker),
        "peer", event.peer,
        "time", repr(event.time),  # exact: crossing claims are ordered by it
        "reason", "" if event.reason is None else event.reason.value,
        "keep_alive", str(event.keep_alive),
        "owner", owner,
        "event", json.dumps(event.to_dict(), separators=(",", ":")),
    ]  # fmt: skip


def _encode_route(topic: str, payload: bytes, qos: int) -> bytes:
    # MQTT topics cannot hold U+0000, so it can separate the header from the body.
    return b"%d\x00%s\x00" % (qos, topic.encode()) + payload


def _decode_route(data: bytes) -> tuple[str, bytes, int]:
    qos, topic, payload = data.split(b"\x00", 2)
    return topic.decode(), payload, int(qos)


class RedisCoordinator(Coordinator):
    """Shares the registry, presence events and subscriptions of a fleet through Redis.

    ``node`` names this worker process fleet-wide and must be unique and not reused
    by a later process (say ``"gw1.example:1883/w0/pid4242"``): the lease, the owned
    set and the eviction of taken-over sessions are keyed by it. ``lease`` is how
    long the node counts as alive without renewing; it renews every ``renew``
    seconds and checks the other members' leases as often. ``offline_ttl``: how
    long an offline device's record is kept (0: forever).
    """

    def __init__(
        self,
        url: str,
        node: str,
        *,
        sinks: Sequence[PresenceSink] = (),
        presence_prefix: str = "presence/",
        prefix: str = "idlekeeper:",
        lease: float = 3.0,
        renew: float = 1.0,
        stream_maxlen: int = 100_000,
        queue_limit: int = 100_000,
        offline_ttl: float = 7 * 86400.0,
        timeout: float = 2.0,
    ) -> None:
        if renew >= lease:
            raise ValueError("renew must be shorter than lease")
        self.url = url
        self.node = node
        self.sinks = list(sinks)
        self.presence_prefix = presence_prefix
        self.prefix = prefix
        self.lease = lease
        self.renew = renew
        self.stream_maxlen = stream_maxlen
        self.queue_limit = queue_limit
        self.offline_ttl = offline_ttl
        self.timeout = timeout

        self._last_renewal: float | None = None
        self.renew_gap_max = 0.0
        self.k_members = prefix + "members"
        self.k_lease = prefix + "node:" + node
        self.k_owned = prefix + "owned:" + node
        self.k_stream = prefix + "presence"
        self.k_filters = prefix + "filters"
        self.k_routes = prefix + "route:" + node
        self.k_changed = prefix + "filters-changed"

        self._host: Host | None = None
        self._redis: coredis.Redis[bytes] | None = None
        self._queue: deque[_Report] = deque()
        self._wakeup = trio.Event()
        self._busy = False  # the flusher holds reports it has taken but not yet confirmed
        self._resync = False
        self._reconcile = False
        self._filters: set[str] = set()
        self._filters_dirty = True
        self._filters_event = trio.Event()
        self._registered = False
        self._remote: dict[str, frozenset[str]] = {}
        self._reader_ready = trio.Event()
        self._progress = trio.Event()  # set (and replaced) whenever the flusher or the reader moved on
        self._read_pos = (0, 0)
        self._emitted = (0, 0)
        self._lease_token = f"{node}@{time.time():.3f}"

        self._connected = False
        self._down_since: float | None = time.monotonic()
        self._last_error = "not connected yet"
        self._queued_since: float | None = None

        # Figures.
        self.claims = 0
        self.takeovers = 0
        self.offlines = 0
        self.node_lost = 0
        self.dropped = 0
        self.routed = 0
        self.route_skipped = 0
        self.resyncs = 0
        self.delivered = 0
        self.rtt_last = 0.0
        self.rtt_avg = 0.0

    # ----------------------------------------------------------------- reports

    def online(self, event: PresenceEvent) -> None:
        """Queue a claim; see :meth:`Coordinator.online`."""
        if event.client_id is None or event.status != "online":
            raise ValueError("online() takes an online event with a client id")
        self._enqueue(_Report("online", event))

    def offline(self, event: PresenceEvent, *, forget: bool = False) -> None:
        """Queue an offline report; see :meth:`Coordinator.offline`."""
        if event.client_id is None or event.status != "offline":
            raise ValueError("offline() takes an offline event with a client id")
        self._enqueue(_Report("offline", event, forget=forget))

    def note(self, event: PresenceEvent) -> None:
        """Sinks only: they are this process's own, so nothing goes through Redis."""
        publish_to_sinks(self.sinks, event)

    def route(self, topic: str, payload: bytes, qos: int) -> None:
        """Queue ``topic`` for the other nodes whose subscribers' filters match it (if any)."""
        if not any(n != self.node and matches_any(f, topic) for n, f in self._remote.items()):
            self.route_skipped += 1
            return
        self._enqueue(_Report("route", topic=topic, payload=payload, qos=qos))

    def filters_changed(self, filters: set[str]) -> None:
        """Republish this node's filters (by the renewer, within a moment)."""
        self._filters = set(filters)
        self._filters_dirty = True
        self._filters_event.set()

    def _enqueue(self, report: _Report) -> None:
        if len(self._queue) >= self.queue_limit:
            # Dropping the newest keeps the order of what is kept; a resync later
            # re-claims live sessions and ends the ones whose offline was dropped.
            self.dropped += 1
            if report.kind != "route":
                self._resync = self._reconcile = True
            return
        if not self._queue:
            self._queued_since = time.monotonic()
        self._queue.append(report)
        self._wakeup.set()

    # ------------------------------------------------------------------ reads

    async def lookup(self, client_id: str) -> PresenceEvent | None:
        """The device's record, from Redis; None if unknown or Redis is unreachable."""
        if self._redis is None:
            return None
        try:
            with trio.fail_after(self.timeout):
                status, raw = await self._redis.hmget(self._dev(client_id), ["status", "event"])
        except (Exception, trio.TooSlowError) as exc:
            self._failed(exc)
            return None
        if raw is None or status == b"forgotten":
            return None
        return PresenceEvent.from_dict(json.loads(raw))

    async def drain(self) -> None:
        """Wait until every queued report was applied and this node read back what it emitted."""
        while self._queue or self._busy or self._resync or self._read_pos < self._emitted:
            await self._progress.wait()

    def health(self) -> Health:
        """Degraded while Redis is unreachable or reports wait in the queue for over a second."""
        now = time.monotonic()
        if not self._connected:
            since = 0.0 if self._down_since is None else now - self._down_since
            return Health(False, f"redis unreachable for {since:.1f} s ({self._last_error}); {len(self._queue)} queued")
        if self._queued_since is not None and self._queue and now - self._queued_since > 1.0:
            return Health(False, f"{len(self._queue)} reports queued for {now - self._queued_since:.1f} s")
        return Health(True)

    def figures(self) -> list[Metric]:
        """Claims, takeovers, node-lost events, the queue, drops, Redis round trips, connection."""
        f = Families({})
        f.counter("heartbeat_fleet_claims_total", "Online claims this node applied.", self.claims)
        f.counter("heartbeat_fleet_takeovers_total", "Claims that displaced a session held anywhere.", self.takeovers)
        f.counter("heartbeat_fleet_offline_total", "Offline reports this node published.", self.offlines)
        f.counter("heartbeat_fleet_node_lost_total", "Sessions this node declared lost (node-lost).", self.node_lost)
        f.gauge("heartbeat_fleet_queued", "Reports waiting for Redis.", len(self._queue))
        f.counter("heartbeat_fleet_dropped_total", "Reports dropped: the queue was full.", self.dropped)
        f.counter("heartbeat_fleet_routed_total", "Messages routed to other nodes.", self.routed)
        f.counter("heartbeat_fleet_route_skipped_total", "Messages no other node subscribes to.", self.route_skipped)
        f.counter("heartbeat_fleet_resyncs_total", "Re-registrations after the lease was lost.", self.resyncs)
        f.counter("heartbeat_fleet_delivered_total", "Presence events read from the stream.", self.delivered)
        f.gauge("heartbeat_fleet_redis_rtt_seconds", "Round trip of the last Redis call.", self.rtt_last)
        f.gauge("heartbeat_fleet_redis_rtt_avg_seconds", "Moving average of Redis round trips.", self.rtt_avg)
        f.gauge("heartbeat_fleet_connected", "1 while Redis answers.", 1 if self._connected else 0)
        f.gauge(
            "heartbeat_fleet_lease_gap_max_seconds",
            "Longest time between two lease renewals: near the lease, the node risks being declared lost alive.",
            self.renew_gap_max,
        )
        f.gauge("heartbeat_fleet_members", "Nodes whose filters this node knows.", len(self._remote))
        return f.families

    # -------------------------------------------------------------------- run

    async def run(self, host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve ``host`` until cancelled: renewer, stream reader, router, sweeper, flusher."""
        self._host = host
        self._filters = set(host.filters())
        redis: coredis.Redis[bytes] = coredis.Redis.from_url(
            self.url, connect_timeout=self.timeout, stream_timeout=self.timeout + 1.0
        )
        self._redis = redis
        self._s_claim = redis.register_script(_CLAIM)
        self._s_offline = redis.register_script(_OFFLINE)
        self._s_lose = redis.register_script(_LOSE)
        self._s_finish = redis.register_script(_FINISH)
        self._s_renew = redis.register_script(_RENEW)
        self._s_dead = redis.register_script(_DEAD)
        self._s_route = redis.register_script(_ROUTE)
        try:
            async with redis, trio.open_nursery() as nursery:
                nursery.start_soon(self._reader)
                nursery.start_soon(self._renewer)
                nursery.start_soon(self._sweeper)
                nursery.start_soon(self._flusher)
                # Reports are accepted (queued) from now on, whether Redis answers or not.
                task_status.started()
        finally:
            self._redis = None
            self._connected = False

    # ---------------------------------------------------------------- plumbing

    def _moved_on(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def _dev(self, client_id: str) -> str:
        return self.prefix + "dev:" + client_id

    def _ok(self, started: float) -> None:
        rtt = time.perf_counter() - started
        self.rtt_last = rtt
        self.rtt_avg = rtt if self.rtt_avg == 0.0 else 0.9 * self.rtt_avg + 0.1 * rtt
        if not self._connected:
            self._connected = True
            self._down_since = None
            logger.info("node %s: redis reachable", self.node)

    def _failed(self, exc: BaseException) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self._connected:
            logger.warning("node %s: redis unreachable: %s", self.node, self._last_error)
            self._connected = False
            self._down_since = time.monotonic()

    async def _call(self, request: Any) -> Any:
        """Await one coredis request within ``timeout``; records the round trip."""
        started = time.perf_counter()
        with trio.fail_after(self.timeout):
            result = await request
        self._ok(started)
        return result

    async def _backoff(self, attempt: int) -> None:
        await trio.sleep(min(self.renew, 0.05 * 2 ** min(attempt, 6)))

    # ---------------------------------------------------------------- flusher

    async def _flusher(self) -> None:
        await self._reader_ready.wait()  # events this node emits must not precede the reader's start
        attempt = 0
        while True:
            if not self._queue and not self._resync:
                self._queued_since = None
                await self._wakeup.wait()
                self._wakeup = trio.Event()
                continue
            try:
                if self._resync:
                    await self._resynchronise()
                else:
                    self._busy = True
                    batch = list(itertools.islice(self._queue, FLUSH_BATCH))
                    await self._apply_batch(batch)
                    # Only now are they taken off: a report whose reply was lost is sent
                    # again, which the scripts make harmless (compare-and-set on the epoch).
                    for _ in batch:
                        self._queue.popleft()
                    self._busy = False
                    self._queued_since = time.monotonic() if self._queue else None
                attempt = 0
            except (Exception, trio.TooSlowError) as exc:
                self._busy = False
                self._failed(exc)
                attempt += 1
                await self._backoff(attempt)
            self._moved_on()

    async def _apply_batch(self, batch: list[_Report]) -> None:
        """Apply reports in order, in one round trip (a pipeline of script calls).

        One call at a time capped a node at one report per round trip plus coredis's
        per-call work (about 2,000 a second here): at 10,000 devices per gateway the
        presence feed fell tens of seconds behind. A pipeline keeps the order (Redis
        runs its commands in sequence) at several times the rate.
        """
        if len(batch) == 1:
            await self._apply(batch[0])
            return
        try:
            redis = self._redis_()
            started = time.perf_counter()
            pending: list[tuple[Any, Callable[[Any], None]]] = []
            with trio.fail_after(self.timeout * 2):
                async with redis.pipeline(transaction=False) as pipe:
                    for report in batch:
                        step = self._request(report, pipe)
                        if step is not None:
                            pending.append(step)
                for request, done in pending:
                    done(await request)
            self._ok(started)
        except coredis.exceptions.ResponseError as exc:
            if "NOSCRIPT" not in str(exc):
                raise
            # Redis restarted and forgot the scripts; plain calls load them again.
            for report in batch:
                await self._apply(report)

    async def _apply(self, report: _Report) -> None:
        step = self._request(report, self._redis_())
        if step is not None:
            request, done = step
            done(await self._call(request))

    def _request(self, report: _Report, client: Any) -> tuple[Any, Callable[[Any], None]] | None:
        """The script call that applies ``report`` (on ``client``: a connection or a pipeline),
        and what to do with its reply; None if there is nothing to send."""
        if report.kind == "route":
            targets = [n for n, f in self._remote.items() if n != self.node and matches_any(f, report.topic)]
            if not targets:
                return None
            data = _encode_route(report.topic, report.payload, report.qos)
            keys = [self.prefix + "route:" + n for n in targets]

            def routed(_: Any) -> None:
                self.routed += len(targets)

            return self._s_route(keys, [data, str(ROUTE_MAXLEN), str(ROUTE_TTL_MS)], client=client), routed
        event = report.event
        assert event is not None and event.client_id is not None
        if report.kind == "online":
            client_id = event.client_id

            def claimed(out: Any) -> None:
                if not self._claimed(out) and self._host is not None:
                    # It crossed a newer session's claim from another node: that one holds the device.
                    self._host.evict(client_id, event.epoch, "a newer session holds this client id")

            return self._claim_request(event, "claim", client), claimed
        return self._offline_request(event, report.forget, client), self._offline_done

    def _claim_request(self, event: PresenceEvent, mode: str, client: Any) -> Any:
        assert event.client_id is not None
        detail = takeover_of(event, event).detail
        args = [self.prefix, self.node, event.client_id, event.epoch, _json(event), str(self.stream_maxlen), mode]
        args += [detail, repr(event.time), *_record_fields(event, self.node)]
        keys = [self._dev(event.client_id), self.k_stream, self.k_owned]
        return self._s_claim(keys, args, client=client)

    def _claimed(self, out: Any) -> bool:
        """Count a claim's reply; False if a newer session (by accept time) holds the device."""
        ids = list(out or [])
        if ids == [b"stale"]:
            return False
        if ids:
            self.claims += 1
            self.takeovers += len(ids) - 1
            self._emitted = max(self._emitted, *(_stream_id(i) for i in ids))
        return True

    async def _claim(self, event: PresenceEvent, mode: str) -> bool:
        """Apply a claim; False if a newer session (by accept time) holds the device."""
        return self._claimed(await self._call(self._claim_request(event, mode, self._redis_())))

    def _offline_request(self, event: PresenceEvent, forget: bool, client: Any) -> Any:
        assert event.client_id is not None
        ttl = str(int(self.offline_ttl * 1000))
        tomb = str(int(max(60.0, self.lease * 10) * 1000))
        args = [self.prefix, self.node, event.client_id, event.epoch, _json(event), str(self.stream_maxlen)]
        args += ["1" if forget else "0", ttl, tomb, *_record_fields(event, "")]
        keys = [self._dev(event.client_id), self.k_stream, self.k_owned]
        return self._s_offline(keys, args, client=client)

    def _offline_done(self, out: Any) -> None:
        if out:
            self.offlines += 1
            self._emitted = max(self._emitted, _stream_id(out[0]))

    async def _resynchronise(self) -> None:
        """Re-claim every session the host holds; with ``_reconcile``, end those it no longer holds."""
        assert self._host is not None
        # Taken before any await: reports made after this moment are queued behind,
        # so they apply after the re-claims (an offline never precedes its re-claim).
        sessions = self._host.sessions()
        reconcile = self._reconcile
        self._resync = self._reconcile = False
        try:
            for event in sessions:
                if event.client_id is None:
                    continue
                if not await self._claim(event, "reclaim"):
                    # A later session of this device is online elsewhere: ours is stale.
                    self._host.evict(event.client_id, event.epoch, "a newer session holds this client id")
            if reconcile:
                live = {e.client_id for e in sessions}
                # Devices with a report still queued are settled by that report (with its reason).
                live |= {r.event.client_id for r in self._queue if r.event is not None}
                owned = await self._call(self._redis_().smembers(self.k_owned))
                gone = sorted(c for c in (_text(m) for m in owned) if c not in live)
                await self._lose(self.node, gone, Offline.CONNECTION_LOST, "its offline report was dropped", False)
        except BaseException:
            self._resync = True
            self._reconcile = self._reconcile or reconcile
            raise
        self.resyncs += 1

    def _redis_(self) -> coredis.Redis[bytes]:
        if self._redis is None:
            raise RuntimeError("not running")
        return self._redis

    # ----------------------------------------------------------------- reader

    async def _reader(self) -> None:
        """Deliver every presence event, routed message and filters notice, in order, once each."""
        positioned = False
        attempt = 0
        block_ms = max(100, int(self.renew * 1000))
        keys = [self.k_stream, self.k_routes, self.k_changed]
        positions = dict.fromkeys(keys, (0, 0))
        while True:
            try:
                redis = self._redis_()
                if not positioned:
                    for key in keys:
                        last = await self._call(redis.xrevrange(key, "+", "-", count=1))
                        top = _stream_id(last[0].identifier) if last else None
                        if not self._reader_ready.is_set():
                            positions[key] = top or (0, 0)
                        elif top is None or top < positions[key]:
                            # The stream is gone or younger than what was read: Redis came
                            # back empty. Everything in the new stream is new to us.
                            positions[key] = (0, 0)
                    self._read_pos = positions[self.k_stream]
                    positioned = True
                    self._reader_ready.set()
                asked = {key: f"{ms}-{seq}" for key, (ms, seq) in positions.items()}
                with trio.fail_after(self.timeout + block_ms / 1000):
                    res = await redis.xread(asked, count=1000, block=block_ms)
                attempt = 0
                for raw_key, entries in (res or {}).items():
                    key = _text(raw_key)
                    for entry in entries:
                        positions[key] = _stream_id(entry.identifier)
                        if key == self.k_stream:
                            self._read_pos = positions[key]
                            self._handle_entry(entry.field_values)
                        elif key == self.k_routes:
                            self._deliver_routed(_bytes(entry.field_values.get(b"m", b"")))
                        else:
                            node = _text(entry.field_values.get(b"node", b""))
                            if node and node != self.node:
                                await self._refresh_filters(node)
                self._moved_on()
            except (Exception, trio.TooSlowError) as exc:
                self._failed(exc)
                positioned = False
                attempt += 1
                await self._backoff(attempt)

    def _handle_entry(self, fields: Any) -> None:
        host = self._host
        assert host is not None
        try:
            event = PresenceEvent.from_dict(json.loads(fields[b"event"]))
        except (KeyError, ValueError, TypeError):
            logger.exception("node %s: unreadable presence stream entry %r", self.node, fields)
            return
        self.delivered += 1
        origin = _text(fields.get(b"origin", b""))
        evict = _text(fields.get(b"evict", b""))
        if evict == self.node and event.client_id is not None:
            try:
                host.evict(event.client_id, event.epoch, event.detail or "reconnected")
            except Exception:
                logger.exception("node %s: evict raised", self.node)
        if origin == self.node:
            publish_to_sinks(self.sinks, event)
        if event.client_id is not None:
            try:
                host.deliver(self.presence_prefix + event.client_id, event.payload(), 0)
            except Exception:
                logger.exception("node %s: deliver raised", self.node)

    # ---------------------------------------------------------------- renewer

    def _renewed(self) -> None:
        """Note the gap since the last renewal: one near the lease means this node is
        close to being declared lost while alive (too busy, or Redis too slow)."""
        now = time.monotonic()
        if self._last_renewal is not None:
            gap = now - self._last_renewal
            self.renew_gap_max = max(self.renew_gap_max, gap)
            if gap > self.lease / 2:
                logger.warning(
                    "node %s: lease renewed %.1f s after the last (lease %.0f s)", self.node, gap, self.lease
                )
        self._last_renewal = now

    async def _renewer(self) -> None:
        """Keep the lease; register again (and resynchronise) when it was lost; publish filters."""
        attempt = 0
        while True:
            try:
                redis = self._redis_()
                args = [self.node, self._lease_token, str(int(self.lease * 1000))]
                kept = await self._call(self._s_renew([self.k_lease, self.k_members], args))
                self._renewed()
                if kept != 1:
                    if self._registered:
                        logger.warning("node %s: lease was lost; registering again and resynchronising", self.node)
                    self._registered = True
                    self._filters_dirty = True
                    self._resync = True
                    self._wakeup.set()
                if self._filters_dirty:
                    self._filters_dirty = False
                    try:
                        await self._call(redis.hset(self.k_filters, {self.node: json.dumps(sorted(self._filters))}))
                        await self._call(
                            redis.xadd(
                                self.k_changed,
                                {"node": self.node},
                                trim_strategy=coredis.PureToken.MAXLEN,
                                threshold=1000,
                                trim_operator=coredis.PureToken.APPROXIMATELY,
                            )
                        )
                    except BaseException:
                        self._filters_dirty = True
                        raise
                await self._refresh_filters()
                attempt = 0
                with trio.move_on_after(self.renew):
                    # Woken early only to publish changed filters.
                    await self._filters_event.wait()
                self._filters_event = trio.Event()
            except (Exception, trio.TooSlowError) as exc:
                self._failed(exc)
                attempt += 1
                await self._backoff(attempt)

    async def _refresh_filters(self, node: str | None = None) -> None:
        redis = self._redis_()
        if node is not None:
            raw = await self._call(redis.hget(self.k_filters, node))
            if raw is None:
                self._remote.pop(node, None)
            else:
                self._remote[node] = frozenset(json.loads(raw))
            return
        table = await self._call(redis.hgetall(self.k_filters))
        self._remote = {_text(k): frozenset(json.loads(v)) for k, v in table.items()}

    def _deliver_routed(self, data: bytes) -> None:
        assert self._host is not None
        try:
            topic, payload, qos = _decode_route(data)
        except ValueError:
            logger.warning("node %s: malformed routed message", self.node)
            return
        try:
            self._host.deliver(topic, payload, qos)
        except Exception:
            logger.exception("node %s: deliver raised", self.node)

    # ---------------------------------------------------------------- sweeper

    async def _sweeper(self) -> None:
        """Every ``renew`` seconds: declare the sessions of members whose lease lapsed lost."""
        attempt = 0
        while True:
            try:
                await trio.sleep(self.renew)
                dead = await self._call(self._s_dead([self.k_members], [self.prefix, self.node]))
                for raw in dead or []:
                    await self.sweep(_text(raw))
                attempt = 0
            except (Exception, trio.TooSlowError) as exc:
                self._failed(exc)
                attempt += 1
                await self._backoff(attempt)

    async def sweep(self, dead: str, *, lock: bool = True, batch: int = 200) -> int:
        """End every session ``dead`` held with reason ``node-lost``; returns how many this call ended.

        With ``lock`` (the sweeper's way), only whoever holds ``sweep:<dead>`` sweeps;
        the lock expires after a few leases, so a sweep whose sweeper died is resumed
        by the next node to take it. Safe to run concurrently without it.
        """
        redis = self._redis_()
        k_lock = self.prefix + "sweep:" + dead
        lock_ms = str(int(max(self.lease * 2, 1.0) * 1000))
        if lock:
            got = await self._call(redis.set(k_lock, self.node, condition=coredis.PureToken.NX, px=int(lock_ms)))
            if not got and _text(await self._call(redis.get(k_lock)) or b"") != self.node:
                return 0
        owned_key = self.prefix + "owned:" + dead
        total = 0
        while True:
            members = sorted(_text(m) for m in await self._call(redis.smembers(owned_key)))
            for i in range(0, len(members), batch):
                n = await self._lose(dead, members[i : i + batch], Offline.NODE_LOST, f"node {dead} lost", True)
                if n < 0:
                    return total  # it renewed its lease: alive after all
                total += n
            keys = [owned_key, self.prefix + "node:" + dead, self.k_members, self.k_filters, k_lock]
            keys.append(self.prefix + "route:" + dead)
            if await self._call(self._s_finish(keys, [dead, self.node])) == 1:
                break
            if not await self._call(redis.scard(owned_key)):
                break  # the lease is back (finish refused): leave the rest to the node itself
        self._remote.pop(dead, None)
        return total

    async def leave(self) -> None:
        """End what this node still holds in Redis (``shutdown``) and drop its lease.

        A worker stopping with reports still queued would otherwise leave sessions
        owned by a node nobody renews: a survivor would sweep them as ``node-lost``
        seconds later, the wrong reason for a clean stop. Compare-and-set as always,
        so a session whose report did get through is not ended twice.
        """
        if self._redis is None:
            return
        owned = sorted(_text(m) for m in await self._call(self._redis_().smembers(self.k_owned)))
        for start in range(0, len(owned), 1000):
            await self._lose(self.node, owned[start : start + 1000], Offline.SHUTDOWN, "the gateway stopped", False)
        await self._call(self._redis_().delete([self.k_lease]))  # the others finish our keys at once

    async def _lose(self, owner: str, client_ids: list[str], reason: Offline, detail: str, check_lease: bool) -> int:
        """End the online sessions of ``client_ids`` that ``owner`` holds; -1 if its lease is back."""
        if not client_ids:
            return 0
        keys = [self.k_stream, self.prefix + "owned:" + owner, self.prefix + "node:" + owner]
        keys.append(self.prefix + "sweep:" + owner)
        lock_ms = str(int(max(self.lease * 2, 1.0) * 1000))
        now = repr(round(time.time(), 3))
        args = [self.prefix, self.node, owner, str(self.stream_maxlen), reason.value, detail, now]
        args += [str(int(self.offline_ttl * 1000)), "1" if check_lease else "0", lock_ms, *client_ids]
        n = int(await self._call(self._s_lose(keys, args)))
        if n > 0:
            if reason is Offline.NODE_LOST:
                self.node_lost += n
            else:
                self.offlines += n
            # The stream's top is at least as far as what this call added.
            last = await self._call(self._redis_().xrevrange(self.k_stream, "+", "-", count=1))
            if last:
                self._emitted = max(self._emitted, _stream_id(last[0].identifier))
        return n


def _json(event: PresenceEvent) -> str:
    return json.dumps(event.to_dict(), separators=(",", ":"))
