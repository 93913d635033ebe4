"""The coordinator of a fleet of gateways sharing one Redis (≥ 7), through coredis.

Every worker process of every gateway is one *node* of the fleet and talks to
Redis itself. The registry's rules (:mod:`..registry`) are applied by Lua scripts,
so each decision (claim, offline, loss) and the presence events it emits are one
atomic step on the server, whichever node asks and however often it retries.

:class:`RedisCoordinator` is the :class:`~.Coordinator` the worker sees; each job is
a module of its own:

- :mod:`.keys`: the keys in Redis (every one is listed there) and stream bounds;
- :mod:`.scripts` (and ``lua/``): the Lua scripts;
- :mod:`.link`: the connection, timed calls, whether Redis answers;
- :mod:`.queue` and :mod:`.flusher`: the reports, queued and applied in order;
- :mod:`.claims`: who holds a client id (claims, offlines, takeovers, resynchronisation);
- :mod:`.leases` and :mod:`.sweep`: node liveness, and declaring a node lost;
- :mod:`.filters` and :mod:`.routes`: who subscribes to what, and routing;
- :mod:`.reader`: the presence stream, routed messages and notices, read back;
- :mod:`.sessions` and :mod:`.retained`: persistent sessions, retained messages;
- :mod:`.metrics`: the figures; :mod:`.duties`: a task one node performs at a time.

**Nothing blocks the worker.** :meth:`RedisCoordinator.online`, ``offline``, ``route``,
``note``, ``filters_changed``, ``session``, ``discard_session`` and ``retain`` return at
once: reports go into a bounded queue that one task flushes in order; while Redis is
unreachable the queue holds them (past ``queue_limit`` new ones are dropped and counted,
and a resynchronisation is scheduled so the registry heals anyway). Only ``lookup``,
``open_session`` and ``retained`` wait, each bounded by a timeout; and a PUBACK whose
message changed what Redis keeps waits for Redis to have it
(:meth:`RedisCoordinator.committed`). ``open_session`` goes through the queue too (so it
sees the node's reports applied) and answers None after ``open_timeout``: a CONNECT
refused (3) loses no stored session.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import trio

from ....prometheus import Metric
from ...broker.outbox import DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_WINDOW
from ...broker.persistent import DEFAULT_EXPIRY, DEFAULT_MAX_SESSIONS, DEFAULT_TOTAL_QUEUED_BYTES
from ...broker.reports import Attach, Detach, Discard, Opened, Report
from ...broker.retained import DEFAULT_MAX_BYTES, DEFAULT_MAX_COUNT, DEFAULT_MAX_OWNER_BYTES, DEFAULT_MAX_OWNER_COUNT
from ...mqtt.policy import DEFAULT_PRESENCE_PREFIX
from ...mqtt.publication import Publication
from ...presence.event import PresenceEvent, PresenceSink
from ...presence.overview import RecentEnds
from .. import Coordinator, Health, Host, publish_to_sinks
from ..retention import RetainedMessage
from .claims import Claims
from .duties import DutyLease
from .filters import Filters
from .flusher import Flusher
from .keys import FleetKeys
from .leases import LeaseKeeper
from .link import RedisLink, first_of
from .lookups import device_record, fleet_overview
from .metrics import FleetCounts, fleet_families, read_fleet_figures
from .queue import OpenQuestion, Queued, ReportQueue
from .reader import StreamReader
from .retained import FleetRetained
from .routes import Routes
from .sessions import PersistentSessions
from .sweep import Sweeper

__all__ = ["RedisCoordinator"]

logger = logging.getLogger("servers.heartbeat.coordination.fleet")


class RedisCoordinator(Coordinator, FleetCounts):
    """Shares the registry, presence events and subscriptions of a fleet through Redis.

    ``node`` names this worker process fleet-wide and must be unique and not reused
    by a later process (say ``"gw1.example:1883/w0/pid4242"``): the lease, the owned
    set and the eviction of taken-over sessions are keyed by it. ``lease`` is how
    long the node counts as alive without renewing; it renews every ``renew``
    seconds and checks the other members' leases as often. ``offline_ttl``: how
    long an offline device's record is kept (0: forever); ``once_ttl``: how long,
    when its client id had a single session (a flood of made-up ids must not keep
    Redis full for a week; 0: as long as the others).

    Persistent sessions and retained messages take the options of
    :class:`~..inprocess.InProcessCoordinator`'s store and retention: ``max_qos``, ``max_inflight``
    (the window) and ``max_inflight_bytes``, ``max_queued`` and ``max_queued_bytes`` per session,
    ``total_queued_bytes`` over all, ``session_expiry`` (seconds), ``may_read`` (the ACL per
    message, as :attr:`SessionStore.may_read`; None lets everything through), ``retain_presence``,
    ``presence_offline_ttl`` (None: while the record is kept), ``max_retained_bytes`` and
    ``max_retained_count``, and each client's share, ``max_retained_per_client`` and
    ``max_retained_bytes_per_client``. Every node of a fleet should be given the same.
    ``open_timeout``: how long a CONNECT with CleanSession=0 waits for its stored session before
    it is refused (3). Its figures (:class:`~.metrics.FleetCounts`) are its attributes.
    """

    def __init__(
        self,
        url: str,
        node: str,
        *,
        sinks: Sequence[PresenceSink] = (),
        presence_prefix: str = DEFAULT_PRESENCE_PREFIX,
        prefix: str = "idlekeeper:",
        lease: float = 3.0,
        renew: float = 1.0,
        stream_maxlen: int = 100_000,
        queue_limit: int = 100_000,
        offline_ttl: float = 7 * 86400.0,
        once_ttl: float = 86400.0,
        timeout: float = 2.0,
        max_qos: int = 2,
        max_inflight: int = DEFAULT_WINDOW,
        max_inflight_bytes: int = 0,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        total_queued_bytes: int = DEFAULT_TOTAL_QUEUED_BYTES,
        session_expiry: float = DEFAULT_EXPIRY,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        may_read: Callable[[str | None, str, str], bool] | None = None,
        retain_presence: bool = True,
        presence_offline_ttl: float | None = None,
        max_retained_bytes: int = DEFAULT_MAX_BYTES,
        max_retained_count: int = DEFAULT_MAX_COUNT,
        max_retained_per_client: int = DEFAULT_MAX_OWNER_COUNT,
        max_retained_bytes_per_client: int = DEFAULT_MAX_OWNER_BYTES,
        open_timeout: float = 1.0,
    ) -> None:
        if renew >= lease:
            raise ValueError("renew must be shorter than lease")
        if max_inflight < 1:
            raise ValueError("the window (max_inflight) must hold at least one message")
        FleetCounts.__init__(self)
        self.node = node
        self.sinks = list(sinks)
        self.presence_prefix = presence_prefix
        self.timeout = timeout
        self.open_timeout = open_timeout
        self._progress = trio.Event()  # set (and replaced) whenever the flusher, reader or renewer moved on

        self.link = link = RedisLink(url, node, timeout=timeout, renew=renew)
        if link.target.cluster and "{" in prefix:
            raise ValueError(f"prefix {prefix!r}: on Redis Cluster the prefix may not hold '{{' (hash tags follow it)")
        self.keys = keys = FleetKeys(prefix, node, link.target.shards)
        self.reports = ReportQueue(self, limit=queue_limit)
        self.filters = filters = Filters(link, keys, node=node)
        self.sessions = PersistentSessions(
            link,
            keys,
            self,
            node=node,
            max_qos=max_qos,
            window=max_inflight,
            window_bytes=max_inflight_bytes,
            max_queued=max_queued,
            max_queued_bytes=max_queued_bytes,
            total_queued_bytes=total_queued_bytes,
            expiry=session_expiry,
            max_sessions=max_sessions,
        )
        self.retention = FleetRetained(
            link,
            keys,
            self,
            presence_prefix=presence_prefix,
            presence=retain_presence,
            offline_ttl=presence_offline_ttl,
            max_bytes=max_retained_bytes,
            max_count=max_retained_count,
            max_owner_count=max_retained_per_client,
            max_owner_bytes=max_retained_bytes_per_client,
        )
        # Not ``claims``: that is the counter of claims applied.
        self.ownership = Claims(
            link,
            keys,
            self,
            node=node,
            lease=lease,
            stream_maxlen=stream_maxlen,
            offline_ttl=offline_ttl,
            once_ttl=once_ttl,
        )
        self.lease_keeper = LeaseKeeper(link, keys, self, node=node, lease=lease, renew=renew)
        self.sweeper = Sweeper(link, keys, self.ownership, self.sessions, filters, node=node)
        self.routes = Routes(link, keys, self, filters, self.sessions, node=node, may_read=may_read)
        self.recent = RecentEnds()
        """The latest ends of the whole fleet, as this node's reader reads them."""
        self.reader = StreamReader(
            link,
            keys,
            self,
            filters,
            node=node,
            sinks=self.sinks,
            seen=self.recent,
            presence_prefix=presence_prefix,
            offline_ttl=presence_offline_ttl,
            retain_presence=retain_presence,
            moved_on=self._moved_on,
        )
        self.flusher = Flusher(
            link,
            self.reports,
            self.ownership,
            self.routes,
            self.sessions,
            self.retention,
            reader_ready=self.reader.ready,
            moved_on=self._moved_on,
            extend_lease=self.lease_keeper.extend_request,
        )
        # What the per-message calls below use, bound once.
        self._enqueue = self.reports.put
        self._queue = self.reports.items
        self._remote = filters.remote
        self.shares = filters.shares
        self._attached = self.sessions.attached
        self.persistent_filters = filters.persistent
        """The fleet's persistent sessions' filters, as this node last heard them."""

    # ----------------------------------------------------------------- reports

    def online(self, event: PresenceEvent) -> None:
        """Queue a claim; see :meth:`Coordinator.online`."""
        if event.client_id is None or event.status != "online":
            raise ValueError("online() takes an online event with a client id")
        self._enqueue(Queued("online", event))

    def offline(self, event: PresenceEvent, *, forget: bool = False) -> None:
        """Queue an offline report; see :meth:`Coordinator.offline`."""
        if event.client_id is None or event.status != "offline":
            raise ValueError("offline() takes an offline event with a client id")
        self._enqueue(Queued("offline", event, forget=forget))

    def note(self, event: PresenceEvent) -> None:
        """Sinks only: they are this process's own, so nothing goes through Redis."""
        publish_to_sinks(self.sinks, event)

    def route(self, message: Publication, groups: Sequence[str] = (), *, origin: str = "") -> Sequence[str]:
        """Queue ``message`` for the other nodes whose subscribers' filters match it, and (QoS 1
        and 2) for the persistent sessions whose filters match it, if any. Each shared
        subscription the topic reaches goes to one node holding it, in turn (this node
        keeps those it serves itself: the return). ``origin``, the publisher's client
        id, is for the No Local of its own persistent session."""
        topic = message.topic
        mine, shares = self.shares.pick(topic, groups)
        persistent = message.qos > 0 and bool(self.persistent_filters.matching(topic))
        if (
            not persistent
            and not shares
            and not any(n != self.node and f.matches_plain(topic) for n, f in self._remote.items())
        ):
            self.route_skipped += 1
            return mine
        self._enqueue(self._route(message, shares=shares, origin=origin))
        return mine

    @staticmethod
    def _route(message: Publication, *, shares: dict[str, list[str]], origin: str = "", plain: bool = True) -> Queued:
        """A "route" report of a message."""
        m = message
        return Queued(
            "route",
            topic=m.topic,
            payload=m.payload,
            qos=m.qos,
            properties=m.properties,
            retain=m.retain,
            shares=shares,
            origin=origin,
            plain=plain,
        )

    def pass_on(self, message: Publication, group: str) -> bool:
        """See :meth:`Coordinator.pass_on`: to another gateway holding the group, in turn."""
        node = self.shares.elsewhere(message.topic, group)
        if node is None:
            return False
        return self._enqueue(self._route(message, shares={node: [group]}, plain=False))

    async def open_session(
        self,
        client_id: str,
        username: str | None = None,
        v5: bool = False,
        *,
        expiry: int | None = None,
        create: bool = True,
    ) -> Opened | None:
        """The stored session (or a new one), in order with this node's reports; None if
        Redis does not answer within ``open_timeout`` (see :meth:`Coordinator.open_session`)."""
        question = OpenQuestion(client_id, username, v5, expiry, create)
        if self._enqueue(Queued("open", question=question)):
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
        self._enqueue(Queued("session", report=report))

    def retain(self, topic: str, payload: bytes, qos: int, owner: str = "", properties: bytes = b"") -> None:
        """Queue a retained message from client ``owner`` (an empty payload clears the topic's)."""
        self._enqueue(Queued("retain", topic=topic, payload=payload, qos=qos, owner=owner, properties=properties))

    async def retained(self, topic_filter: str, cursor: str | None) -> tuple[list[RetainedMessage], str | None]:
        """A page of the retained messages ``topic_filter`` matches, then of the devices'
        retained presence; nothing more if Redis does not answer."""
        if self.link.client is None:
            return [], None
        try:
            with trio.fail_after(self.timeout * 2):
                return await self.retention.read(topic_filter, cursor)
        except (Exception, trio.TooSlowError) as exc:
            self.link.failed(exc)
            return [], None

    def filters_changed(self, added: Collection[str], removed: Collection[str] = ()) -> None:
        """Republish this node's filters (by the renewer, within a moment)."""
        self.filters.change(added, removed)

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
            reports, filters = self.reports.enqueued, self.filters.version
            while self.reports.applied < reports or self.filters.written < filters:
                await self._progress.wait()
            members = await self.lease_keeper.members()
            dead = set(await self.lease_keeper.lapsed())
            others = members - dead - {self.node}
            if others:
                await self.filters.probe(others)
            return True
        return False

    def commit_mark(self) -> int | None:
        """See :meth:`Coordinator.commit_mark`: the reports queued, while Redis lacks some."""
        reports = self.reports
        return reports.enqueued if reports.applied < reports.enqueued else None

    async def committed(self, mark: int) -> bool:
        """See :meth:`Coordinator.committed`; False after ``open_timeout`` (Redis down, stalled)."""
        with trio.move_on_after(self.open_timeout):
            while self.reports.applied < mark:
                await self._progress.wait()
            return True
        return False

    # ------------------------------------------------------------------ reads

    async def lookup(self, client_id: str) -> PresenceEvent | None:
        """The device's record, from Redis; None if unknown or Redis is unreachable."""
        return await device_record(self.link, self.keys, client_id)

    async def overview(self, query: str = "", limit: int = 100) -> dict[str, Any] | None:
        """See :meth:`Coordinator.overview` and :func:`.lookups.fleet_overview`."""
        members = self.lease_keeper.members
        return await fleet_overview(self.link, self.keys, members, self.recent, query, limit)

    async def drain(self) -> None:
        """Wait until every queued report was applied and this node read back what it emitted."""
        reports = self.reports
        while self._queue or reports.busy or reports.resync or not self.reader.caught_up(self.ownership.emitted):
            await self._progress.wait()

    def health(self) -> Health:
        """Degraded while Redis is unreachable or reports wait in the queue for over a second."""
        now = time.monotonic()
        link, queued_since = self.link, self.reports.queued_since
        if not link.connected:
            since = 0.0 if link.down_since is None else now - link.down_since
            return Health(False, f"redis unreachable for {since:.1f} s ({link.last_error}); {len(self._queue)} queued")
        if queued_since is not None and self._queue and now - queued_since > 1.0:
            return Health(False, f"{len(self._queue)} reports queued for {now - queued_since:.1f} s")
        return Health(True)

    def figures(self) -> list[Metric]:
        """Claims, takeovers, node-lost events, the queue, drops, Redis round trips, connection."""
        queued, members, persistent = len(self._queue), len(self._remote), len(self.persistent_filters)
        return fleet_families(self, self.link, queued=queued, members=members, persistent_filters=persistent)

    async def refresh_figures(self) -> None:
        """Read the fleet-wide figures of persistent sessions and retained messages."""
        self.fleet_figures = await read_fleet_figures(self.link, self.keys)

    # ------------------------------------------------------------ fleet duties

    async def sweep(self, dead: str, *, lock: bool = True, batch: int = 200) -> int:
        """End every session ``dead`` held with reason ``node-lost`` (see :meth:`.Sweeper.sweep`);
        returns how many this call ended."""
        return await self.sweeper.sweep(dead, lock=lock, batch=batch)

    def duty(self, name: str) -> DutyLease:
        """See :meth:`Coordinator.duty`: a lease in Redis, as long as this node's."""
        return DutyLease(self.link, self.keys, self.node, name, self.lease_keeper.lease)

    async def expire_sessions(self) -> int:
        """Discard the persistent sessions whose clients stayed away past ``session_expiry``;
        returns how many this call discarded. Every node runs it (a script: never twice)."""
        return await self.sessions.expire()

    async def leave(self) -> None:
        """End what this node still holds in Redis (``shutdown``) and drop its lease
        (see :meth:`.Sweeper.leave`); with Redis down, leave without it, in one WARNING
        (see :meth:`.Sweeper.leave_within`)."""
        await self.sweeper.leave_within(self.reports)

    # -------------------------------------------------------------------- run

    async def run(self, host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve ``host`` until cancelled: renewer, stream reader, router, sweeper, flusher."""
        self.filters.own = set(host.filters())
        self.shares.changed(self.filters.own)
        redis = self.link.connect()
        try:
            async with redis, trio.open_nursery() as nursery:
                nursery.start_soon(self.reader.run, host)
                nursery.start_soon(self.lease_keeper.keep, self.filters, self.reports, self._moved_on)
                nursery.start_soon(self.sweeper.run, self.lease_keeper, self.refresh_figures)
                nursery.start_soon(self.flusher.run, host)
                await self._join()
                # Reports are accepted (queued) from now on, whether Redis answers or not.
                task_status.started()
        finally:
            self.link.disconnected()

    async def _join(self) -> None:
        """Wait until this node is a member the others see and reads what they send it.

        The worker listens once :meth:`run` has started: before this node's lease is
        written, another node's :meth:`settle` does not wait for it, and before its
        reader and renewer have read the others' filters, it routes by none of them, so
        a reply published through it to a subscriber just answered elsewhere is lost.
        At most ``open_timeout``, and no longer than Redis answers: a fleet starts with
        Redis slow or down (reports are queued), only not yet routing by the others."""
        with trio.move_on_after(self.open_timeout):
            await first_of(self._joined, self.link.unreachable.wait)
        if not self._is_member():
            link = self.link
            why = f"redis unreachable: {link.last_error}" if link.unreachable.is_set() else "redis is slow"
            logger.warning(
                "node %s: serving before the fleet counts it a member (%s; waited at most %.1f s): "
                "messages published here may miss other gateways' new subscribers until it is",
                self.node,
                why,
                self.open_timeout,
            )

    async def _joined(self) -> None:
        """Until the reader is positioned and the renewer's first round was answered."""
        await self.reader.ready.wait()
        await self.lease_keeper.joined.wait()

    def _is_member(self) -> bool:
        """Whether the lease was written and the streams' reading positioned."""
        return self.reader.ready.is_set() and self.lease_keeper.joined.is_set()

    def progress(self) -> int:
        """See :meth:`Coordinator.progress`: reports applied and events read."""
        return self.reports.applied + self.delivered + self.repeated_ends + self.repeated_onlines

    def _moved_on(self) -> None:
        self._progress.set()
        self._progress = trio.Event()
