"""One contract, every coordinator that shares presence between processes: the same
tests run against the local (supervisor) coordinator and the Redis fleet one.

These do real I/O (Unix sockets, Redis), so they run on the wall clock, each wait
bounded."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from functools import partial

import pytest
import trio

from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.mqtt.v5.outbound import forwarded
from servers.heartbeat.mqtt.v5.properties import Properties

from .coordinator_cluster import Cluster, RecordingHost, local_cluster, redis_cluster

Factory = Callable[[int], AbstractAsyncContextManager[Cluster]]
CLUSTERS: dict[str, Factory] = {"local": local_cluster, "redis": redis_cluster}


@pytest.fixture(params=sorted(CLUSTERS))
def make_cluster(request: pytest.FixtureRequest) -> Factory:
    return CLUSTERS[request.param]


async def until(predicate: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    with trio.move_on_after(seconds):
        while not predicate():  # noqa: ASYNC110 (polling what other processes deliver)
            await trio.sleep(0.01)
        return
    raise AssertionError(f"timed out waiting for {what}")


def seen(host: RecordingHost, client_id: str, n: int) -> bool:
    return len(states(host, client_id)) >= n


def states(host: RecordingHost, client_id: str) -> list[tuple[str, str, str | None]]:
    return [
        (str(e["status"]), str(e["epoch"]), e.get("reason"))  # type: ignore[misc]
        for e in host.presence()
        if e["client_id"] == client_id
    ]


async def subscribe_all(cluster: Cluster, topic_filter: str = f"{PRESENCE}#") -> None:
    for m in cluster.members:
        m.host.subscribed.add(topic_filter)
        m.coordinator.filters_changed(m.host.filters())
    await trio.sleep(0.1)  # filters travel to the others


async def test_online_and_offline_reach_every_host_once(make_cluster: Factory) -> None:
    async with make_cluster(2) as cluster:
        await subscribe_all(cluster)
        a, b = cluster.members
        on = a.host.new_event("d1")
        a.coordinator.online(on)
        off = replace(on, status="offline", reason=Offline.DISCONNECT)
        a.coordinator.offline(off)
        a.coordinator.offline(off)  # a report sent twice counts once
        for m in cluster.members:
            await until(partial(seen, m.host, "d1", 2), "both events everywhere")
        await trio.sleep(0.1)
        for m in cluster.members:
            assert states(m.host, "d1") == [("online", on.epoch, None), ("offline", on.epoch, "disconnect")]
        record = await b.coordinator.lookup("d1")
        assert record is not None and record.status == "offline" and record.epoch == on.epoch


async def test_takeover_on_another_host_evicts_the_old_session_once(make_cluster: Factory) -> None:
    async with make_cluster(2) as cluster:
        await subscribe_all(cluster)
        a, b = cluster.members
        first = a.host.new_event("roamer")
        a.coordinator.online(first)
        await until(lambda: len(states(b.host, "roamer")) == 1, "first online")
        second = b.host.new_event("roamer")
        b.coordinator.online(second)
        await until(lambda: a.host.evicted == [("roamer", first.epoch)], "the old holder to be told")
        # The old holder's own report, after closing it, is too late to count.
        late = replace(first, status="offline", reason=Offline.TAKEOVER)
        a.coordinator.offline(late)
        await until(lambda: len(states(a.host, "roamer")) >= 3, "takeover events")
        await trio.sleep(0.1)
        for m in cluster.members:
            assert states(m.host, "roamer") == [
                ("online", first.epoch, None),
                ("offline", first.epoch, "takeover"),
                ("online", second.epoch, None),
            ]
        assert b.host.evicted == []
        record = await a.coordinator.lookup("roamer")
        assert record is not None and record.epoch == second.epoch and record.status == "online"


async def test_messages_are_routed_only_where_a_filter_matches(make_cluster: Factory) -> None:
    async with make_cluster(3) as cluster:
        a, b, c = cluster.members
        a.host.subscribed.add("sensors/#")  # the sender delivers to its own subscribers itself
        a.coordinator.filters_changed(a.host.filters())
        b.host.subscribed.add("sensors/+/temp")
        b.coordinator.filters_changed(b.host.filters())
        c.host.subscribed.add("other/#")
        c.coordinator.filters_changed(c.host.filters())
        await trio.sleep(0.2)
        for i in range(5):
            a.coordinator.route(Publication("sensors/d1/temp", f"{i}".encode(), 1))
        a.coordinator.route(Publication("sensors/d1/humidity", b"x", 0))
        await until(lambda: len(b.host.delivered) == 5, "five messages at b")
        await trio.sleep(0.1)
        assert [(t, p) for t, p, _ in b.host.delivered] == [("sensors/d1/temp", f"{i}".encode()) for i in range(5)]
        assert c.host.delivered == [] and a.host.delivered == []  # no match; never back to the sender


async def test_an_mqtt_5_publishers_properties_reach_the_other_members(make_cluster: Factory) -> None:
    """Issue 28: a 5.0 subscriber on another worker or node gets what a 5.0 publisher's
    PUBLISH carried (user properties in order, content type, correlation data), at QoS 0
    (sent once) and QoS 1 (numbered, resent after a dropped link); a 3.1.1 one's, none."""
    props = forwarded(
        Properties(
            content_type="application/json", correlation_data=b"\x00\x01", user_properties=(("b", "2"), ("a", "1"))
        )
    )
    async with make_cluster(2) as cluster:
        a, b = cluster.members
        b.host.subscribed.add("cmd/#")
        b.coordinator.filters_changed(b.host.filters())
        await trio.sleep(0.2)
        a.coordinator.route(Publication("cmd/1", b"{}", 0, False, props))
        a.coordinator.route(Publication("cmd/2", b"{}", 1, True, props))
        a.coordinator.route(Publication("cmd/3", b"plain", 1))
        a.coordinator.route(Publication("cmd/4", b"kept", 0, True, b""))
        await until(lambda: len(b.host.delivered) == 4, "four messages at b")
        topics = [t for t, _, _ in b.host.delivered]
        assert dict(zip(topics, b.host.properties, strict=True)) == {
            "cmd/1": props,
            "cmd/2": props,
            "cmd/3": b"",
            "cmd/4": b"",
        }
        # The retain flag as published (for a 5.0 subscriber's Retain As Published).
        assert dict(zip(topics, b.host.retains, strict=True)) == {
            "cmd/1": False,
            "cmd/2": True,
            "cmd/3": False,
            "cmd/4": True,
        }
        assert [p for t, p, _ in b.host.delivered] == [b"{}", b"{}", b"plain", b"kept"]


