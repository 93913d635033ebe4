"""Persistent sessions and retained messages in a fleet on a real ``redis-server``.

Coordinator level: :class:`RedisCoordinator` nodes with recording hosts (as in
``tests/test_fleet.py``), the packets a session is owed read back from what each
host was asked to transmit. Process level: two gateways on one Redis, a raw-socket
client roaming between them and outliving a gateway killed with SIGKILL (by PID).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import coredis
import pytest
import trio

from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.broker.reports import Acked, AckedTogether, Attach, Detach, Inbound, Opened, Push, Subscribed
from servers.heartbeat.coordination.fleet import RedisCoordinator
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.packets import Packet, Publish, Pubrel
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.mqtt.reader import AnyPacket, PacketReader

from .redis_server import RedisServer
from .test_fleet import LEASE, PREFIX, RENEW, Node, RecordingHost, cut_off, drain, fleet, redis_server, until
from .test_mqtt_state import Raw, publish, unanswered

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["redis_server"]  # the fixture, shared with tests/test_fleet.py


def packets(host: RecordingHost, client_id: str, epoch: str | None = None) -> list[AnyPacket]:
    """Every packet ``host`` was asked to write to ``client_id``'s connection, in order."""
    data = b"".join(b"".join(p) for c, e, p in host.transmitted if c == client_id and epoch in (None, e))
    return PacketReader(1 << 20).feed(data)


def publishes(host: RecordingHost, client_id: str) -> list[Publish]:
    return [p for p in packets(host, client_id) if isinstance(p, Publish)]


def pid(packet: Packet) -> int:
    """The packet id of a QoS 1 or 2 PUBLISH."""
    assert isinstance(packet, Publish) and packet.packet_id is not None
    return packet.packet_id


async def session_field(url: str, client_id: str, name: str) -> bytes | None:
    async with coredis.Redis.from_url(url) as r:
        return await r.hget(PREFIX + "ps:" + client_id, name)


async def knows(node: Node, topic_filter: str) -> None:
    """Wait until ``node`` has heard of the persistent filter (its cache decides what it routes)."""
    cache = node.coord.persistent_filters
    await until(lambda: topic_filter in cache.exact or topic_filter in cache.wild)


def attach(node: Node, client_id: str, epoch: str) -> None:
    """Connection ``epoch`` of ``client_id`` was admitted on ``node`` (its claim) and its
    CONNACK is out (its attach): only the session that holds the id takes its messages."""
    node.online(client_id, epoch)
    node.coord.session(Attach(client_id, epoch))


async def held_session(node: Node, client_id: str, epoch: str, subscriptions: dict[str, int]) -> None:
    """A new persistent session of ``client_id`` on ``node``, connected as ``epoch``."""
    opened = await node.coord.open_session(client_id)
    assert opened is not None
    for topic_filter, qos in subscriptions.items():
        node.coord.session(Subscribed(client_id, topic_filter, qos))
    attach(node, client_id, epoch)
    await drain(node, settle=0)


def figures(coord: RedisCoordinator) -> dict[str, float]:
    return {m.name: m.samples[0].value for m in coord.figures() if m.samples}


async def collect(coord: RedisCoordinator, topic_filter: str) -> list[tuple[str, bytes, int]]:
    """Every retained message for ``topic_filter``, page after page."""
    out: list[tuple[str, bytes, int]] = []
    cursor: str | None = None
    for _ in range(1000):
        page, cursor = await coord.retained(topic_filter, cursor)
        out += [(m.topic, m.payload, m.qos) for m in page]
        if cursor is None:
            return out
    raise AssertionError("the pages never ended")


# --------------------------------------------------------------- coordinator level


async def test_only_the_session_holding_the_client_id_takes_its_messages(redis_server: RedisServer) -> None:
    # The device's CONNECT on a came first but was admitted last (its stored session was
    # slow to come): the claims crossed, and a's session lost at once. Its attach, which
    # follows, must not take the persistent session from b's.
    async with fleet(redis_server.url, "a", "b") as (a, b):
        await held_session(b, "c1", "e2", {"cmd/c1": 1})
        assert await a.coord.open_session("c1") is not None
        a.online("c1", "e1", at=time.time() - 5)
        a.coord.session(Attach("c1", "e1"))
        await drain(a, b)
        assert a.host.evicted and a.host.evicted[0][:2] == ("c1", "e1")
        assert await session_field(redis_server.url, "c1", "holder") == b"e2"
        b.coord.route(Publication("cmd/c1", b"for the one that holds it", 1))
        await until(lambda: len(publishes(b.host, "c1")) == 1)
        assert publishes(a.host, "c1") == []


