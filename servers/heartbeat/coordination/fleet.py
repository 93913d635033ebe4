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

Persistent sessions (CleanSession=0), by client id (see :mod:`.fleet_sessions`)::

    ps:<client-id>        hash: holder (the epoch holding its connection, '' while
                          away), hnode (the holder's node), was (the last holder),
                          left (ms, Redis's clock), user, lastid (the last packet id
                          given), seq (send order), qb (bytes queued), dropping
    psub:<client-id>      hash: topic filter -> granted QoS
    pin:<client-id>       set: QoS 2 packet ids received whose PUBREL has not come
    pfl:<client-id>       hash: packet id -> a message in flight (msgpack: seq, qos,
                          retain, stage, topic, payload)
    pq:<client-id>        list: the messages queued behind the window (msgpack)
    psessions             sorted set: client id -> when it expires (ms; +inf while held)
    pheld:<node>          set: client ids whose connection the node holds
    pf:<filter>           hash: client id -> QoS, every persistent session subscribed to it
    pfilters              hash: topic filter -> how many persistent sessions hold it
    pfilters-version      counter: the number of the last ``pfilters-changed`` notice
    pfilters-changed      stream: a filter gained its first session or lost its last
                          (f filter, on 1/0, v number)
    pstats                hash: queued_bytes (over every session), dropped, expired

Retained messages::

    retained              hash: topic -> QoS digit followed by the payload
    retained-index        sorted set: every retained topic (score 0, paged by ZRANGEBYLEX)
    retained-stats        hash: bytes (topics and payloads), refused

**Persistent sessions** follow :class:`~..persistent.SessionStore`'s rules, each
change one call of the session script. A message for a connected client goes into
its holder node's route stream (``c`` client id, ``e`` epoch, ``p`` packets) and
that node's reader writes it to the connection (``Host.transmit``); one for an
absent client waits in the queue within its bounds (drops counted in ``pstats``).
A node publishing at QoS 1 or 2 calls Redis only if its cache of ``pfilters``
(kept from ``pfilters-changed``) matches the topic. A session expires
``session_expiry`` after its client left: every node's sweeper discards those
due in ``psessions`` (rather than Redis TTLs, which would leave ``pf:`` and the
byte count behind). A node declared lost has its sessions detached by the sweep
(``pheld:<node>``), unacknowledged messages kept for the resend. ``open_session``
goes through the same queue as the node's reports (so it sees them applied) and
answers None after ``open_timeout``: the CONNECT is refused (3) rather than given
an empty session that would lose the stored one. After a resynchronisation a node
attaches again the sessions it was declared lost with and still holds; one whose
session is gone (Redis restarted without its data) is closed, so that its client
learns it from CONNACK (session-present 0) and subscribes again. A batch whose
reply was lost is applied again: every session change is compare-and-set, but a
message routed twice is held twice (as a routed QoS 0 message is delivered twice).

**Retained messages** are stored by a script within ``max_retained_bytes``;
retained presence is read from the ``dev:`` records (SCAN), offline ones older
than ``presence_offline_ttl`` skipped.

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
``route``, ``note``, ``filters_changed``, ``session``, ``discard_session`` and
``retain`` return at once: reports go into a bounded queue that one task flushes
in order; while Redis is unreachable the queue holds them (past ``queue_limit``
new ones are dropped and counted, and a resynchronisation is scheduled so the
registry heals anyway). Only ``lookup``, ``open_session`` and ``retained`` wait,
each bounded by a timeout.

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
from ..broker import matches_any, topic_matches
from ..outbox import DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_WINDOW
from ..persistent import DEFAULT_EXPIRY, DEFAULT_TOTAL_QUEUED_BYTES, Attach, Detach, Discard, Opened, Report
from ..presence import Offline, PresenceEvent, PresenceSink
from ..retained import DEFAULT_MAX_BYTES, DEFAULT_MAX_COUNT
from . import Coordinator, Health, Host, publish_to_sinks
from .fleet_sessions import (
    EXPIRE_BATCH,
    NOTICE_MAXLEN,
    RETAIN_SCRIPT,
    SESSION_SCRIPT,
    FilterCache,
    FleetRetained,
    opened_from,
    retained_message,
    session_call,
    username_arg,
    username_of,
)
from .registry import takeover_of
from .retention import RetainedMessage

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
if redis.call('SCARD', KEYS[7]) > 0 then return 0 end  -- persistent sessions it still holds
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
_TRIM_NOTICES: dict[str, Any] = {
    "trim_strategy": coredis.PureToken.MAXLEN,
    "threshold": 1000,
    "trim_operator": coredis.PureToken.APPROXIMATELY,
}
_TRIM_ROUTES: dict[str, Any] = {**_TRIM_NOTICES, "threshold": ROUTE_MAXLEN}
FLUSH_BATCH = 256
"""Reports in flight at once: applied concurrently, each device's (and the routes) in order."""
STATS_EVERY = 5.0
"""Seconds between reads of the fleet-wide session and retained figures (for /metrics)."""


class _Question:
    """An ``open_session`` waiting in the queue for its answer."""

    __slots__ = ("client_id", "username", "answer", "done", "abandoned")

    def __init__(self, client_id: str, username: str | None) -> None:
        self.client_id = client_id
        self.username = username
        self.answer: Opened | None = None
        self.done = trio.Event()
        self.abandoned = False
        """Its CONNECT was refused meanwhile: nobody waits for the answer any more."""


@dataclass
class _Probe:
    """A :meth:`RedisCoordinator.settle` waiting for the nodes it probed to answer."""

    waiting: set[str]
    done: trio.Event


@dataclass(frozen=True, slots=True)
class _Report:
    """One queued report: an online/offline event, a message to route or retain, a
    persistent session's change, or the opening of one."""

    kind: str  # "online" | "offline" | "route" | "retain" | "session" | "open"
    event: PresenceEvent | None = None
    forget: bool = False
    topic: str = ""
    payload: bytes = b""
    qos: int = 0
    report: Report | None = None
    question: _Question | None = None


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

    Persistent sessions and retained messages take the options of
    :class:`~.inprocess.InProcessCoordinator`'s store and retention: ``max_qos``,
    ``max_inflight`` (the window), ``max_queued`` and ``max_queued_bytes`` per
    session, ``total_queued_bytes`` over all, ``session_expiry`` (seconds),
    ``may_read`` (the ACL per message, as :attr:`SessionStore.may_read`; None lets
    everything through), ``retain_presence``, ``presence_offline_ttl`` (None: while
    the record is kept), ``max_retained_bytes`` and ``max_retained_count``. Every node
    of a fleet should be given the same. ``open_timeout``: how long a CONNECT with
    CleanSession=0 waits for its stored session before it is refused (3).
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
        max_qos: int = 2,
        max_inflight: int = DEFAULT_WINDOW,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        total_queued_bytes: int = DEFAULT_TOTAL_QUEUED_BYTES,
        session_expiry: float = DEFAULT_EXPIRY,
        may_read: Callable[[str | None, str, str], bool] | None = None,
        retain_presence: bool = True,
        presence_offline_ttl: float | None = None,
        max_retained_bytes: int = DEFAULT_MAX_BYTES,
        max_retained_count: int = DEFAULT_MAX_COUNT,
        open_timeout: float = 1.0,
    ) -> None:
        if renew >= lease:
            raise ValueError("renew must be shorter than lease")
        if max_inflight < 1:
            raise ValueError("the window (max_inflight) must hold at least one message")
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
        self.k_held = prefix + "pheld:" + node
        self.k_pchanged = prefix + "pfilters-changed"

        self.max_qos = max_qos
        self.session_expiry = session_expiry
        self.may_read = may_read
        self.max_retained_bytes = max_retained_bytes
        self.max_retained_count = max_retained_count
        self.open_timeout = open_timeout
        # The session script's fixed arguments after (prefix, node, op).
        self._bounds = [
            str(max_inflight), str(max_queued), str(max_queued_bytes), str(total_queued_bytes),
            str(int(session_expiry * 1000)), str(ROUTE_MAXLEN), str(ROUTE_TTL_MS), str(NOTICE_MAXLEN),
        ]  # fmt: skip
        self._attached: dict[str, str] = {}  # client id -> epoch, of the persistent sessions held here
        self.persistent_filters = FilterCache()
        """The fleet's persistent sessions' filters, as this node last heard them."""
        self.retention = FleetRetained(
            prefix, presence_prefix, presence=retain_presence, offline_ttl=presence_offline_ttl
        )

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
        self._filters_version = 0  # bumped by each filters_changed
        self._filters_written = 0  # the version the renewer last wrote to Redis
        self._enqueued = 0  # reports queued, ever
        self._applied = 0  # reports the flusher has confirmed, ever
        self._probes: dict[str, _Probe] = {}
        self._probe_numbers = itertools.count(1)
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
        self.persistent_routed = 0
        self.persistent_dropped = 0
        self.persistent_expired = 0
        self.persistent_detached = 0
        self.retained_refused = 0
        self.opens_refused = 0
        # Fleet-wide, read every STATS_EVERY seconds: sessions, queued bytes, retained count and bytes.
        self.fleet_figures = (0, 0, 0, 0)

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
        """Queue ``topic`` for the other nodes whose subscribers' filters match it, and (QoS 1
        and 2) for the persistent sessions whose filters match it, if any."""
        persistent = qos > 0 and bool(self.persistent_filters.matching(topic))
        if not persistent and not any(n != self.node and matches_any(f, topic) for n, f in self._remote.items()):
            self.route_skipped += 1
            return
        self._enqueue(_Report("route", topic=topic, payload=payload, qos=qos))

    async def open_session(self, client_id: str, username: str | None = None) -> Opened | None:
        """The stored session (or a new one), in order with this node's reports; None if
        Redis does not answer within ``open_timeout`` (see :meth:`Coordinator.open_session`)."""
        question = _Question(client_id, username)
        if self._enqueue(_Report("open", question=question)):
            with trio.move_on_after(self.open_timeout):
                await question.done.wait()
        if question.answer is None:
            question.abandoned = True
            self.opens_refused += 1
        return question.answer

    def discard_session(self, client_id: str) -> None:
        """Queue the discarding of any stored session (CleanSession=1)."""
        self.session(Discard(client_id))

    def session(self, report: Report) -> None:
        """Queue a change to a persistent session; applied in order with this node's other reports."""
        # Which persistent sessions this node's connections hold, for a resynchronisation.
        if isinstance(report, Attach):
            self._attached[report.client_id] = report.epoch
        elif isinstance(report, Detach) and self._attached.get(report.client_id) == report.epoch:
            del self._attached[report.client_id]
        self._enqueue(_Report("session", report=report))

    def retain(self, topic: str, payload: bytes, qos: int) -> None:
        """Queue a retained message (an empty payload clears the topic's)."""
        self._enqueue(_Report("retain", topic=topic, payload=payload, qos=qos))

    async def retained(self, topic_filter: str, cursor: str | None) -> tuple[list[RetainedMessage], str | None]:
        """A page of the retained messages ``topic_filter`` matches, then of the devices'
        retained presence; nothing more if Redis does not answer."""
        if self._redis is None:
            return [], None
        try:
            with trio.fail_after(self.timeout * 2):
                return await self._retained_page(topic_filter, cursor)
        except (Exception, trio.TooSlowError) as exc:
            self._failed(exc)
            return [], None

    def filters_changed(self, filters: set[str]) -> None:
        """Republish this node's filters (by the renewer, within a moment)."""
        self._filters = set(filters)
        self._filters_version += 1
        self._filters_dirty = True
        self._filters_event.set()

    def settles(self) -> bool:
        """See :meth:`Coordinator.settles`: other nodes route by this one's filters."""
        return True

    async def settle(self) -> bool:
        """See :meth:`Coordinator.settle`.

        Waits until this node's reports and filters so far are in Redis, then adds a
        probe to ``filters-changed``; every other live node answers it in this node's
        route stream once it has applied all it read with it (notices of filters and
        of persistent filters alike: one ``XREAD`` sees both streams at one instant).
        False if that takes longer than ``open_timeout`` (a node stalled, or Redis down).
        """
        with trio.move_on_after(self.open_timeout):
            reports, filters = self._enqueued, self._filters_version
            while self._applied < reports or self._filters_written < filters:
                await self._progress.wait()
            redis = self._redis_()
            members = {_text(m) for m in await self._call(redis.smembers(self.k_members))}
            dead = {_text(m) for m in await self._call(self._s_dead([self.k_members], [self.prefix, self.node]))}
            others = members - dead - {self.node}
            if not others:
                return True
            token = f"{self.node}#{next(self._probe_numbers)}"
            probe = self._probes[token] = _Probe(others, trio.Event())
            try:
                await self._call(redis.xadd(self.k_changed, {"node": self.node, "probe": token}, **_TRIM_NOTICES))
                await probe.done.wait()
                return True
            finally:
                del self._probes[token]
        return False

    def _probed(self, fields: Any) -> None:
        probe = self._probes.get(_text(fields.get(b"probed", b"")))
        if probe is not None:
            probe.waiting.discard(_text(fields.get(b"node", b"")))
            if not probe.waiting:
                probe.done.set()

    async def _answer_probes(self, probes: list[tuple[str, str]]) -> None:
        redis = self._redis_()
        for node, token in probes:
            key = self.prefix + "route:" + node
            await self._call(redis.xadd(key, {"probed": token, "node": self.node}, **_TRIM_ROUTES))
            await self._call(redis.pexpire(key, ROUTE_TTL_MS))

    def _enqueue(self, report: _Report) -> bool:
        if len(self._queue) >= self.queue_limit:
            # Dropping the newest keeps the order of what is kept; a resync later
            # re-claims live sessions and ends the ones whose offline was dropped
            # (and detaches the persistent sessions this node no longer holds).
            self.dropped += 1
            if report.kind not in ("route", "retain", "open"):
                self._resync = self._reconcile = True
            return False
        if not self._queue:
            self._queued_since = time.monotonic()
        self._enqueued += 1
        self._queue.append(report)
        self._wakeup.set()
        return True

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
        # Gauges of what the fleet keeps (the same on every node, read every few seconds);
        # counters of what this node did, which add up over the fleet.
        sessions, queued_bytes, retained, retained_bytes = self.fleet_figures
        f.gauge("heartbeat_persistent_sessions", "Persistent sessions kept fleet-wide (CleanSession=0).", sessions)
        f.gauge("heartbeat_persistent_queued_bytes", "Bytes queued for persistent sessions, fleet-wide.", queued_bytes)
        f.counter(
            "heartbeat_persistent_dropped_total",
            "Messages this node's publishes dropped for a full persistent session queue or the total bound.",
            self.persistent_dropped,
        )
        f.counter(
            "heartbeat_persistent_expired_total",
            "Persistent sessions this node expired after their client stayed away.",
            self.persistent_expired,
        )
        f.counter(
            "heartbeat_persistent_routed_total",
            "QoS 1 and 2 copies this node's publishes gave persistent sessions (sent or queued).",
            self.persistent_routed,
        )
        f.counter(
            "heartbeat_persistent_detached_total",
            "Persistent sessions this node detached because the node holding them was lost or left.",
            self.persistent_detached,
        )
        f.counter(
            "heartbeat_persistent_open_refused_total",
            "CONNECTs with CleanSession=0 refused (3): Redis did not answer in time.",
            self.opens_refused,
        )
        f.gauge(
            "heartbeat_fleet_persistent_filters",
            "Persistent sessions' filters this node knows.",
            len(self.persistent_filters),
        )
        f.gauge("heartbeat_retained_messages", "Retained messages kept fleet-wide (presence not included).", retained)
        f.gauge("heartbeat_retained_bytes", "Bytes of retained topics and payloads, fleet-wide.", retained_bytes)
        f.counter(
            "heartbeat_retained_refused_total",
            "Retained messages of this node refused by the bound on retained bytes.",
            self.retained_refused,
        )
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
        self._s_session = redis.register_script(SESSION_SCRIPT)
        self._s_retain = redis.register_script(RETAIN_SCRIPT)
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
                    batch: list[_Report] = []
                    for report in itertools.islice(self._queue, FLUSH_BATCH):
                        if self._two_steps(report):
                            # Its second step depends on the first's answer: it goes alone.
                            batch = batch or [report]
                            break
                        batch.append(report)
                    await self._apply_batch(batch)
                    # Only now are they taken off: a report whose reply was lost is sent
                    # again, which the scripts make harmless (compare-and-set on the epoch).
                    for _ in batch:
                        self._queue.popleft()
                    self._applied += len(batch)
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
                        pending += self._request(report, pipe)
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
        for request, done in self._request(report, self._redis_()):
            done(await self._call(request))
        if self._two_steps(report):
            await self._route_checked(report)

    def _request(self, report: _Report, client: Any) -> list[tuple[Any, Callable[[Any], None]]]:
        """The script calls that apply ``report`` (on ``client``: a connection or a pipeline),
        each with what to do with its reply; none if there is nothing to send."""
        if report.kind == "route":
            return self._route_requests(report, client)
        if report.kind == "session":
            assert report.report is not None
            return self._session_request(report.report, client)
        if report.kind == "open":
            question = report.question
            assert question is not None
            if question.abandoned:
                return []  # refused already: a session made now would only wait to expire

            def opened(out: Any) -> None:
                question.answer = opened_from(out)
                if int(out[3]):
                    self.persistent_expired += 1
                question.done.set()

            args = [question.client_id, username_arg(question.username)]
            return [(self._session_script("open", args, client), opened)]
        if report.kind == "retain":
            return [(self._retain_request(report, client), self._retained_done(report.topic))]
        event = report.event
        assert event is not None and event.client_id is not None
        if report.kind == "online":
            client_id = event.client_id

            def claimed(out: Any) -> None:
                if not self._claimed(out) and self._host is not None:
                    # It crossed a newer session's claim from another node: that one holds the device.
                    self._host.evict(client_id, event.epoch, "a newer session holds this client id")

            return [(self._claim_request(event, "claim", client), claimed)]
        return [(self._offline_request(event, report.forget, client), self._offline_done)]

    def _route_requests(self, report: _Report, client: Any) -> list[tuple[Any, Callable[[Any], None]]]:
        out: list[tuple[Any, Callable[[Any], None]]] = []
        targets = [n for n, f in self._remote.items() if n != self.node and matches_any(f, report.topic)]
        if targets:
            data = _encode_route(report.topic, report.payload, report.qos)
            keys = [self.prefix + "route:" + n for n in targets]

            def routed(_: Any) -> None:
                self.routed += len(targets)

            out.append((self._s_route(keys, [data, str(ROUTE_MAXLEN), str(ROUTE_TTL_MS)], client=client), routed))
        if report.qos > 0 and self.may_read is None:
            filters = self.persistent_filters.matching(report.topic)
            if filters:
                args: list[str | bytes] = [report.topic, report.payload, str(report.qos), "f", *filters]
                out.append((self._session_script("route", args, client), self._persistent_routed))
        return out

    def _two_steps(self, report: _Report) -> bool:
        """Whether ``report`` routes to persistent sessions under an ACL: who may read the
        topic is decided here, between asking Redis who the sessions are and routing."""
        return (
            report.kind == "route"
            and report.qos > 0
            and self.may_read is not None
            and bool(self.persistent_filters.matching(report.topic))
        )

    async def _route_checked(self, report: _Report) -> None:
        may_read = self.may_read
        assert may_read is not None
        filters = self.persistent_filters.matching(report.topic)
        redis = self._redis_()
        args: list[str | bytes] = [report.topic, report.payload, str(report.qos), "q", *filters]
        found = await self._call(self._session_script("route", args, redis))
        allowed: list[str | bytes] = []
        for i in range(0, len(found), 3):
            client_id = _text(found[i])
            if may_read(username_of(found[i + 2]), client_id, report.topic):
                allowed += [client_id, str(int(found[i + 1]))]
        if allowed:
            args = [report.topic, report.payload, str(report.qos), "t", *allowed]
            self._persistent_routed(await self._call(self._session_script("route", args, redis)))

    def _persistent_routed(self, out: Any) -> None:
        self.persistent_routed += int(out[0])
        self.persistent_dropped += int(out[1])
        for client_id in out[2] or []:
            logger.warning(
                "node %s: persistent session %r is full: messages for it are dropped (counted)",
                self.node,
                _text(client_id),
            )

    def _session_script(self, op: str, args: Sequence[str | bytes], client: Any) -> Any:
        """A call of the session script (see :mod:`.fleet_sessions`)."""
        return self._s_session([], [self.prefix, self.node, op, *self._bounds, *args], client=client)

    def _session_request(self, report: Report, client: Any) -> list[tuple[Any, Callable[[Any], None]]]:
        call = session_call(report, self.max_qos)
        if call is None:
            return []
        op, args = call

        def pushed(out: Any) -> None:
            if int(out) < 0:
                self.persistent_dropped += 1
                if int(out) == -1:
                    logger.warning(
                        "node %s: persistent session %r is full: messages for it are dropped (counted)",
                        self.node,
                        args[0],
                    )

        return [(self._session_script(op, args, client), pushed if op == "push" else _ignore)]

    def _retain_request(self, report: _Report, client: Any) -> Any:
        args: list[str | bytes] = [self.prefix, report.topic, report.payload, str(report.qos)]
        args += [str(self.max_retained_bytes), str(self.max_retained_count)]
        return self._s_retain([], args, client=client)

    def _retained_done(self, topic: str) -> Callable[[Any], None]:
        def done(out: Any) -> None:
            if int(out) == 0:
                self.retained_refused += 1
                logger.warning("node %s: retained message on %r refused: the retained store is full", self.node, topic)

        return done

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
                else:
                    await self._reattach(event.client_id, event.epoch)
            if reconcile:
                live = {e.client_id for e in sessions}
                # Devices with a report still queued are settled by that report (with its reason).
                live |= {r.event.client_id for r in self._queue if r.event is not None}
                owned = await self._call(self._redis_().smembers(self.k_owned))
                gone = sorted(c for c in (_text(m) for m in owned) if c not in live)
                await self._lose(self.node, gone, Offline.CONNECTION_LOST, "its offline report was dropped", False)
                # Persistent sessions whose Detach may have been dropped wait for their clients.
                live |= {r.report.client_id for r in self._queue if r.report is not None}
                held = await self._call(self._redis_().smembers(self.k_held))
                await self._detach_lost(self.node, sorted(c for c in map(_text, held) if c not in live), False)
        except BaseException:
            self._resync = True
            self._reconcile = self._reconcile or reconcile
            raise
        self.resyncs += 1

    async def _reattach(self, client_id: str, epoch: str) -> None:
        """After this node registered again: a persistent session detached when it was
        declared lost is attached again (its messages resent), unless its client came back
        elsewhere; one Redis lost (restarted empty) is closed, so that its client
        reconnects, learns from CONNACK that the session is gone, and subscribes again."""
        args = [client_id, epoch]
        if int(await self._call(self._session_script("reattach", args, self._redis_()))) >= 0:
            return
        if self._attached.get(client_id) == epoch and self._host is not None:
            del self._attached[client_id]
            self._host.evict(client_id, epoch, "its persistent session was lost with Redis's data")

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
        keys = [self.k_stream, self.k_routes, self.k_changed, self.k_pchanged]
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
                    # After the positions: a change made meanwhile is in both, applied twice, harmlessly.
                    await self._load_persistent_filters()
                    positioned = True
                    self._reader_ready.set()
                asked = {key: f"{ms}-{seq}" for key, (ms, seq) in positions.items()}
                with trio.fail_after(self.timeout + block_ms / 1000):
                    res = await redis.xread(asked, count=1000, block=block_ms)
                attempt = 0
                probes: list[tuple[str, str]] = []
                for raw_key, entries in (res or {}).items():
                    key = _text(raw_key)
                    for entry in entries:
                        positions[key] = _stream_id(entry.identifier)
                        if key == self.k_stream:
                            self._read_pos = positions[key]
                            self._handle_entry(entry.field_values)
                        elif key == self.k_routes:
                            if b"c" in entry.field_values:
                                self._transmit(entry.field_values)
                            elif b"probed" in entry.field_values:
                                self._probed(entry.field_values)
                            else:
                                self._deliver_routed(_bytes(entry.field_values.get(b"m", b"")))
                        elif key == self.k_pchanged:
                            await self._persistent_filter_notice(entry.field_values)
                        else:
                            node = _text(entry.field_values.get(b"node", b""))
                            probe = entry.field_values.get(b"probe")
                            if probe is not None:
                                if node and node != self.node:
                                    probes.append((node, _text(probe)))
                            elif node and node != self.node:
                                await self._refresh_filters(node)
                # Answered once all of the read is applied, whichever stream held it.
                await self._answer_probes(probes)
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
                    version = self._filters_version
                    try:
                        await self._call(redis.hset(self.k_filters, {self.node: json.dumps(sorted(self._filters))}))
                        await self._call(redis.xadd(self.k_changed, {"node": self.node}, **_TRIM_NOTICES))
                    except BaseException:
                        self._filters_dirty = True
                        raise
                    self._filters_written = version
                    self._moved_on()
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

    def _transmit(self, fields: Any) -> None:
        """A persistent session's packets for the connection this node holds (if it still does)."""
        assert self._host is not None
        try:
            client_id, epoch, packets = _text(fields[b"c"]), _text(fields[b"e"]), _bytes(fields[b"p"])
        except KeyError:
            logger.warning("node %s: malformed session packets", self.node)
            return
        try:
            self._host.transmit(client_id, epoch, [packets])
        except Exception:
            logger.exception("node %s: transmit raised", self.node)

    async def _persistent_filter_notice(self, fields: Any) -> None:
        cache = self.persistent_filters
        version = int(fields.get(b"v", 0))
        if version <= cache.version:
            return  # already in what was read
        if version != cache.version + 1:
            await self._load_persistent_filters()  # notices were trimmed away unread
            return
        cache.set(_text(fields.get(b"f", b"")), fields.get(b"on") == b"1")
        cache.version = version

    async def _load_persistent_filters(self) -> None:
        """Read the fleet's persistent filters afresh (at start, after an outage, after a gap)."""
        redis = self._redis_()
        version = int(await self._call(redis.get(self.prefix + "pfilters-version")) or 0)
        filters: list[str] = []
        cursor: int | None = 0
        while True:
            cursor, chunk = await self._call(redis.hscan(self.prefix + "pfilters", cursor, count=1000))
            filters += [_text(f) for f in chunk]
            if not cursor:
                break
        self.persistent_filters.replace(filters, version)

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
        """Every ``renew`` seconds: declare the sessions of members whose lease lapsed lost,
        discard the persistent sessions that expired; every few seconds, read the figures."""
        attempt = 0
        next_figures = 0.0
        while True:
            try:
                await trio.sleep(self.renew)
                dead = await self._call(self._s_dead([self.k_members], [self.prefix, self.node]))
                for raw in dead or []:
                    await self.sweep(_text(raw))
                await self.expire_sessions()
                if time.monotonic() >= next_figures:
                    next_figures = time.monotonic() + STATS_EVERY
                    await self.refresh_figures()
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
        held_key = self.prefix + "pheld:" + dead
        while True:
            members = sorted(_text(m) for m in await self._call(redis.smembers(owned_key)))
            for i in range(0, len(members), batch):
                n = await self._lose(dead, members[i : i + batch], Offline.NODE_LOST, f"node {dead} lost", True)
                if n < 0:
                    return total  # it renewed its lease: alive after all
                total += n
            # Its persistent sessions wait for their clients, unacknowledged messages kept.
            held = sorted(_text(m) for m in await self._call(redis.smembers(held_key)))
            for i in range(0, len(held), batch):
                if await self._detach_lost(dead, held[i : i + batch], True) < 0:
                    return total
            keys = [owned_key, self.prefix + "node:" + dead, self.k_members, self.k_filters, k_lock]
            keys += [self.prefix + "route:" + dead, held_key]
            if await self._call(self._s_finish(keys, [dead, self.node])) == 1:
                break
            if not await self._call(redis.scard(owned_key)) and not await self._call(redis.scard(held_key)):
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
        held = sorted(_text(m) for m in await self._call(self._redis_().smembers(self.k_held)))
        for start in range(0, len(held), 1000):
            await self._detach_lost(self.node, held[start : start + 1000], False)
        await self._call(self._redis_().delete([self.k_lease]))  # the others finish our keys at once

    async def _detach_lost(self, owner: str, client_ids: list[str], check_lease: bool) -> int:
        """Detach the persistent sessions of ``client_ids`` that ``owner`` holds; -1 if its
        lease is back (with ``check_lease``)."""
        if not client_ids:
            return 0
        args = [owner, "1" if check_lease else "0", *client_ids]
        n = int(await self._call(self._session_script("lose", args, self._redis_())))
        if n > 0:
            self.persistent_detached += n
        return n

    async def expire_sessions(self) -> int:
        """Discard the persistent sessions whose clients stayed away past ``session_expiry``;
        returns how many this call discarded. Every node runs it (a script: never twice)."""
        total = 0
        while True:
            expired, examined = await self._call(self._session_script("expire", [str(EXPIRE_BATCH)], self._redis_()))
            total += int(expired)
            if int(examined) < EXPIRE_BATCH:
                break
        if total:
            self.persistent_expired += total
            logger.info("node %s: %d persistent sessions expired (their clients stayed away)", self.node, total)
        return total

    async def refresh_figures(self) -> None:
        """Read the fleet-wide figures of persistent sessions and retained messages."""
        redis = self._redis_()
        async with redis.pipeline(transaction=False) as pipe:
            requests = [
                pipe.zcard(self.prefix + "psessions"),
                pipe.hget(self.prefix + "pstats", "queued_bytes"),
                pipe.hlen(self.prefix + "retained"),
                pipe.hget(self.prefix + "retained-stats", "bytes"),
            ]
        with trio.fail_after(self.timeout):
            sessions, queued, retained, retained_bytes = [await r for r in requests]
        self.fleet_figures = (int(sessions or 0), int(queued or 0), int(retained or 0), int(retained_bytes or 0))

    async def _retained_page(self, topic_filter: str, cursor: str | None) -> tuple[list[RetainedMessage], str | None]:
        """See :meth:`retained`: the store first (``s:`` cursors), then presence (``p:``)."""
        redis = self._redis_()
        rt = self.retention
        out: list[RetainedMessage] = []
        if cursor is None or cursor.startswith("s:"):
            after = None if cursor is None else cursor[2:]
            if "+" not in topic_filter and "#" not in topic_filter:
                if after is None:
                    value = await self._call(redis.hget(rt.k_retained, topic_filter))
                    if value is not None:
                        out.append(retained_message(topic_filter, value))
            else:
                low, high, parent = rt.store_range(topic_filter, after)
                if parent is not None and after is None:
                    value = await self._call(redis.hget(rt.k_retained, parent))
                    if value is not None:
                        out.append(retained_message(parent, value))
                found = await self._call(
                    redis.zrange(rt.k_index, low, high, sortby=coredis.PureToken.BYLEX, offset=0, count=rt.page + 1)
                )
                walked = [_text(t) for t in found]
                page = walked[: rt.page]
                matched = [t for t in page if topic_matches(topic_filter, t)]
                if matched:
                    values = await self._call(redis.hmget(rt.k_retained, matched))
                    out += [retained_message(t, v) for t, v in zip(matched, values, strict=True) if v is not None]
                if len(walked) > rt.page:
                    return out, "s:" + page[-1]
            if not rt.presence_possible(topic_filter):
                return out, None
            exact = rt.exact_presence(topic_filter)
            if exact is not None:
                status, raw = await self._call(redis.hmget(self._dev(exact), ["status", "event"]))
                message = rt.presence_message(exact, status, raw, time.time())
                return out + ([message] if message is not None else []), None
            return out, "p:0"
        if not cursor.startswith("p:"):
            return [], None
        scan_cursor, keys = await self._call(
            redis.scan(int(cursor[2:]), match=rt.scan_pattern(topic_filter), count=rt.page)
        )
        records: list[Any] = []
        if keys:
            async with redis.pipeline(transaction=False) as pipe:
                requests = [pipe.hmget(k, ["status", "event"]) for k in keys]
            with trio.fail_after(self.timeout):
                records = [await r for r in requests]
        out = rt.presence_page(topic_filter, keys, records)
        return out, (f"p:{scan_cursor}" if scan_cursor else None)

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


def _ignore(_: Any) -> None:
    return