async def test_once_settled_every_other_member_routes_by_the_new_filters(make_cluster: Factory) -> None:
    async with make_cluster(3) as cluster:
        a, b, c = cluster.members
        await trio.sleep(0.2)  # every member has joined
        for i in range(5):
            a.host.subscribed.add(f"reply/{i}")
            a.coordinator.filters_changed(a.host.filters())
            assert a.coordinator.settles()
            assert await a.coordinator.settle()
            # No wait: b and c route by the new filter as soon as settle returns.
            b.coordinator.route(Publication(f"reply/{i}", b"from-b", 1))
            c.coordinator.route(Publication(f"reply/{i}", b"from-c", 1))
        await until(lambda: len(a.host.delivered) == 10, "every reply at a")
        assert sorted(p for _, p, _ in a.host.delivered) == [b"from-b"] * 5 + [b"from-c"] * 5


async def test_a_lost_member_s_sessions_go_offline_exactly_once(make_cluster: Factory) -> None:
    async with make_cluster(2) as cluster:
        await subscribe_all(cluster)
        a, b = cluster.members
        mine = [a.host.new_event(f"d{i}") for i in range(20)]
        for e in mine:
            a.coordinator.online(e)
        ended = mine[0]
        a.coordinator.offline(replace(ended, status="offline", reason=Offline.DISCONNECT))
        theirs = b.host.new_event("healthy")
        b.coordinator.online(theirs)
        await until(lambda: len(b.host.presence()) == 22, "every event at b")
        cluster.kill(0)
        await until(lambda: sum(e["reason"] == cluster.loss_reason for e in b.host.presence()) == 19, "loss events", 15)
        await trio.sleep(0.3)
        offline = [e for e in b.host.presence() if e["status"] == "offline"]
        assert sorted(str(e["epoch"]) for e in offline) == sorted(e.epoch for e in mine)  # once each
        assert not any(e["client_id"] == "healthy" for e in offline)
        record = await b.coordinator.lookup("d5")
        assert record is not None and record.reason == Offline(cluster.loss_reason)


async def test_a_worker_without_its_supervisor_link_says_degraded(tmp_path: object) -> None:
    from servers.heartbeat.coordination.local import BusCoordinator

    host = RecordingHost(worker=0)
    coordinator = BusCoordinator(f"{tmp_path}/no-such.sock", worker=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run, host)
        coordinator.online(host.new_event("d"))  # queued, never lost: sent once the link is up
        health = coordinator.health()
        assert not health.ok and "not connected" in health.detail
        nursery.cancel_scope.cancel()


async def test_a_worker_reports_degraded_while_its_reports_wait_unacknowledged() -> None:
    async with local_cluster(1) as cluster:
        (member,) = cluster.members
        coordinator = member.coordinator
        assert coordinator.health().ok
        # A report the authority never acknowledges (its link is held but not read).
        from servers.heartbeat.coordination import local

        stamp = local._BEHIND
        coordinator.online(member.host.new_event("d"))
        await until(lambda: coordinator.health().ok, "the report acknowledged")
        local._BEHIND = -1.0  # any unacknowledged report now counts as behind
        try:
            coordinator.online(member.host.new_event("e"))
            assert not coordinator.health().ok and "unacknowledged" in coordinator.health().detail
        finally:
            local._BEHIND = stamp
