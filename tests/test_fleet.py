"""RedisCoordinator: a fleet of nodes on one real ``redis-server`` (never a mock).

Each node is a :class:`RedisCoordinator` attached to a :class:`RecordingHost`.
Real time and real I/O: every wait is bounded by ``trio.fail_after``, and the
lease is short (0.6 s) so that node loss and restarts take well under a second.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import coredis
import pytest
import trio

from servers.heartbeat.coordination.fleet import RedisCoordinator
from servers.heartbeat.coordination.fleet.claims import event_json
from servers.heartbeat.coordination.fleet.filters import Filters
from servers.heartbeat.coordination.fleet.keys import FleetKeys
from servers.heartbeat.coordination.fleet.link import RedisLink
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.presence.event import PresenceEvent

from .redis_server import RedisServer, require_binary

IN_CI = os.environ.get("CI") == "true"
LEASE = 0.6
RENEW = 0.2
PREFIX = "idlekeeper:"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(binary=require_binary())
    server.start()
    yield server
    server.stop()


# ------------------------------------------------------------------- the host


@dataclass
class RecordingHost:
    """Records what a coordinator asks of its worker; its sessions are a dict the test edits."""

    live: dict[str, PresenceEvent] = field(default_factory=dict)
    subscribed: set[str] = field(default_factory=set)
    delivered: list[tuple[str, bytes, int]] = field(default_factory=list)
    transmitted: list[tuple[str, str, list[bytes]]] = field(default_factory=list)
    evicted: list[tuple[str, str, str]] = field(default_factory=list)
    properties: list[bytes] = field(default_factory=list)
    """The MQTT 5 properties of each delivered message, in step with ``delivered``."""
    retains: list[bool] = field(default_factory=list)
    """The retain flag each was published with, in step with ``delivered``."""
    groups: list[tuple[str, ...] | None] = field(default_factory=list)
    """The shared subscriptions each was for, in step with ``delivered``."""

    def deliver(self, message: Publication, groups: Collection[str] | None = None, plain: bool = True) -> None:
        self.delivered.append((message.topic, message.payload, message.qos))
        self.properties.append(message.properties)
        self.retains.append(message.retain)
        self.groups.append(None if groups is None else tuple(groups))

    def evict(self, client_id: str, epoch: str, detail: str) -> None:
        self.evicted.append((client_id, epoch, detail))

    def sessions(self) -> list[PresenceEvent]:
        return list(self.live.values())

    def filters(self) -> set[str]:
        return set(self.subscribed)

    def transmit(self, client_id: str, epoch: str, packets: list[bytes], v5: bool = False) -> None:
        self.transmitted.append((client_id, epoch, packets))

    def presence(self, client_id: str | None = None) -> list[PresenceEvent]:
        """The presence events delivered here, in order (of one device, if given)."""
        import json

        out = [PresenceEvent.from_dict(json.loads(p)) for t, p, _ in self.delivered if t.startswith(PRESENCE)]
        return [e for e in out if client_id is None or e.client_id == client_id]

    def messages(self) -> list[tuple[str, bytes]]:
        return [(t, p) for t, p, _ in self.delivered if not t.startswith(PRESENCE)]


@dataclass
class Node:
    coord: RedisCoordinator
    host: RecordingHost
    scope: trio.CancelScope
    sunk: list[PresenceEvent]

    @property
    def name(self) -> str:
        return self.coord.node

    def online(self, client_id: str, epoch: str, at: float | None = None) -> PresenceEvent:
        event = PresenceEvent(
            "online", client_id, "10.0.0.1:5000", None, 0.0, round(time.time() if at is None else at, 3),
            epoch=epoch, node=self.name, keep_alive=30,
        )  # fmt: skip
        self.host.live[client_id] = event
        self.coord.online(event)
        return event

    def offline(self, client_id: str, epoch: str, reason: Offline = Offline.DISCONNECT) -> PresenceEvent:
        event = PresenceEvent(
            "offline", client_id, "10.0.0.1:5000", reason, 0.0, round(time.time(), 3), epoch=epoch, node=self.name
        )
        if client_id in self.host.live and self.host.live[client_id].epoch == epoch:
            del self.host.live[client_id]
        self.coord.offline(event)
        return event


@asynccontextmanager
async def fleet(url: str, *names: str, **options: Any) -> AsyncIterator[list[Node]]:
    """Nodes named ``names``, each running in a cancel scope of its own (to kill one)."""
    options = {"lease": LEASE, "renew": RENEW, **options}
    async with trio.open_nursery() as nursery:
        nodes = []
        for name in names:
            sunk: list[PresenceEvent] = []
            coord = RedisCoordinator(url, name, sinks=[sunk.append], **options)
            host = RecordingHost()
            scope = trio.CancelScope()
            nodes.append(Node(coord, host, scope, sunk))

            async def serve(
                coord: RedisCoordinator, host: RecordingHost, scope: trio.CancelScope, *, task_status: Any
            ) -> None:
                with scope:
                    await coord.run(host, task_status=task_status)

            await nursery.start(serve, coord, host, scope)
        try:
            yield nodes
        finally:
            nursery.cancel_scope.cancel()


async def until(predicate: Callable[[], bool], limit: float = 5.0) -> None:
    """Wait (polling) until ``predicate()`` holds; fails the test after ``limit`` s."""
    with trio.fail_after(limit):
        while True:
            if predicate():
                return
            await trio.sleep(0.01)


async def lease_gone(r: coredis.Redis[bytes], node: str) -> None:
    """Wait until ``node``'s lease key has expired."""
    with trio.fail_after(5):
        for _ in range(1000):
            if not await r.exists([PREFIX + "node:" + node]):
                return
            await trio.sleep(0.01)


