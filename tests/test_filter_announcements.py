"""Filters are announced by what changed (issue 33): a worker tells the authority which
filters came and went, and the authority tells each other worker which filters came
into or went out of the set held by someone other than it. A SUBSCRIBE then costs the
same however many filters are held, and every worker still routes by exactly the other
workers' filters and the persistent sessions'.

The model test drives a real Authority and real BusCoordinators, their links replaced
by lists of lines moved by hand, so every interleaving is one the hypothesis run can
shrink."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import cast

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from servers.heartbeat.broker.persistent import SessionStore
from servers.heartbeat.broker.reports import Subscribed
from servers.heartbeat.broker.subscriptions import Subscriptions
from servers.heartbeat.broker.topics import FilterChanges
from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.coordination.authority import Authority
from servers.heartbeat.coordination.frames import (
    Filters,
    FiltersChanged,
    RemoteFilters,
    RemoteFiltersChanged,
    decode,
    encode,
)
from servers.heartbeat.coordination.holders import Holders
from servers.heartbeat.coordination.inprocess import InProcessCoordinator
from servers.heartbeat.coordination.local import BusCoordinator
from servers.heartbeat.coordination.retention import MqttState
from servers.heartbeat.mqtt.effects import AddSubscription
from servers.heartbeat.server.connection import Connection
from servers.heartbeat.server.fanout import FanOut

from .coordinator_cluster import RecordingHost
from .test_bus_delivery import FakeLink

# Few filters, so that workers and sessions share them often.
FILTERS = st.sampled_from(["a", "a/+", "a/#", "b", "+/x", "#", "c/d"])
WORKERS = st.integers(0, 2)
CLIENTS = st.sampled_from(["k1", "k2", "k3"])


def test_a_filter_that_comes_and_goes_between_takes_is_no_change() -> None:
    changes = FilterChanges()
    changes.came("a")
    changes.went("a")
    assert not changes
    changes.came("b")
    changes.came("c")
    assert changes.take() == (frozenset({"b", "c"}), frozenset())
    changes.went("b")
    changes.came("b")
    changes.went("c")
    assert changes.take() == (frozenset(), frozenset({"c"}))
    assert not changes


def test_subscriptions_record_a_filter_s_first_subscriber_and_its_last_only() -> None:
    subs: Subscriptions[str] = Subscriptions(max_qos=1)
    subs.subscribe("k1", "held/before", 0)
    changes = subs.track()
    assert changes.take() == (frozenset({"held/before"}), frozenset())  # tracking starts from what is held
    subs.subscribe("k1", "a/+", 1)
    subs.subscribe("k2", "a/+", 1)  # a second subscriber: no change
    subs.subscribe("k1", "a/+", 0)  # a QoS change: none either
    assert changes.take() == (frozenset({"a/+"}), frozenset())
    subs.unsubscribe("k1", "a/+")
    assert not changes
    subs.drop("k2")
    subs.drop("k1")
    assert changes.take() == (frozenset(), frozenset({"a/+", "held/before"}))


@given(
    added=st.frozensets(st.text(max_size=8), max_size=5),
    removed=st.frozensets(st.text(max_size=8), max_size=5),
)
def test_filter_frames_cross_the_bus_whole(added: frozenset[str], removed: frozenset[str]) -> None:
    for frame in (FiltersChanged(added, removed), RemoteFiltersChanged(added, removed)):
        assert decode(encode(frame)) == frame
    for whole in (Filters(added), RemoteFilters(removed)):
        assert decode(encode(whole)) == whole


@dataclass
class _Host(RecordingHost):
    """A worker stand-in whose filters are those of its own Subscriptions."""

    subscriptions: Subscriptions[str] = field(default_factory=lambda: Subscriptions(max_qos=1))

    def filters(self) -> set[str]:
        return self.subscriptions.filters()


@dataclass
class _Worker:
    coordinator: BusCoordinator
    host: _Host
    changes: FilterChanges
    link: FakeLink | None = None


def _named(line: bytes) -> int:
    """How many filters a filter frame names (0 for any other frame)."""
    frame = decode(line)
    if isinstance(frame, Filters | RemoteFilters):
        return len(frame.filters)
    if isinstance(frame, FiltersChanged | RemoteFiltersChanged):
        return len(frame.added) + len(frame.removed)
    return 0


class Bus:
    """An authority and its workers, lines moved between them by :meth:`pump`."""

    def __init__(self, workers: int, authority: Authority | None = None) -> None:
        self.authority = authority or Authority()
        self._links = itertools.count(1)
        self.named: collections.Counter[str] = collections.Counter()
        """Filters named in filter frames, by direction ("up" to the authority, "down")."""
        self.workers: list[_Worker] = []
        for i in range(workers):
            self.start(i)

    def start(self, index: int) -> None:
        """A new worker process, linked, in place of worker ``index`` (if there was one)."""
        host = _Host(index)
        worker = _Worker(BusCoordinator("unused", worker=index), host, host.subscriptions.track())
        worker.coordinator._host = host
        if index < len(self.workers):
            self.workers[index] = worker
        else:
            self.workers.append(worker)
        self.link(worker, reconnect=False)

    def link(self, worker: _Worker, *, reconnect: bool = True) -> None:
        worker.link = FakeLink(next(self._links))
        self.authority.connected(worker.link)
        worker.coordinator._greet(reconnect=reconnect)
        self.pump()

    def unlink(self, worker: _Worker) -> None:
        assert worker.link is not None
        self.authority.disconnected(worker.link, False)
        worker.coordinator.connected = False
        worker.link = None
        self.pump()

    def announce(self, worker: _Worker) -> None:
        """What the worker's FanOut does after each change to its subscriptions."""
        if worker.changes:
            worker.coordinator.filters_changed(*worker.changes.take())
        self.pump()

    def pump(self) -> None:
        """Move every line each way until none is left."""
        moved = True
        while moved:
            moved = False
            for worker in self.workers:
                link, coordinator = worker.link, worker.coordinator
                if link is None:
                    continue
                up, coordinator._out = b"".join(coordinator._out), []
                for line in up.splitlines():
                    self.named["up"] += _named(line)
                    self.authority.received(link, line)
                self.authority.batch_done(link)
                down, link.lines = b"".join(link.lines), []
                for line in down.splitlines():
                    self.named["down"] += _named(line)
                    coordinator._received(line)
                moved = moved or bool(up or down)