async def test_a_session_is_found_whole_on_another_node(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", max_qos=1) as (a, b):
        assert await a.coord.open_session("c1", "alice") == Opened(False, {}, frozenset())
        for topic_filter, qos in [("cmd/c1", 1), ("cfg/#", 2), ("gone/x", 1), ("gone/x", None)]:
            a.coord.session(Subscribed("c1", topic_filter, qos))
        attach(a, "c1", "e1")
        for packet_id, held in [(7, True), (8, True), (8, False)]:
            a.coord.session(Inbound("c1", packet_id, held))
        a.coord.session(Detach("c1", "e1"))
        await drain(a)
        found = await b.coord.open_session("c1", "alice")
        assert found == Opened(True, {"cmd/c1": 1, "cfg/#": 1}, frozenset({7}))  # granted at most max_qos
        await knows(b, "cfg/#")
        assert b.coord.persistent_filters.matching("cmd/c1") == ["cmd/c1"]
        assert b.coord.persistent_filters.matching("cfg/x/y") == ["cfg/#"]
        assert b.coord.persistent_filters.matching("gone/x") == []
        # Attached on b; a's late reports from its old connection change nothing.
        attach(b, "c1", "e2")
        await drain(b)
        a.coord.session(Detach("c1", "e1"))
        a.coord.session(Acked("c1", "e1", "puback", 1))
        await drain(a)
        assert await session_field(redis_server.url, "c1", "holder") == b"e2"
        assert await session_field(redis_server.url, "c1", "hnode") == b"b"
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert await r.smembers(PREFIX + "pheld:b") == {b"c1"}
            assert await r.smembers(PREFIX + "pheld:a") == set()
        # A session nobody had before is new on any node.
        assert await b.coord.open_session("c2") == Opened(False, {}, frozenset())


async def test_what_queued_while_away_is_delivered_in_order_on_another_node(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b") as (a, b):
        await held_session(a, "c1", "e1", {"cmd/c1": 2})
        a.coord.session(Detach("c1", "e1"))
        await drain(a)
        await knows(b, "cmd/c1")
        for i in range(5):
            b.coord.route(Publication("cmd/c1", b"m%d" % i, 1))
        b.coord.route(Publication("cmd/c1", b"at-most-once", 0))  # QoS 0 is not kept for an absent client
        b.coord.route(Publication("cmd/c1", b"exactly-once", 2))
        b.coord.route(Publication("other/topic", b"nobody", 1))
        await drain(a, b)
        assert a.host.transmitted == b.host.transmitted == []
        opened = await b.coord.open_session("c1")
        assert opened is not None and opened.present
        attach(b, "c1", "e2")
        await until(lambda: len(publishes(b.host, "c1")) == 6)
        got = publishes(b.host, "c1")
        expected = [(b"m%d" % i, 1) for i in range(5)] + [(b"exactly-once", 2)]
        assert [(p.payload, p.qos) for p in got] == expected
        assert not any(p.dup or p.retain for p in got)
        assert len({p.packet_id for p in got}) == 6
        assert {e for _, e, _ in b.host.transmitted} == {"e2"} and a.host.transmitted == []
        # Live now: a publish on a reaches the client's connection on b.
        a.coord.route(Publication("cmd/c1", b"live", 1))
        await until(lambda: len(publishes(b.host, "c1")) == 7)
        assert publishes(b.host, "c1")[-1].payload == b"live"
        # QoS 2: PUBREC is answered with PUBREL; PUBCOMP completes it.
        qos2 = pid(got[5])
        b.coord.session(Acked("c1", "e2", "pubrec", qos2))
        await until(lambda: len(packets(b.host, "c1")) == 8)
        assert packets(b.host, "c1")[-1] == Pubrel(qos2)
        # A retained message for this session only (pushed to it at QoS 1, retain flag kept).
        b.coord.session(Push("c1", "cfg/x", b"kept", 1))
        b.coord.session(Push("c1", "cfg/y", b"qos0", 0))  # not the session's to hold
        await until(lambda: len(packets(b.host, "c1")) == 9)
        last = publishes(b.host, "c1")[-1]
        assert (last.topic, last.payload, last.retain, last.qos) == ("cfg/x", b"kept", True, 1)
        assert b.coord.persistent_routed == 6 and a.coord.persistent_routed == 1


async def test_window_and_queue_bounds_drop_the_newest_and_count(redis_server: RedisServer) -> None:
    bounds = {"max_inflight": 2, "max_queued": 3, "max_queued_bytes": 30}
    async with fleet(redis_server.url, "a", "b", **bounds) as (a, b):
        await held_session(a, "c1", "e1", {"cmd/c1": 1})
        await knows(b, "cmd/c1")
        for i in range(7):
            b.coord.route(Publication("cmd/c1", b"%d" % i, 1))
        await drain(a, b)
        await until(lambda: len(publishes(a.host, "c1")) == 2)
        first = publishes(a.host, "c1")
        assert [p.payload for p in first] == [b"0", b"1"]  # the window
        assert b.coord.persistent_routed == 5 and b.coord.persistent_dropped == 2  # 3 queued, 2 dropped
        a.coord.session(Acked("c1", "e1", "puback", pid(first[0])))
        await until(lambda: len(publishes(a.host, "c1")) == 3)
        assert publishes(a.host, "c1")[2].payload == b"2"
        # The bytes bound of an absent client's queue: 16 bytes each, 30 at most.
        await held_session(a, "c2", "e2", {"cmd/c2": 1})
        a.coord.session(Detach("c2", "e2"))
        await drain(a)
        await knows(b, "cmd/c2")
        for _ in range(2):
            b.coord.route(Publication("cmd/c2", b"x" * 10, 1))
        await drain(b)
        assert b.coord.persistent_dropped == 3
        await b.coord.refresh_figures()
        seen = figures(b.coord)
        assert seen["heartbeat_persistent_sessions"] == 2
        assert seen["heartbeat_persistent_queued_bytes"] == 2 * 7 + 16  # c1's "3" and "4", c2's one
        assert seen["heartbeat_persistent_dropped"] == 3
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert await r.hget(PREFIX + "pstats", "dropped") == b"3"


async def test_a_run_of_acknowledgements_reported_together_is_one_call_and_one_refill(
    redis_server: RedisServer,
) -> None:
    """A read's run of acknowledgements goes to Redis as one report (the base
    Coordinator.acknowledged), the session script takes it in order, and the window's
    refill (or the PUBRELs) comes back in one route entry; a run from a connection that
    lost the session changes nothing."""
    async with fleet(redis_server.url, "a", "b", max_inflight=2) as (a, b):
        await held_session(a, "c1", "e1", {"cmd/c1": 1, "two/c1": 2})
        await knows(b, "cmd/c1")
        await knows(b, "two/c1")
        for i in range(5):
            b.coord.route(Publication("cmd/c1", b"%d" % i, 1))
        await drain(b)
        await until(lambda: len(publishes(a.host, "c1")) == 2)
        window = publishes(a.host, "c1")
        entries = len(a.host.transmitted)
        a.coord.session(AckedTogether.pack("c1", "e0", [("puback", pid(p)) for p in window]))  # not its holder
        a.coord.acknowledged("c1", "e1", [("puback", pid(p)) for p in window])
        await until(lambda: len(publishes(a.host, "c1")) == 4)
        await drain(a)
        assert [p.payload for p in publishes(a.host, "c1")] == [b"0", b"1", b"2", b"3"]
        assert len(a.host.transmitted) == entries + 1  # the refill of two, in one entry

        # QoS 2: the run's PUBRECs come back as PUBRELs in one entry, its PUBCOMPs as a refill.
        rest = publishes(a.host, "c1")[2:]
        a.coord.acknowledged("c1", "e1", [("puback", pid(p)) for p in rest])
        await until(lambda: len(publishes(a.host, "c1")) == 5)
        for i in range(3):
            b.coord.route(Publication("two/c1", b"q%d" % i, 2))
        await drain(b)
        await until(lambda: len(publishes(a.host, "c1")) == 6)
        a.coord.acknowledged("c1", "e1", [("puback", pid(publishes(a.host, "c1")[4]))])
        await until(lambda: len(publishes(a.host, "c1")) == 7)
        twos = publishes(a.host, "c1")[5:]
        assert [(p.payload, p.qos) for p in twos] == [(b"q0", 2), (b"q1", 2)]
        entries = len(a.host.transmitted)
        a.coord.acknowledged("c1", "e1", [("pubrec", pid(p)) for p in twos])
        await until(lambda: len(a.host.transmitted) == entries + 1)
        rels = [p for p in packets(a.host, "c1") if isinstance(p, Pubrel)]
        assert [r.packet_id for r in rels] == [pid(p) for p in twos]
        a.coord.acknowledged("c1", "e1", [("pubcomp", pid(p)) for p in twos])
        await until(lambda: len(publishes(a.host, "c1")) == 8)
        assert publishes(a.host, "c1")[7].payload == b"q2"


async def test_unacknowledged_messages_are_resent_with_dup_after_their_node_is_lost(
    redis_server: RedisServer,
) -> None:
    async with fleet(redis_server.url, "a", "b") as (a, b):
        a.online("c1", "e1")
        await held_session(a, "c1", "e1", {"cmd/c1": 2})
        await knows(b, "cmd/c1")
        b.coord.route(Publication("cmd/c1", b"one", 1))
        b.coord.route(Publication("cmd/c1", b"two", 2))
        b.coord.route(Publication("cmd/c1", b"three", 2))
        await until(lambda: len(publishes(a.host, "c1")) == 3)
        one, two, three = publishes(a.host, "c1")
        a.coord.session(Acked("c1", "e1", "pubrec", pid(two)))  # two is past PUBREC
        a.coord.session(Inbound("c1", 42, True))  # and a QoS 2 publish from the client, unreleased
        await until(lambda: len(packets(a.host, "c1")) == 4)
        await drain(a)
        a.scope.cancel()  # a crashes: its lease lapses, b's sweep detaches the session
        await until(lambda: b.coord.persistent_detached == 1)
        assert await session_field(redis_server.url, "c1", "holder") == b""
        b.coord.route(Publication("cmd/c1", b"four", 1))  # queued while the client is away
        await drain(b)
        opened = await b.coord.open_session("c1")
        assert opened == Opened(True, {"cmd/c1": 2}, frozenset({42}))
        attach(b, "c1", "e2")
        await until(lambda: len(packets(b.host, "c1")) == 4)
        again_one, rel, again_three, four = packets(b.host, "c1")
        assert isinstance(again_one, Publish) and isinstance(again_three, Publish) and isinstance(four, Publish)
        assert (again_one.payload, again_one.dup, again_one.packet_id) == (b"one", True, one.packet_id)
        assert rel == Pubrel(pid(two))  # where two had got to
        assert (again_three.payload, again_three.dup, again_three.packet_id) == (b"three", True, three.packet_id)
        assert (four.payload, four.dup) == (b"four", False)
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert not await r.exists([PREFIX + "pheld:a"])


async def test_a_node_declared_lost_while_alive_fences_the_connection_and_keeps_the_session(
    redis_server: RedisServer,
) -> None:
    async with fleet(redis_server.url, "a", "b") as (a, b):
        a.online("c1", "e1")
        await held_session(a, "c1", "e1", {"cmd/c1": 1})
        await knows(b, "cmd/c1")
        b.coord.route(Publication("cmd/c1", b"one", 1))
        await until(lambda: len(publishes(a.host, "c1")) == 1)
        await cut_off(redis_server.url, b, "a")
        assert b.coord.persistent_detached == 1
        # a registers again: the fleet ended that connection's presence meanwhile, so a
        # closes it (fenced) rather than take it back; the MQTT session waits, its
        # unacknowledged message kept, for the client's next connection.
        await until(lambda: a.host.evicted != [])
        assert a.host.evicted == [("c1", "e1", "this session was ended while its gateway could not reach redis")]
        a.coord.session(Detach("c1", "e1"))
        found = await a.coord.open_session("c1")
        assert found is not None and found.present
        attach(a, "c1", "e2")
        await until(lambda: len(publishes(a.host, "c1")) == 2)
        first, again = publishes(a.host, "c1")
        assert (again.payload, again.dup, again.packet_id) == (b"one", True, first.packet_id)
        assert await session_field(redis_server.url, "c1", "holder") == b"e2"


async def test_a_session_lost_with_redis_data_closes_its_connection(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a") as (a,):
        a.online("c1", "e1")
        await held_session(a, "c1", "e1", {"cmd/c1": 1})
        a.online("plain", "e2")  # a clean session: nothing was stored, nothing is lost
        await drain(a)
        await trio.to_thread.run_sync(redis_server.stop)
        await trio.sleep(2 * LEASE)
        await trio.to_thread.run_sync(redis_server.start)  # back, empty
        # Its client must reconnect, and learn from CONNACK that the session is gone.
        await until(lambda: a.host.evicted != [])
        await drain(a, settle=0.1)
        assert a.host.evicted == [("c1", "e1", "its persistent session was lost with Redis's data")]


async def test_the_acl_decides_per_message_which_sessions_get_a_copy(redis_server: RedisServer) -> None:
    def may_read(username: str | None, client_id: str, topic: str) -> bool:
        return username == "alice" or not topic.startswith("all/secret")

    async with fleet(redis_server.url, "a", "b", may_read=may_read) as (a, b):
        for client_id, username in [("c1", "alice"), ("c2", "bob"), ("c3", None)]:
            assert await a.coord.open_session(client_id, username) is not None
            a.coord.session(Subscribed(client_id, "all/#", 1))
            attach(a, client_id, "e-" + client_id)
        await drain(a)
        await knows(b, "all/#")
        b.coord.route(Publication("all/secret/x", b"secret", 1))
        b.coord.route(Publication("all/news", b"news", 1))
        await drain(a, b)
        await until(lambda: len(publishes(a.host, "c1")) == 2 and len(publishes(a.host, "c3")) == 1)
        await trio.sleep(0.1)
        assert [p.payload for p in publishes(a.host, "c1")] == [b"secret", b"news"]
        assert [p.payload for p in publishes(a.host, "c2")] == [b"news"]
        assert [p.payload for p in publishes(a.host, "c3")] == [b"news"]
        assert b.coord.persistent_routed == 4


async def test_a_session_expires_after_its_client_stayed_away(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", session_expiry=0.6) as (a, b):
        await held_session(a, "c1", "e1", {"cmd/c1": 1})
        await held_session(a, "held", "e9", {"cmd/held": 1})  # connected: never expires
        a.coord.session(Detach("c1", "e1"))
        await drain(a)
        await knows(b, "cmd/c1")
        b.coord.route(Publication("cmd/c1", b"waiting", 1))
        await drain(b)
        opened = await b.coord.open_session("c1")
        assert opened is not None and opened.present  # back in time
        await trio.sleep(0.7)
        await until(lambda: not b.coord.persistent_filters.matching("cmd/c1"))  # swept, fleet-wide
        assert a.coord.persistent_expired + b.coord.persistent_expired == 1
        assert await a.coord.open_session("c1") == Opened(False, {}, frozenset())
        assert await a.coord.open_session("held") == Opened(True, {"cmd/held": 1}, frozenset())
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert not await r.exists([PREFIX + "psub:c1", PREFIX + "pq:c1", PREFIX + "pf:cmd/c1"])
            assert await r.hget(PREFIX + "pstats", "queued_bytes") == b"0"
            assert await r.hget(PREFIX + "pstats", "expired") == b"1"


async def test_each_session_keeps_its_clients_own_expiry_in_the_script(redis_server: RedisServer) -> None:
    # MQTT 5.0 §3.1.2.11.2, in the fleet's script: each session's own expiry (its CONNACK's
    # Attach; a DISCONNECT's Detach may change it), not the fleet's; 0 ends it with its
    # connection; a resume-only open makes none; a takeover's open keeps the session alive
    # past the old connection's end, whatever that one's expiry.
    async with fleet(redis_server.url, "a", session_expiry=3600) as (a,):
        for client_id, expiry in (("brief", 1), ("long", 60), ("gone", 0)):
            assert await a.coord.open_session(client_id, v5=True, expiry=max(expiry, 1)) is not None
            a.coord.session(Subscribed(client_id, f"cmd/{client_id}", 1))
            a.online(client_id, "e1")
            a.coord.session(Attach(client_id, "e1", expiry))
        a.coord.session(Detach("brief", "e1"))
        a.coord.session(Detach("long", "e1", 600))  # its DISCONNECT lengthened it
        a.coord.session(Detach("gone", "e1"))  # expiry 0: it ends here
        await drain(a)
        a.coord.route(Publication("cmd/brief", b"waits", 1))
        await drain(a)
        assert await session_field(redis_server.url, "gone", "holder") is None
        assert await session_field(redis_server.url, "long", "exp") == b"600000"
        await trio.sleep(1.1)
        assert await a.coord.open_session("brief", v5=True, expiry=0, create=False) == Opened(
            False, {}, frozenset(), kept=False
        )  # due: ended at the open, though unswept
        opened = await a.coord.open_session("long", v5=True, expiry=0, create=False)
        assert opened is not None and opened.present and opened.subscriptions == {"cmd/long": 1}
        # A takeover: "long" is attached again (expiry 0), and a newer connection resumes it
        # before the older one's end is reported.
        a.online("long", "e2")
        a.coord.session(Attach("long", "e2", 0))
        await drain(a)
        assert await a.coord.open_session("long", v5=True, expiry=0, create=False) is not None
        a.coord.session(Detach("long", "e2"))
        await drain(a)
        assert await session_field(redis_server.url, "long", "holder") == b""  # kept for the newer one
        a.online("long", "e3")
        a.coord.session(Attach("long", "e3", 0))
        a.coord.session(Detach("long", "e3"))
        await drain(a)
        assert await session_field(redis_server.url, "long", "holder") is None  # ended with its connection
        assert a.coord.persistent_expired == 3  # gone, brief (at its open), long
        await a.coord.refresh_figures()
        assert figures(a.coord)["heartbeat_fleet_persistent_expired_messages"] == 1  # brief's one message


async def test_an_empty_session_is_discarded_and_a_report_the_script_fails_on_is_dropped(
    redis_server: RedisServer,
) -> None:
    # Lua wrote -0 for an empty session's queued bytes, which HINCRBY refuses: every
    # discard of a session with nothing queued failed, and the failed call was retried for
    # ever with every report behind it. Both mended: the discard, and a report a script
    # fails on is logged, counted and dropped.
    async with fleet(redis_server.url, "a") as (a,):
        await held_session(a, "empty", "e1", {"cmd/empty": 1})
        a.coord.discard_session("empty")
        await drain(a)
        assert await session_field(redis_server.url, "empty", "holder") is None
        async with coredis.Redis.from_url(redis_server.url) as r:
            await r.set(PREFIX + "ps:broken", "not a hash")  # the script fails on this session
        a.coord.session(Attach("broken", "e1"))
        await held_session(a, "after", "e2", {"cmd/after": 1})  # behind it in the queue
        assert await session_field(redis_server.url, "after", "holder") == b"e2"
        assert figures(a.coord)["heartbeat_fleet_failed"] == 1


async def test_a_clean_session_discards_the_stored_one(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b") as (a, b):
        await held_session(a, "c1", "e1", {"cmd/c1": 1, "all/#": 1})
        a.coord.session(Detach("c1", "e1"))
        await drain(a)
        await knows(b, "all/#")
        b.coord.route(Publication("cmd/c1", b"queued", 1))
        await drain(b)
        b.coord.discard_session("c1")  # CleanSession=1 on b
        await drain(b)
        await until(lambda: len(a.coord.persistent_filters) == 0 and len(b.coord.persistent_filters) == 0)
        assert await a.coord.open_session("c1") == Opened(False, {}, frozenset())
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert await r.hget(PREFIX + "pstats", "queued_bytes") == b"0"
            assert await r.hgetall(PREFIX + "pfilters") == {}
            assert not await r.exists([PREFIX + "pq:c1", PREFIX + "pfl:c1", PREFIX + "psub:c1"])


async def test_retained_messages_set_clear_bound_and_page(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", max_retained_bytes=60, retain_presence=False) as (a, b):
        b.coord.retention.page = 2  # several pages for every wildcard filter
        kept = [("cfg/a", b"v1", 1), ("cfg/b", b"v2", 0), ("cfg/c/d", b"v3", 2), ("cfg", b"root", 0)]
        kept += [("other/x", b"o", 0), ("$SYS/x", b"s", 0)]
        for topic, payload, qos in kept:
            a.coord.retain(topic, payload, qos)
        a.coord.retain("cfg/b", b"", 0)  # an empty payload clears
        a.coord.retain("big", b"x" * 30, 0)  # 38 bytes held + 33 > 60: refused
        await drain(a)
        assert a.coord.retained_refused == 1
        assert await collect(b.coord, "cfg/#") == [("cfg", b"root", 0), ("cfg/a", b"v1", 1), ("cfg/c/d", b"v3", 2)]
        assert await collect(b.coord, "cfg/+") == [("cfg/a", b"v1", 1)]
        assert await collect(b.coord, "other/x") == [("other/x", b"o", 0)]
        assert await collect(b.coord, "nothing/here") == []
        everything = [t for t, _, _ in await collect(b.coord, "#")]
        assert everything == ["cfg", "cfg/a", "cfg/c/d", "other/x"]  # not $SYS
        assert [t for t, _, _ in await collect(b.coord, "$SYS/#")] == ["$SYS/x"]
        # A replacement that does not fit is refused, and the old message stays (issue 33).
        a.coord.retain("cfg/a", b"y" * 40, 0)
        await drain(a)
        assert await collect(b.coord, "cfg/+") == [("cfg/a", b"v1", 1)]
        await b.coord.refresh_figures()
        seen = figures(b.coord)
        assert (seen["heartbeat_retained_messages"], seen["heartbeat_retained_bytes"]) == (5, 7 + 9 + 7 + 8 + 7)
        assert figures(a.coord)["heartbeat_retained_refused"] == 2


async def test_the_fleet_keeps_at_most_its_bound_of_persistent_sessions(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", max_sessions=2) as (a, b):
        assert await a.coord.open_session("c1") == Opened(False, {}, frozenset())
        assert await b.coord.open_session("c2") == Opened(False, {}, frozenset())
        assert await a.coord.open_session("c3") is None  # a third, on either node: refused
        assert await b.coord.open_session("c3") is None
        assert a.coord.persistent_refused == 1 and b.coord.persistent_refused == 1
        assert await b.coord.open_session("c1") == Opened(True, {}, frozenset())  # stored: resumes


async def test_one_client_fills_only_its_share_of_the_fleets_retained_messages(redis_server: RedisServer) -> None:
    options = {"max_retained_per_client": 3, "max_retained_bytes_per_client": 60, "retain_presence": False}
    async with fleet(redis_server.url, "a", "b", **options) as (a, b):
        b.coord.retain("victim/state", b"on", 1, "victim")
        for i in range(10):
            a.coord.retain(f"junk/{i}", b"x" * 10, 0, "attacker")  # 16 bytes each
        await drain(a, b)
        assert [t for t, _, _ in await collect(b.coord, "junk/#")] == ["junk/0", "junk/1", "junk/2"]
        assert a.coord.retained_refused == 7
        b.coord.retain("victim/state", b"off", 1, "victim")  # the store has room for others
        a.coord.retain("junk/0", b"", 0, "someone")  # clearing frees the attacker's share
        a.coord.retain("junk/9", b"x" * 10, 0, "attacker")
        await drain(a, b)
        assert await collect(a.coord, "victim/#") == [("victim/state", b"off", 1)]
        assert [t for t, _, _ in await collect(b.coord, "junk/#")] == ["junk/1", "junk/2", "junk/9"]
        # Taking a topic over moves it to the new client's share; a refusal keeps the old value.
        b.coord.retain("junk/1", b"taken", 0, "victim")
        a.coord.retain("junk/5", b"x" * 10, 0, "attacker")  # room again in its share
        a.coord.retain("junk/5", b"y" * 60, 0, "attacker")  # past its bytes: refused, old kept
        await drain(a, b)
        assert await collect(b.coord, "junk/5") == [("junk/5", b"x" * 10, 0)]
        assert await collect(b.coord, "junk/1") == [("junk/1", b"taken", 0)]


async def test_retained_presence_online_offline_and_its_ttl(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", "b", presence_offline_ttl=0.6) as (a, b):
        b.coord.retention.page = 1  # a SCAN per device record, or so
        a.coord.retain("presence-like/x", b"p", 0)
        a.online("dev-1", "e1")
        a.online("dev-2", "e2")
        a.offline("dev-2", "e2")
        b.online("dev-3", "e3")
        await drain(a, b)

        async def statuses(topic_filter: str) -> dict[str, str]:
            got = await collect(b.coord, topic_filter)
            assert all(qos == 0 for _, _, qos in got)
            return {t: json.loads(p)["status"] for t, p, _ in got if t.startswith(PRESENCE)}

        everyone = {f"{PRESENCE}dev-1": "online", f"{PRESENCE}dev-2": "offline", f"{PRESENCE}dev-3": "online"}
        assert await statuses(f"{PRESENCE}#") == everyone
        assert await statuses(f"{PRESENCE}+") == everyone
        assert await statuses("$SYS/#") == everyone
        assert await statuses("$SYS/+/dev-1") == {f"{PRESENCE}dev-1": "online"}
        assert await statuses(f"{PRESENCE}dev-2") == {f"{PRESENCE}dev-2": "offline"}
        assert await statuses(f"{PRESENCE}nobody") == {}
        # Presence is under $SYS/: a filter that starts with a wildcard matches none of it.
        assert await statuses("#") == {}
        assert await statuses("+/presence/#") == {}
        assert await statuses("+/+/dev-1") == {}
        assert [t for t, _, _ in await collect(b.coord, "#")] == ["presence-like/x"]
        assert await collect(b.coord, "sensors/#") == []
        await trio.sleep(0.7)  # the offline entry ages out; the online ones stay
        assert await statuses(f"{PRESENCE}#") == {f"{PRESENCE}dev-1": "online", f"{PRESENCE}dev-3": "online"}
        b.coord.retention.presence = False  # --no-retain-presence
        assert await statuses(f"{PRESENCE}#") == {}


async def test_redis_down_refuses_open_and_never_blocks_reports(redis_server: RedisServer) -> None:
    async with fleet(redis_server.url, "a", open_timeout=0.3) as (a,):
        assert await a.coord.open_session("c1") == Opened(False, {}, frozenset())
        await trio.to_thread.run_sync(redis_server.stop)
        started = time.perf_counter()
        a.coord.session(Subscribed("c1", "cmd/c1", 1))
        a.coord.retain("cfg/x", b"v", 0)
        assert time.perf_counter() - started < 0.05
        assert await a.coord.open_session("c1") is None  # not a new, empty session
        assert time.perf_counter() - started < 1.0
        assert a.coord.opens_refused == 1
        assert await a.coord.retained("cfg/#", None) == ([], None)
        await trio.to_thread.run_sync(redis_server.start)  # back, empty
        await drain(a, settle=0)
        opened = await a.coord.open_session("c1")
        assert opened == Opened(False, {}, frozenset())


async def test_a_node_is_a_member_routing_by_the_others_filters_once_started(redis_server: RedisServer) -> None:
    # A gateway listens as soon as its coordinator has started. If that came before its
    # lease, a SUBACK on another gateway did not wait for it; if before its reader and
    # renewer read the others' filters, it routed by none: a reply published through
    # it at once was lost (test_a_message_published_on_another_gateway_just_after...).
    async with fleet(redis_server.url, "a") as (a,):
        a.host.subscribed.add("reply/#")
        a.coord.filters_changed({"reply/#"})
        assert await a.coord.settle()
        b = RedisCoordinator(redis_server.url, "b", lease=LEASE, renew=RENEW)
        async with trio.open_nursery() as nursery:
            await nursery.start(b.run, RecordingHost())
            # Checked before anything else awaits, so that nothing joins meanwhile.
            assert b.reader.ready.is_set()
            assert b.route(Publication("reply/1", b"answer", 1)) == [] and b.route_skipped == 0
            async with coredis.Redis.from_url(redis_server.url) as r:
                assert await r.exists([PREFIX + "node:b"]) == 1
                assert await r.smembers(PREFIX + "members") == {b"a", b"b"}
            await until(lambda: a.host.messages() == [("reply/1", b"answer")])
            nursery.cancel_scope.cancel()


async def test_a_node_starts_while_redis_is_slow_and_joins_later(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with coredis.Redis.from_url(redis_server.url) as r:
        await r.client_pause(1500)  # every client waits, the coordinator's too
    b = RedisCoordinator(redis_server.url, "b", lease=LEASE, renew=RENEW, open_timeout=0.3)
    async with trio.open_nursery() as nursery:
        started = time.perf_counter()
        await nursery.start(b.run, RecordingHost())
        assert time.perf_counter() - started < 1.0  # bounded by open_timeout, not the pause
        assert any("serving before the fleet counts it a member (redis is slow" in m for m in caplog.messages)
        await until(lambda: b.reader.ready.is_set() and b.lease_keeper.joined.is_set())
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ process level


async def members_down_to(url: str, count: int, limit: float = 15.0) -> None:
    """Wait until the fleet has ``count`` members (the others declared lost and swept)."""
    async with coredis.Redis.from_url(url) as r:
        with trio.fail_after(limit):
            while len(await r.smembers(PREFIX + "members")) > count:  # noqa: ASYNC110 (Redis is polled)
                await trio.sleep(0.05)


def start_gateways(redis_server: RedisServer, gateways: list[Any], *extra: str) -> list[int]:
    """Two gateways on ``redis_server`` (appended to ``gateways``, for the caller to
    kill by PID); their ports."""
    ports = []
    for i in range(2):
        port = free_port()
        args = ["--cluster", redis_server.url, "--node", f"gw{i}", "--tick", "0.05", *extra]
        gateways.append(start_heartbeat(port, 1, args, cwd=str(ROOT)))
        ports.append(port)
    return ports


def test_a_persistent_session_roams_between_gateways_and_outlives_a_killed_one(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    gateways: list[Any] = []
    try:
        port_a, port_b = start_gateways(redis_server, gateways, "--lease", "2")
        dev = Raw(port_a, "roamer", clean=False)
        assert dev.connack == encoders.encode_connack(False, 0)
        assert dev.subscribe("cmd/roamer", 1) == encoders.encode_suback(1, [1])
        dev.close()
        # The SUBACK waited until gateway B knew of the persistent filter; the wait is for
        # A's Detach to reach Redis (else the message goes to A's connection, in flight,
        # and comes again with DUP, as it should).
        time.sleep(0.3)
        publish(port_b, "cmd/roamer", [b"while-away"])
        back = Raw(port_b, "roamer", clean=False)
        assert back.connack == encoders.encode_connack(True, 0)
        [got] = back.publishes(1)
        assert (got.payload, got.dup) == (b"while-away", False)
        back.send(encoders.encode_puback(got.packet_id))
        back.close()
        # Its PUBACK must reach Redis before the client attaches elsewhere; else the
        # message is resent there with DUP, as it should be (at least once).
        time.sleep(0.3)

        # On A again; a message in flight (never acknowledged) when A is killed.
        dev = Raw(port_a, "roamer", clean=False)
        assert dev.connack == encoders.encode_connack(True, 0)
        publish(port_b, "cmd/roamer", [b"in-flight"])
        [pending] = dev.publishes(1)
        gateways[0].kill()  # SIGKILL, by PID
        gateways[0].wait()
        dev.sock.close()
        # Published before A is declared lost: the session is still held by A's dead
        # connection, so it was sent there (into A's route stream, never read).
        publish(port_b, "cmd/roamer", [b"after"])
        again = Raw(port_b, "roamer", clean=False)  # no need to wait for A to be declared lost
        assert again.connack == encoders.encode_connack(True, 0)
        resent, after = again.publishes(2)
        assert (resent.payload, resent.dup, resent.packet_id) == (b"in-flight", True, pending.packet_id)
        assert (after.payload, after.dup) == (b"after", True)
        again.send(encoders.encode_puback(resent.packet_id))
        again.send(encoders.encode_puback(after.packet_id))
        assert again.quiet_for(0.3)
        # Once A's node is swept, the session B holds now is left alone: still delivered live.
        trio.run(members_down_to, redis_server.url, 1)
        publish(port_b, "cmd/roamer", [b"later"])
        [later] = again.publishes(1)
        assert (later.payload, later.dup) == (b"later", False)
        again.close()
    finally:
        for proc in gateways:
            if proc.poll() is None:
                proc.kill()  # by PID
                proc.wait()


def test_a_message_published_on_another_gateway_just_after_the_suback_is_delivered(
    redis_server: RedisServer,
) -> None:
    # Subscribe, then have the reply published at once through the other gateway: its
    # filters used to reach that gateway only when its renewer and reader came round,
    # and every one of these was lost.
    gateways: list[Any] = []
    try:
        ports = start_gateways(redis_server, gateways)
        assert unanswered(ports[0], ports[1], 12) == []
    finally:
        for proc in gateways:
            proc.kill()  # by PID
            proc.wait()