async def drain(*nodes: Node, settle: float = 0.1) -> None:
    """Every node applied its reports and read back its events; then a moment for the others to read."""
    with trio.fail_after(5):
        for n in nodes:
            await n.coord.drain()
    await trio.sleep(settle)


async def stream_events(url: str) -> list[PresenceEvent]:
    import json

    async with coredis.Redis.from_url(url) as r:
        entries = await r.xrange(PREFIX + "presence")
    return [PresenceEvent.from_dict(json.loads(e.field_values[b"event"])) for e in entries]


def statuses(events: list[PresenceEvent]) -> list[tuple[str, str, str | None]]:
    return [(e.status, e.epoch, None if e.reason is None else e.reason.value) for e in events]


# ------------------------------------------------------------------ the tests


async def test_online_and_offline_reach_every_node_once(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", "c") as (a, b, c):
        on = a.online("dev-1", "e1")
        await until(lambda: all(len(n.host.presence("dev-1")) == 1 for n in (a, b, c)))
        a.coord.online(on)  # a resend (after a lost reply): a no-op
        off = a.offline("dev-1", "e1")
        a.coord.offline(off)  # a second report of the same end: dropped
        await drain(a, b, c)
        for n in (a, b, c):
            assert statuses(n.host.presence("dev-1")) == [("online", "e1", None), ("offline", "e1", "disconnect")]
            assert n.host.presence("dev-1")[0] == on
        # The emitting node's sinks (the presence log) get each event once; the others' none.
        assert statuses(a.sunk) == [("online", "e1", None), ("offline", "e1", "disconnect")]
        assert b.sunk == c.sunk == []
        # An ended session never comes back by a late resend of its online report.
        a.coord.online(on)
        await drain(a, b, c)
        assert len(c.host.presence("dev-1")) == 2
        assert await c.coord.lookup("dev-1") == off
        assert a.coord.claims == 1 and a.coord.offlines == 1


async def test_a_sessions_end_written_twice_after_a_failover_is_delivered_and_logged_once(
    redis_server: RedisServer,
) -> None:
    async with fleet(redis_server.url, "a", "b") as (a, b):
        a.online("dev-1", "e1")
        off = a.offline("dev-1", "e1")
        await drain(a, b)
        # What a reconcile on a promoted replica writes when the old primary took this end
        # in its last moments: the same session's end again, in the stream.
        again = dataclasses.replace(off, reason=Offline.CONNECTION_LOST, detail="its offline report was dropped")
        async with coredis.Redis.from_url(redis_server.url) as r:
            fields = {"event": event_json(again), "origin": "a", "evict": ""}
            await r.xadd(PREFIX + "presence", fields)
        a.online("dev-2", "f1")  # something after it, to know it was read
        await drain(a, b)
        await until(lambda: len(b.host.presence("dev-2")) == 1)
        for n in (a, b):
            assert statuses(n.host.presence("dev-1")) == [("online", "e1", None), ("offline", "e1", "disconnect")]
            assert n.coord.repeated_ends == 1
        assert statuses([e for e in a.sunk if e.client_id == "dev-1"]) == [
            ("online", "e1", None), ("offline", "e1", "disconnect")
        ]  # fmt: skip


async def test_a_record_of_an_id_seen_once_lives_shorter(redis_server: RedisServer) -> None:
    # Issue 33: 2,000 made-up ids put 503 MB into Redis, each kept a week.
    async with fleet(redis_server.url, "a", offline_ttl=100.0, once_ttl=10.0) as (a,):
        a.online("once", "o1")
        a.offline("once", "o1")
        for epoch in ("t1", "t2"):
            a.online("twice", epoch)
            a.offline("twice", epoch)
        await drain(a)
        async with coredis.Redis.from_url(redis_server.url) as r:
            once, twice = await r.pttl(PREFIX + "dev:once"), await r.pttl(PREFIX + "dev:twice")
        assert 9_000 < once <= 10_000 and 99_000 < twice <= 100_000


async def test_cross_node_takeover(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", "c") as (a, b, c):
        a.online("dev-1", "e1")
        await drain(a)
        b.online("dev-1", "e2")
        await until(lambda: a.host.evicted != [])
        assert a.host.evicted == [("dev-1", "e1", "reconnected on node b worker 0")]
        assert b.host.evicted == c.host.evicted == []
        # The device's old session ends on a, late: its offline was already published.
        a.offline("dev-1", "e1", Offline.CONNECTION_LOST)
        await drain(a, b, c)
        expected = [("online", "e1", None), ("offline", "e1", "takeover"), ("online", "e2", None)]
        for n in (a, b, c):
            assert statuses(n.host.presence("dev-1")) == expected
        takeover = c.host.presence("dev-1")[1]
        assert takeover.node == "a" and takeover.detail == "reconnected on node b worker 0"
        assert b.coord.takeovers == 1 and a.coord.offlines == 0
        for n in (a, b, c):
            found = await n.coord.lookup("dev-1")
            assert found is not None and (found.status, found.epoch, found.node) == ("online", "e2", "b")
        assert await a.coord.lookup("nobody") is None
        # The owned sets follow the session.
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert await r.smembers(PREFIX + "owned:a") == set()
            assert await r.smembers(PREFIX + "owned:b") == {b"dev-1"}


async def test_a_re_claim_after_the_devices_newer_session_ended_is_stale(redis_server: RedisServer) -> None:
    # Found in a 100,000-device Sentinel failover run (issue 32): a node's resynchronisation
    # came late, after the device had moved on (taking the old session over) and its new
    # session had ended too. The re-claim found the record offline and announced the old
    # session again, which then ended a second time.
    async with fleet(redis_server.url, "a", "b") as (a, b):
        old = a.online("dev-1", "e1", at=time.time() - 5)
        await drain(a)
        b.online("dev-1", "e2")
        await until(lambda: a.host.evicted != [])
        b.offline("dev-1", "e2")
        await drain(a, b)
        assert await a.coord.ownership.reclaim(old) == "a newer session holds this client id"
        await drain(a, b)
        expected = [("online", "e1", None), ("offline", "e1", "takeover"), ("online", "e2", None)]
        assert statuses(b.host.presence("dev-1")) == [*expected, ("offline", "e2", "disconnect")]
        found = await b.coord.lookup("dev-1")
        assert found is not None and (found.status, found.epoch) == ("offline", "e2")


async def test_a_session_displaced_while_redis_had_lost_its_record_ends_once(redis_server: RedisServer) -> None:
    # Found by the history checker in a Sentinel failover to a replica that was behind
    # (issue 32), and as likely after an empty restart: a device moved from node a to
    # node b while Redis was away. b's claim reached the new Redis first and found no
    # record to take over; a's re-claim then found b's newer session and was refused.
    # Nobody wrote the end of a's session. The re-claim now does, once.
    async with fleet(redis_server.url, "a", "b") as (a, b):
        old = a.online("lamp", "e-a")
        await drain(a, b)
        async with coredis.Redis.from_url(redis_server.url) as r:
            await r.delete([PREFIX + "dev:lamp"])  # the record, lost with the primary
        b.online("lamp", "e-b", at=old.time + 1)
        await drain(a, b)
        assert statuses(b.host.presence("lamp")) == [("online", "e-a", None), ("online", "e-b", None)]
        assert not await a.coord.ownership.claim(old, "reclaim")  # stale: a newer session holds it
        assert not await a.coord.ownership.claim(old, "reclaim")  # asked again (a retry): nothing more
        await drain(a, b)
        ended = [e for e in b.host.presence("lamp") if e.status == "offline"]
        assert [(e.epoch, e.reason) for e in ended] == [("e-a", Offline.TAKEOVER)]
        # Where the takeover had been written, a late re-claim of the session it ended adds nothing.
        a.online("bulb", "e-1")
        await drain(a, b)
        b.online("bulb", "e-2")
        await drain(a, b)
        assert not await a.coord.ownership.claim(a.host.live["bulb"], "reclaim")
        await drain(a, b)
        assert [e.epoch for e in b.host.presence("bulb") if e.status == "offline"] == ["e-1"]


async def test_route_reaches_only_matching_nodes(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", "c") as (a, b, c):
        a.coord.filters_changed({"sensors/#"})
        b.coord.filters_changed({"sensors/+/temp", "other/x"})
        c.coord.filters_changed(set())

        def known(n: Node, other: str, filters: set[str]) -> bool:
            held = n.coord._remote.get(other)
            return held is not None and set(held) == filters

        await until(lambda: all(known(n, "a", {"sensors/#"}) for n in (b, c)))
        await until(
            lambda: known(a, "b", {"sensors/+/temp", "other/x"}) and known(c, "b", {"sensors/+/temp", "other/x"})
        )
        c.coord.route(Publication("sensors/1/temp", b"21.5", 1))  # a and b
        c.coord.route(Publication("sensors/1/hum", b"40", 0))  # a only
        a.coord.route(Publication("sensors/2/temp", b"19", 0))  # b only: never back to a itself
        b.coord.route(Publication("nobody/listens", b"?", 0))  # nobody: not even sent
        await drain(a, b, c)
        await until(lambda: len(a.host.messages()) == 2 and len(b.host.messages()) == 2)
        await trio.sleep(0.1)
        assert a.host.messages() == [("sensors/1/temp", b"21.5"), ("sensors/1/hum", b"40")]
        assert sorted(b.host.messages()) == [("sensors/1/temp", b"21.5"), ("sensors/2/temp", b"19")]  # two senders
        assert c.host.messages() == []
        assert [q for t, _, q in a.host.delivered if t == "sensors/1/temp"] == [1]
        assert b.coord.route_skipped == 1 and c.coord.routed == 3


class _LateLink:
    """What :class:`Filters` uses of a RedisLink, on a real client; the call made after
    ``late`` is set has its answer held until ``late`` is (the renewer's full read,
    answered on a pooled connection after a read begun later)."""

    def __init__(self, client: coredis.Redis[bytes]) -> None:
        self.client = client
        self.late: trio.Event | None = None
        self.answered = trio.Event()

    def redis(self) -> coredis.Redis[bytes]:
        return self.client

    async def call(self, request: Any) -> Any:
        late, self.late = self.late, None
        result = await request
        if late is not None:
            self.answered.set()
            await late.wait()
        return result


async def test_a_read_of_the_filters_answered_late_does_not_undo_a_later_one(redis_server: RedisServer) -> None:
    """A node's new filter, read on its notice, is kept when the renewer's read of every
    node's filters, begun before the change, is answered after it; as is a swept node's
    absence. (Before, the full read put the old filters back until the next renewal: a
    message published here for the new subscriber was not routed.)"""
    keys = FleetKeys(PREFIX, "a")
    with trio.fail_after(10):
        async with coredis.Redis.from_url(redis_server.url) as r:
            link = _LateLink(r)
            filters = Filters(cast(RedisLink, link), keys, node="a")
            await r.hset(keys.filters, {"b": json.dumps(["old"]), "c": json.dumps(["c/#"])})
            for step in ("a change", "a sweep"):
                late = link.late = trio.Event()
                link.answered = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(filters.refresh)  # the renewer: every node's, answered now, applied late
                    await link.answered.wait()
                    if step == "a change":
                        await r.hset(keys.filters, {"b": json.dumps(["old", "new"])})
                        await filters.refresh("b")  # the reader, on b's notice
                        assert set(filters.remote["b"]) == {"old", "new"}
                    else:
                        filters.forget("c")  # swept: c is gone
                        assert "c" not in filters.remote
                    late.set()
                assert set(filters.remote["b"]) == {"old", "new"}, step
                assert ("c" in filters.remote) is (step == "a change"), step
            await filters.refresh()  # a full read begun after both: the truth, as it is in Redis
            assert set(filters.remote["b"]) == {"old", "new"} and set(filters.remote["c"]) == {"c/#"}


async def test_node_loss_ends_each_session_once(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", "c") as (a, b, c):
        for i in range(5):
            a.online(f"dev-{i}", f"e{i}")
        b.online("dev-b", "eb")
        await drain(a, b, c)
        a.scope.cancel()  # a crashes: no offline reports, its lease lapses
        await until(lambda: len([e for e in c.host.presence() if e.reason is Offline.NODE_LOST]) == 5)
        await trio.sleep(3 * LEASE)  # further sweeps must find nothing left
        for n in (b, c):
            lost = [e for e in n.host.presence() if e.status == "offline"]
            assert sorted(e.client_id or "" for e in lost) == [f"dev-{i}" for i in range(5)]
            assert {(e.reason, e.node, e.detail) for e in lost} == {(Offline.NODE_LOST, "a", "node a lost")}
        assert b.coord.node_lost + c.coord.node_lost == 5
        assert sorted(e.client_id or "" for e in b.sunk + c.sunk) == [f"dev-{i}" for i in range(5)] + ["dev-b"]
        found = await b.coord.lookup("dev-3")
        assert found is not None and found.reason is Offline.NODE_LOST
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert await r.smembers(PREFIX + "members") == {b"b", b"c"}
            assert not await r.exists([PREFIX + "owned:a", PREFIX + "sweep:a"])
            assert b"a" not in await r.hgetall(PREFIX + "filters")
        assert (await b.coord.lookup("dev-b")) is not None  # b's own device is untouched


async def test_racing_sweepers_end_each_session_once(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", "c") as (a, b, c):
        for i in range(40):
            a.online(f"dev-{i}", f"e{i}")
        await drain(a, b, c)
        a.scope.cancel()
        async with coredis.Redis.from_url(redis_server.url) as r:
            await lease_gone(r, "a")
        # Both sweep at once without the lock (and their own sweepers run too, with it).
        ended: list[int] = []
        async with trio.open_nursery() as nursery:
            for n in (b, c, b, c):

                async def sweep(n: Node = n) -> None:
                    ended.append(await n.coord.sweep("a", lock=False, batch=3))

                nursery.start_soon(sweep)
        await drain(b, c, settle=3 * RENEW)
        lost = [e for e in await stream_events(redis_server.url) if e.reason is Offline.NODE_LOST]
        assert sorted(e.client_id or "" for e in lost) == sorted(f"dev-{i}" for i in range(40))
        assert b.coord.node_lost + c.coord.node_lost == 40
        assert sum(ended) <= 40
        for n in (b, c):
            assert len([e for e in n.host.presence() if e.reason is Offline.NODE_LOST]) == 40


async def test_interrupted_sweep_is_resumed(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", "c") as (a, b, c):
        for i in range(10):
            a.online(f"dev-{i}", f"e{i}")
        await drain(a, b, c)
        async with coredis.Redis.from_url(redis_server.url) as r:
            # A sweeper ("ghost") takes the lock first, ends half of a's sessions, and dies.
            assert await r.set(PREFIX + "sweep:a", "ghost", px=int(4 * LEASE * 1000))
            a.scope.cancel()
            await lease_gone(r, "a")
            half = [f"dev-{i}" for i in range(5)]
            assert await b.coord.ownership.lose("a", half, Offline.NODE_LOST, "node a lost", True) == 5
            # While its lock lives, nobody else sweeps.
            await trio.sleep(RENEW * 2)
            assert c.coord.node_lost == 0 and b.coord.node_lost == 5
            # Then whoever takes the lock next ends the rest, once each.
            await until(lambda: len([e for e in c.host.presence() if e.reason is Offline.NODE_LOST]) == 10)
            await trio.sleep(2 * LEASE)
            assert not await r.exists([PREFIX + "owned:a"])
        lost = [e for e in await stream_events(redis_server.url) if e.reason is Offline.NODE_LOST]
        assert sorted(e.client_id or "" for e in lost) == [f"dev-{i}" for i in range(10)]
        assert b.coord.node_lost + c.coord.node_lost == 10


async def cut_off(url: str, sweeper: Node, dead: str) -> None:
    """As if ``dead``'s renewals had not arrived for a lease, and ``sweeper`` swept it
    before it renewed (if it renews first there is nothing to sweep: also right, but
    not what the caller tests). ``sweeper``'s own background sweep may get there first,
    between the delete and the call: that counts too."""
    before = sweeper.coord.node_lost
    async with coredis.Redis.from_url(url) as r:
        for _ in range(20):
            await r.delete([PREFIX + "node:" + dead])
            if await sweeper.coord.sweep(dead) == 1 or sweeper.coord.node_lost > before:
                return
    pytest.fail(f"{dead} always renewed first")


async def test_a_node_cut_off_past_its_lease_comes_back(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b") as (a, b):
        a.online("dev-1", "e1")
        await drain(a, b)
        await cut_off(redis_server.url, b, "a")
        await until(lambda: any(e.reason is Offline.NODE_LOST for e in b.host.presence("dev-1")))
        # a registers again; the session it still holds was ended meanwhile, and its end
        # is in the history: a closes the connection rather than bring the session back.
        await until(lambda: a.host.evicted != [])
        assert a.host.evicted == [("dev-1", "e1", "this session was ended while its gateway could not reach redis")]
        assert a.coord.fenced == 1
        found = await b.coord.lookup("dev-1")
        assert found is not None and (found.status, found.epoch, found.reason) == ("offline", "e1", Offline.NODE_LOST)
        a.offline("dev-1", "e1")  # the connection's end, as the server reports it
        a.online("dev-1", "e2")  # the device's next connection
        await drain(a, b)
        assert [(e.status, e.epoch) for e in b.host.presence("dev-1")] == [
            ("online", "e1"), ("offline", "e1"), ("online", "e2")
        ]  # fmt: skip


async def test_redis_restart_resynchronises(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b") as (a, b):
        for i in range(4):
            a.online(f"dev-{i}", f"e{i}")
        b.online("dev-b", "eb")
        await drain(a, b)
        await trio.to_thread.run_sync(redis_server.stop)
        # While Redis is away, sessions end and start; nothing blocks.
        started = time.perf_counter()
        a.offline("dev-0", "e0")
        a.online("dev-9", "e9")
        assert time.perf_counter() - started < 0.05
        await until(lambda: not a.coord.health().ok)
        assert "redis unreachable" in a.coord.health().detail
        assert len(a.coord._queue) == 2
        await trio.sleep(2 * LEASE)
        await trio.to_thread.run_sync(redis_server.start)  # back, empty
        await drain(a, b, settle=0.3)
        await until(lambda: a.coord.health().ok and b.coord.health().ok)
        assert a.coord.resyncs >= 2 and b.coord.resyncs >= 2  # the first registration, and after the restart
        for cid, epoch, owner in [
            ("dev-1", "e1", "a"),
            ("dev-3", "e3", "a"),
            ("dev-9", "e9", "a"),
            ("dev-b", "eb", "b"),
        ]:
            found = await b.coord.lookup(cid)
            assert found is not None and (found.status, found.epoch, found.node) == ("online", epoch, owner)
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert await r.smembers(PREFIX + "owned:a") == {b"dev-1", b"dev-2", b"dev-3", b"dev-9"}
            assert await r.smembers(PREFIX + "members") == {b"a", b"b"}
        # Every session ends now: exactly one offline each, everywhere.
        for i in (1, 2, 3, 9):
            a.offline(f"dev-{i}", f"e{i}")
        b.offline("dev-b", "eb")
        await drain(a, b)
        for n in (a, b):
            offline = [e for e in n.host.presence() if e.status == "offline"]
            assert sorted(e.client_id or "" for e in offline) == ["dev-0", "dev-1", "dev-2", "dev-3", "dev-9", "dev-b"]


async def test_redis_down_never_blocks_and_counts_drops(redis_server: RedisServer) -> None:
    redis_server.stop()
    host = RecordingHost()
    sunk: list[PresenceEvent] = []
    coord = RedisCoordinator(redis_server.url, "a", sinks=[sunk.append], lease=LEASE, renew=RENEW, queue_limit=10)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(1):
            await nursery.start(coord.run, host)  # accepted at once, Redis or not
        started = time.perf_counter()
        for i in range(15):
            event = PresenceEvent("online", f"dev-{i}", "p", None, 0.0, time.time(), epoch=f"e{i}", keep_alive=5)
            host.live[f"dev-{i}"] = event
            coord.online(event)
        coord.route(Publication("t", b"x", 0))
        coord.filters_changed({"t/#"})
        coord.note(PresenceEvent("offline", None, "p", Offline.CONNECT_TIMEOUT, 5.0, time.time()))
        assert time.perf_counter() - started < 0.05
        assert len(sunk) == 1  # a note goes to the sinks at once
        await until(lambda: not coord.health().ok)
        assert "redis unreachable" in coord.health().detail
        figures = {m.name: m.samples[0].value for m in coord.figures()}
        assert figures["heartbeat_fleet_queued"] == 10
        assert figures["heartbeat_fleet_dropped"] == 5
        assert figures["heartbeat_fleet_connected"] == 0
        with trio.move_on_after(0.3):
            await coord.drain()
            pytest.fail("drain returned with Redis down")
        await trio.to_thread.run_sync(redis_server.start)
        with trio.fail_after(5):
            await coord.drain()
        await until(lambda: coord.health().ok)
        # The drops were healed by the resynchronisation: every live session is claimed.
        for i in range(15):
            found = await coord.lookup(f"dev-{i}")
            assert found is not None and found.status == "online"
        figures = {m.name: m.samples[0].value for m in coord.figures()}
        assert figures["heartbeat_fleet_connected"] == 1 and figures["heartbeat_fleet_queued"] == 0
        assert figures["heartbeat_fleet_redis_rtt_seconds"] > 0
        nursery.cancel_scope.cancel()


async def test_dropped_offline_is_reconciled(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", queue_limit=1) as (a, b):
        a.online("dev-1", "e1")
        a.online("dev-2", "e2")
        await drain(a, b)
        async with coredis.Redis.from_url(redis_server.url) as r:
            # Redis stops answering writes (data kept): a's queue fills and drops a report.
            await r.client_pause(1000, coredis.PureToken.WRITE)
            dropped = a.coord.dropped  # (the second online above was dropped too, and healed)
            a.offline("dev-1", "e1")
            a.offline("dev-2", "e2")
            assert a.coord.dropped == dropped + 1
        await drain(a, b, settle=0.3)
        statuses_b = {cid: [(e.status, e.reason) for e in b.host.presence(cid)] for cid in ("dev-1", "dev-2")}
        assert statuses_b["dev-1"] == [("online", None), ("offline", Offline.DISCONNECT)]
        # The dropped offline is made up by the resynchronisation, once.
        assert statuses_b["dev-2"] == [("online", None), ("offline", Offline.CONNECTION_LOST)]


async def test_a_node_that_leaves_ends_what_it_still_holds_as_shutdown_once() -> None:
    from .coordinator_cluster import redis_cluster

    async with redis_cluster(2) as cluster:
        a, b = cluster.members
        b.host.subscribed.add(f"{PRESENCE}#")
        b.coordinator.filters_changed(b.host.filters())
        sessions = [a.host.new_event(f"d{i}") for i in range(5)]
        for event in sessions:
            a.coordinator.online(event)
        with trio.fail_after(5):
            while len(b.host.presence()) < 5:  # noqa: ASYNC110
                await trio.sleep(0.01)
        # The worker stops before its offline reports got through: it leaves instead.
        with trio.fail_after(5):
            await a.coordinator.leave()
            while len(b.host.presence()) < 10:  # noqa: ASYNC110
                await trio.sleep(0.01)
        await trio.sleep(0.3)  # nothing more: not a node-lost sweep later
        offline = [e for e in b.host.presence() if e["status"] == "offline"]
        assert sorted(str(e["epoch"]) for e in offline) == sorted(e.epoch for e in sessions)
        assert {e["reason"] for e in offline} == {"shutdown"}


def test_a_late_lease_renewal_is_measured_and_warned(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator = RedisCoordinator("redis://127.0.0.1:1/0", "slow-node", lease=4.0, renew=1.0)
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    coordinator.lease_keeper.renewed()
    now[0] += 1.0
    coordinator.lease_keeper.renewed()
    assert coordinator.renew_gap_max == 1.0 and not caplog.records
    now[0] += 3.0  # past half the lease: close to being declared lost while alive
    coordinator.lease_keeper.renewed()
    monkeypatch.undo()
    assert coordinator.renew_gap_max == 3.0
    assert any("lease renewed 3.0 s after the last" in r.getMessage() for r in caplog.records)
    gap = [m for m in coordinator.figures() if m.name == "heartbeat_fleet_lease_gap_max_seconds"]
    assert gap and gap[0].samples[0].value == 3.0