class AnnouncementModel(RuleBasedStateMachine):
    """Workers subscribe, unsubscribe, drop clients, lose their links and come back, die
    and are replaced, and report persistent sessions' filters; each linked worker routes
    by the union of the other linked workers' filters and the persistent sessions'."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000.0
        state = MqttState(store=SessionStore(expiry=50.0))
        self.bus = Bus(3, Authority(clock=lambda: self.now, state=state))

    @property
    def store(self) -> SessionStore:
        return self.bus.authority.store

    @rule(w=WORKERS, client=CLIENTS, topic_filter=FILTERS)
    def subscribe(self, w: int, client: str, topic_filter: str) -> None:
        worker = self.bus.workers[w]
        worker.host.subscriptions.subscribe(client, topic_filter, 0)
        self.bus.announce(worker)

    @rule(w=WORKERS, client=CLIENTS, topic_filter=FILTERS)
    def unsubscribe(self, w: int, client: str, topic_filter: str) -> None:
        worker = self.bus.workers[w]
        worker.host.subscriptions.unsubscribe(client, topic_filter)
        self.bus.announce(worker)

    @rule(w=WORKERS, client=CLIENTS)
    def drop(self, w: int, client: str) -> None:
        worker = self.bus.workers[w]
        worker.host.subscriptions.drop(client)
        self.bus.announce(worker)

    @precondition(lambda self: any(w.link is not None for w in self.bus.workers))
    @rule(w=WORKERS)
    def unlink(self, w: int) -> None:
        worker = self.bus.workers[w]
        if worker.link is not None:
            self.bus.unlink(worker)

    @rule(w=WORKERS)
    def relink(self, w: int) -> None:
        worker = self.bus.workers[w]
        if worker.link is None:
            self.bus.link(worker)

    @rule(w=WORKERS)
    def replaced(self, w: int) -> None:
        """The worker process died; a new one, with no subscriber yet, takes its place."""
        worker = self.bus.workers[w]
        if worker.link is not None:
            self.bus.unlink(worker)
        self.bus.start(w)

    @rule(w=WORKERS, client=CLIENTS, topic_filter=FILTERS, on=st.booleans())
    def persistent(self, w: int, client: str, topic_filter: str, on: bool) -> None:
        """A persistent session subscribes or unsubscribes (reported by its worker)."""
        client = "p-" + client
        if self.store.get(client) is None:
            self.store.open(client, False, self.now)
        worker = self.bus.workers[w]
        worker.coordinator.session(Subscribed(client, topic_filter, 0 if on else None))
        self.bus.pump()

    @rule(w=WORKERS, client=CLIENTS)
    def discard(self, w: int, client: str) -> None:
        self.bus.workers[w].coordinator.discard_session("p-" + client)
        self.bus.pump()

    @rule()
    def time_passes(self) -> None:
        """Sessions expire at the authority's next sweep, which the next frame brings."""
        self.now += 100.0

    @invariant()
    def each_worker_routes_by_everyone_else_s_filters(self) -> None:
        linked = [w for w in self.bus.workers if w.link is not None]
        persistent = self.store.subscriptions.filters()
        for worker in linked:
            others = set().union(*(w.host.filters() for w in linked if w is not worker))
            assert set(worker.coordinator._remote) == others | persistent
            assert worker.link is not None
            assert set(self.bus.authority._peers[worker.link.number].index) == worker.host.filters()


TestAnnouncementModel = AnnouncementModel.TestCase
TestAnnouncementModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


@given(
    steps=st.lists(
        st.tuples(st.integers(-1, 2), st.booleans(), FILTERS),
        max_size=40,
    )
)
def test_holders_views_are_everyone_else_s_filters(steps: list[tuple[int, bool, str]]) -> None:
    """The authority's pure part alone: holder -1 (the sessions) never listens."""
    holders: Holders[int] = Holders()
    seen = {h: set(holders.listen(h)) for h in range(3)}
    for holder, take, topic_filter in steps:
        if take:
            holders.change(holder, [topic_filter], [])
        else:
            holders.change(holder, [], [topic_filter])
        for h, added, removed in holders.taken():
            assert not added & seen[h] and removed <= seen[h]
            seen[h] = (seen[h] | added) - removed
        for h in range(3):
            assert seen[h] == holders.view(h)


def test_a_subscribe_names_each_filter_once_on_the_bus_however_many_are_held() -> None:
    """One worker's 2,000 filters, one a SUBSCRIBE: each crosses once to the authority
    and once to each other worker (whole sets each time made it 2,000 x 2,001 / 2 a way)."""
    n = 2_000
    bus = Bus(3)
    a = bus.workers[0]
    for i in range(n):
        a.host.subscriptions.subscribe("client", f"cmd/{i}", 0)
        bus.announce(a)
    for i in range(n):  # the same filters again, another client: nothing to announce
        a.host.subscriptions.subscribe("other", f"cmd/{i}", 0)
        bus.announce(a)
    assert bus.named == {"up": n, "down": 2 * n}
    assert all(set(w.coordinator._remote) == {f"cmd/{i}" for i in range(n)} for w in bus.workers[1:])
    a.host.subscriptions.drop("client")
    a.host.subscriptions.drop("other")
    bus.announce(a)
    assert bus.named == {"up": 2 * n, "down": 4 * n}
    assert not bus.workers[1].coordinator._remote


class _Conn:
    """As much of a Connection as FanOut.subscribed and forget read."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.finished = False
        self.persistent = False
        self.held = None
        self.stream = self
        self.send_timeout: float | None = None

    def may_read(self, topic: str) -> bool:
        return True


class _Recorder(InProcessCoordinator):
    """Records the size of each filter announcement."""

    def __init__(self) -> None:
        super().__init__()
        self.announced: list[tuple[int, int]] = []

    def filters_changed(self, added: Collection[str], removed: Collection[str] = ()) -> None:
        self.announced.append((len(added), len(removed)))


async def test_announcing_n_distinct_filters_costs_n_not_n_squared() -> None:
    n = 5_000
    recorder = _Recorder()
    async with trio.open_nursery() as nursery:
        fanout = FanOut(HeartbeatConfig(), recorder, collections.Counter(), nursery)
        first, second = (cast(Connection, _Conn(name)) for name in ("first", "second"))
        for i in range(n):
            fanout.subscribed(first, AddSubscription(f"dev/{i}/cmd", 0))
        for i in range(n):  # already held here: no announcement at all
            fanout.subscribed(second, AddSubscription(f"dev/{i}/cmd", 0))
        assert sum(added for added, _ in recorder.announced) == n
        assert len(recorder.announced) == n
        fanout.forget(first)
        assert len(recorder.announced) == n  # the second still holds every filter
        fanout.forget(second)
        assert recorder.announced[-1] == (0, n)
        nursery.cancel_scope.cancel()
