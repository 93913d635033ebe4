"""The durable store (issue 62) on its own: what is committed comes back whole, the
file is refused when it cannot be trusted, a failed commit is retried, and PUBACKs wait
for their group's commit in sync ``always`` only. No server process here (see
test_durable_server.py); times under trio's MockClock."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.history import check_history
from servers.heartbeat.broker.outbox import Stage
from servers.heartbeat.broker.persistent import SessionStore
from servers.heartbeat.broker.reports import Attach, Detach, Inbound, Subscribed
from servers.heartbeat.coordination.durable import SCHEMA_VERSION, Durability, StoreFileError, open_database
from servers.heartbeat.coordination.durable.keeper import Batch
from servers.heartbeat.coordination.inprocess import InProcessCoordinator
from servers.heartbeat.coordination.registry import Registry
from servers.heartbeat.coordination.retention import MqttState, Retention
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.filters import pack_options
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.mqtt.v5.outbound import forwarded
from servers.heartbeat.mqtt.v5.properties import Properties
from servers.heartbeat.presence.event import PresenceEvent, PresenceLog


class Clock:
    """A clock a test moves by hand (wall, session store and outboxes all on it)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Box:
    """One owner's state, kept durably at ``path``."""

    path: Path
    clock: Clock
    durability: Durability
    registry: Registry
    retention: Retention
    store: SessionStore

    @classmethod
    def open(cls, path: Path, clock: Clock, sync: str = "always") -> tuple[Box, list[PresenceEvent]]:
        durability = Durability(str(path), sync=sync, store_clock=clock, outbox_clock=clock, wall_clock=clock)
        registry = Registry()
        state = MqttState(SessionStore())
        retention = state.retention(registry, "$SYS/presence/", clock)
        ended = durability.restore(registry, retention, state.store).ended
        return cls(path, clock, durability, registry, retention, state.store), ended


def online(client_id: str, epoch: str, at: float) -> PresenceEvent:
    return PresenceEvent("online", client_id, "peer", None, 0.0, at, epoch=epoch, keep_alive=30)


def offline(event: PresenceEvent, at: float) -> PresenceEvent:
    return dataclasses.replace(event, status="offline", reason=Offline.DISCONNECT, time=at)


def sessions_of(store: SessionStore) -> dict[str, Any]:
    """What a session store holds, as plain data to compare (holders aside)."""
    out = {}
    for client_id in sorted(store._sessions):
        s = store._sessions[client_id]
        out[client_id] = {
            "username": s.username,
            "v5": s.v5,
            "expiry": s.expiry,
            "subscriptions": dict(s.subscriptions),
            "options": dict(store.subscriptions.options(client_id) or {}),
            "inbound": set(s.inbound),
            "inflight": [(m.topic, m.payload, m.qos, m.packet_id, m.stage, m.properties) for m in s.outbox.inflight()],
            "queued": [(m.topic, m.payload, m.qos, m.properties) for m in s.outbox.queued()],
        }
    return out


def retained_of(retention: Retention) -> dict[str, Any]:
    store = retention.store
    return {topic: store.get(topic, 0.0) for topic in sorted(store._entries)}


# -- the property: whatever happened, what was committed comes back -------------------------

CLIENTS = ["c0", "c1", "c2"]
TOPICS = ["a/1", "a/2", "b/1"]
FILTERS = ["a/+", "a/1", "#", "b/1"]

operation = st.one_of(
    st.tuples(st.just("open"), st.sampled_from(CLIENTS), st.booleans()),
    st.tuples(st.just("attach"), st.sampled_from(CLIENTS), st.integers(1, 3)),
    st.tuples(st.just("detach"), st.sampled_from(CLIENTS)),
    st.tuples(st.just("subscribe"), st.sampled_from(CLIENTS), st.sampled_from(FILTERS), st.integers(0, 2)),
    st.tuples(st.just("unsubscribe"), st.sampled_from(CLIENTS), st.sampled_from(FILTERS)),
    st.tuples(st.just("publish"), st.sampled_from(TOPICS), st.integers(1, 2), st.binary(min_size=1, max_size=4)),
    st.tuples(st.just("ack"), st.sampled_from(CLIENTS), st.sampled_from(["puback", "pubrec", "pubcomp"])),
    st.tuples(st.just("inbound"), st.sampled_from(CLIENTS), st.integers(1, 3), st.booleans()),
    st.tuples(st.just("discard"), st.sampled_from(CLIENTS)),
    st.tuples(st.just("retain"), st.sampled_from(TOPICS), st.binary(max_size=3)),
    st.tuples(st.just("device"), st.sampled_from(CLIENTS), st.booleans()),
    st.tuples(
        st.just("commit"),
    ),
)


def apply(box: Box, op: tuple[Any, ...], epochs: dict[str, str]) -> None:
    store, clock = box.store, box.clock
    clock.now += 1.0
    kind = op[0]
    if kind == "open":
        store.open(op[1], False, clock.now, "user", op[2], expiry=3600)
    elif kind == "attach":
        epochs[op[1]] = f"e{op[2]}"
        store.apply(Attach(op[1], f"e{op[2]}"), clock.now)
    elif kind == "detach" and op[1] in epochs:
        store.apply(Detach(op[1], epochs.pop(op[1])), clock.now)
    elif kind == "subscribe":
        store.apply(Subscribed(op[1], op[2], op[3], pack_options(no_local=op[3] == 2, identifier=op[3])), clock.now)
    elif kind == "unsubscribe":
        store.apply(Subscribed(op[1], op[2], None), clock.now)
    elif kind == "publish":
        store.route(Publication(op[1], op[3], op[2], False, forwarded(Properties(content_type="x"))))
    elif kind == "ack":
        stored = store.get(op[1])
        if stored is not None and stored.holder is not None:
            for message in stored.outbox.inflight()[:1]:
                store.acknowledge(op[1], stored.holder, op[2], message.packet_id)
    elif kind == "inbound":
        store.apply(Inbound(op[1], op[2], op[3]), clock.now)
    elif kind == "discard":
        store.discard(op[1])
        epochs.pop(op[1], None)
    elif kind == "retain":
        box.retention.retain(op[1], op[2], 1, "owner")
    elif kind == "device":
        record = box.registry.get(op[1])
        if op[2] or record is None or record.status == "offline":
            box.registry.online(online(op[1], f"{op[1]}-{clock.now}", clock.now))
        else:
            box.registry.offline(offline(record, clock.now))
    elif kind == "commit":
        assert box.durability.commit()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(operation, max_size=40))
def test_what_was_committed_comes_back_whole(tmp_path_factory: pytest.TempPathFactory, ops: list[Any]) -> None:
    path = tmp_path_factory.mktemp("store") / "state.db"
    clock = Clock()
    box, _ = Box.open(path, clock)
    epochs: dict[str, str] = {}
    for op in ops:
        apply(box, op, epochs)
    assert box.durability.commit()
    sessions, retained = sessions_of(box.store), retained_of(box.retention)
    records = {e.client_id: e for e in box.registry}
    box.durability.abandon()  # a crash: nothing more is written, not even "stopped"

    again, ended = Box.open(path, clock)
    # In-flight messages are resent with DUP after a restart: every one counts as sent.
    assert sessions_of(again.store) == sessions
    assert retained_of(again.retention) == retained
    assert {e.client_id for e in ended} == {c for c, e in records.items() if e.status == "online"}
    for event in ended:
        assert event.reason is Offline.SERVER_LOST and event.epoch == records[event.client_id].epoch
    assert {e.client_id: e.status for e in again.registry} == dict.fromkeys(records, "offline")
    again.durability.close(clean=True)


# -- clocks across the restart ---------------------------------------------------------------


def test_expiries_keep_counting_in_wall_time_while_the_server_is_down(tmp_path: Path) -> None:
    clock = Clock()
    box, _ = Box.open(tmp_path / "s.db", clock)
    store = box.store
    store.open("short", False, clock.now, None, False, expiry=100)
    store.open("long", False, clock.now, None, True, expiry=10_000)
    store.apply(Subscribed("long", "t", 1), clock.now)
    ten = forwarded(Properties(message_expiry_interval=50))
    store.route(Publication("t", b"expires", 1, False, ten))
    store.route(Publication("t", b"stays", 1, False, b""))
    box.retention.retain("r/expires", b"x", 0, "o", forwarded(Properties(message_expiry_interval=30)))
    box.retention.retain("r/stays", b"y", 0, "o")
    box.durability.close(clean=True)

    clock.now += 60  # down a minute: 60 s of every expiry have gone
    again, ended = Box.open(tmp_path / "s.db", clock)
    assert ended == []
    assert sorted(again.retention.store._entries) == ["r/stays"]
    assert again.store.get("short") is not None
    assert again.store.expire(clock.now + 41) == ["short"]  # 100 s after it left, not after the restart
    stored = again.store.get("long")
    assert stored is not None
    assert [m.payload for m in stored.outbox.queued()] == [b"expires", b"stays"]
    clock.now += 1  # 61 s of the message's 50 have gone: it is dropped, not sent
    packets = again.store.attach("long", "e1")
    assert packets is not None and len(packets.packets) == 1 and b"stays" in packets.packets[0]


def test_a_qos2_exchange_past_pubrec_resumes_with_pubrel_and_its_packet_id(tmp_path: Path) -> None:
    clock = Clock()
    box, _ = Box.open(tmp_path / "s.db", clock)
    store = box.store
    store.open("c", False, clock.now, None, False, expiry=600)
    store.apply(Subscribed("c", "t", 2), clock.now)
    store.apply(Attach("c", "e1"), clock.now)
    store.route(Publication("t", b"one", 2, False))
    store.route(Publication("t", b"two", 2, False))
    box.durability.commit()  # written as sent; the PUBREC below updates the row in place
    store.acknowledge("c", "e1", "pubrec", 1)
    store.apply(Inbound("c", 7, True), clock.now)
    box.durability.commit()
    box.durability.abandon()

    again, _ = Box.open(tmp_path / "s.db", clock)
    stored = again.store.get("c")
    assert stored is not None and stored.inbound == {7}
    assert [(m.packet_id, m.stage) for m in stored.outbox.inflight()] == [(1, Stage.RELEASED), (2, Stage.PUBLISHED)]
    delivery = again.store.attach("c", "e2")
    assert delivery is not None
    pubrel, publish = delivery.packets
    assert pubrel == b"\x62\x02\x00\x01"
    assert publish[0] & 0x08 and publish.endswith(b"two")  # resent with DUP, packet id 2


def test_a_queued_message_sent_after_a_commit_is_resumed_as_sent(tmp_path: Path) -> None:
    clock = Clock()
    box, _ = Box.open(tmp_path / "s.db", clock)
    store = box.store
    store.open("c", False, clock.now, None, False, expiry=600)
    store.apply(Subscribed("c", "t", 1), clock.now)
    store.route(Publication("t", b"while-away", 1, False))
    assert box.durability.commit()  # queued: no packet id yet
    store.apply(Attach("c", "e1"), clock.now)  # sent now, as packet 1
    assert box.durability.commit()
    box.durability.abandon()
    again, _ = Box.open(tmp_path / "s.db", clock)
    stored = again.store.get("c")
    assert stored is not None
    assert [(m.packet_id, m.payload) for m in stored.outbox.inflight()] == [(1, b"while-away")]
    assert stored.outbox.queued() == []


def test_a_clean_stop_says_server_shutdown_at_its_time_and_a_crash_server_lost(tmp_path: Path) -> None:
    clock = Clock()
    box, _ = Box.open(tmp_path / "s.db", clock)
    box.registry.online(online("dev", "epoch-1", clock.now))
    box.durability.commit()
    clock.now += 5
    stopped_at = clock.now
    box.durability.close(clean=True)
    clock.now += 100
    again, ended = Box.open(tmp_path / "s.db", clock)
    (event,) = ended
    assert (event.reason, event.time, event.epoch, event.keep_alive) == (
        Offline.SERVER_SHUTDOWN,
        stopped_at,
        "epoch-1",
        30,
    )
    record = again.registry.get("dev")
    assert record is not None and record.reason is Offline.SERVER_SHUTDOWN
    again.registry.online(online("dev", "epoch-2", clock.now))
    again.durability.commit()
    alive_at = clock.now
    again.durability.abandon()  # killed
    clock.now += 100
    third, ended = Box.open(tmp_path / "s.db", clock)
    (event,) = ended
    assert (event.reason, event.epoch, event.time) == (Offline.SERVER_LOST, "epoch-2", alive_at)
    third.durability.close(clean=True)
    fourth, ended = Box.open(tmp_path / "s.db", clock)
    assert ended == []  # told once
    fourth.durability.close(clean=True)


# -- failures ---------------------------------------------------------------------------------


def test_a_failed_commit_refuses_what_it_cannot_keep_and_recovers_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    box, _ = Box.open(tmp_path / "s.db", clock)
    durability, store = box.durability, box.store
    store.open("away", False, clock.now, None, False, expiry=600)
    store.apply(Subscribed("away", "t", 1), clock.now)
    assert durability.commit()
    real_write = durability.write

    def full(batch: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(durability, "write", full)
    store.route(Publication("t", b"kept-in-memory", 1, False))
    assert not durability.commit()
    assert durability.failure == "database or disk is full"
    # Meanwhile: refused and counted, the old values stay.
    assert not box.retention.retain("r", b"new", 0, "o") and box.retention.unkept == 1
    store.route(Publication("t", b"refused", 1, False))
    assert store.unkept == 1
    assert not durability.commit()

    monkeypatch.setattr(durability, "write", real_write)
    assert durability.commit() and durability.failure is None
    assert box.retention.writable and store.keeps_absent
    durability.abandon()
    again, _ = Box.open(tmp_path / "s.db", clock)
    stored = again.store.get("away")
    assert stored is not None and [m.payload for m in stored.outbox.queued()] == [b"kept-in-memory"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"just some text, not a database\n", "is not an SQLite database"),
        (None, "of another program"),
        ("newer", "was written by a newer version (schema 99; this server reads up to 1)"),
        ("corrupt", "is corrupt"),
    ],
)
def test_a_file_that_cannot_be_trusted_is_refused_and_left_as_it_was(
    tmp_path: Path, content: bytes | str | None, why: str
) -> None:
    path = tmp_path / "state.db"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is None:
        with sqlite3.connect(path) as other:
            other.execute("CREATE TABLE mine (x)")
    else:
        open_database(str(path)).close()
        if content == "newer":
            with sqlite3.connect(path) as db:
                db.execute("PRAGMA user_version = 99")
        else:
            db = sqlite3.connect(path)
            db.executemany("INSERT INTO devices VALUES (?, '{}', 0, ?)", [(f"d{i:05}" * 40, i) for i in range(3000)])
            db.commit()
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.close()
            data = bytearray(path.read_bytes())
            data[8192:12288] = b"\xa5" * 4096  # a page in the middle, overwritten
            path.write_bytes(bytes(data))
    before = path.read_bytes()
    with pytest.raises(StoreFileError) as refused:
        Durability(str(path))
    assert str(refused.value).startswith(f"{path}: ") and why in str(refused.value)
    assert "\n" not in str(refused.value)
    assert path.read_bytes() == before


def test_a_store_in_use_by_another_server_is_refused_naming_its_pid(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = Durability(str(path))
    with pytest.raises(StoreFileError) as refused:
        Durability(str(path))
    assert str(refused.value) == f"{path}: is in use by another server (pid {os.getpid()}): a store has one server"
    first.close(clean=True)
    Durability(str(path)).close(clean=True)  # let go: the next one takes it


def test_a_file_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreFileError, match=r"its directory .* does not exist"):
        Durability(str(tmp_path / "nowhere" / "state.db"))


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes a read-only file anyway (test_durable_server mounts a read-only one)"
)
def test_a_file_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    open_database(str(path)).close()
    path.chmod(0o444)
    with pytest.raises(StoreFileError, match="cannot be written"):
        Durability(str(path))


def test_the_schema_version_is_written() -> None:
    assert SCHEMA_VERSION == 1


# -- PUBACKs and the sync modes ------------------------------------------------------------


async def inline(write: Callable[[Batch], None], batch: Batch) -> None:
    write(batch)


async def coordinator(path: Path, sync: str) -> InProcessCoordinator:
    durability = Durability(str(path), sync=sync, interval=0.5, autosave=60.0, store_clock=trio.current_time)
    coordinator = InProcessCoordinator(durability=durability)
    assert coordinator.committer is not None
    coordinator.committer.runner = inline  # no thread: MockClock would jump past its real time
    opened = await coordinator.open_session("away", expiry=10**9)  # MockClock jumps while a commit runs
    assert opened is not None
    coordinator.session(Subscribed("away", "t", 1))
    return coordinator


def queued_on_disk(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT COUNT(*) FROM messages").fetchone()[0])


class NoHost:
    def deliver(self, *args: object, **kw: object) -> None:
        pass

    def evict(self, *args: object) -> None:
        pass

    def sessions(self) -> list[PresenceEvent]:
        return []

    def filters(self) -> set[str]:
        return set()

    def transmit(self, *args: object, **kw: object) -> None:
        pass


async def test_sync_always_a_puback_waits_for_the_commit_that_has_its_message(
    tmp_path: Path, clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "s.db"
    c = await coordinator(path, "always")
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run, NoHost())
        c.route(Publication("t", b"m", 1, False))
        mark = c.commit_mark()
        assert mark is not None and queued_on_disk(path) == 0
        assert await c.committed(mark)
        assert queued_on_disk(path) == 1
        assert c.commit_mark() is None  # nothing left to wait for
        nursery.cancel_scope.cancel()


async def test_sync_interval_commits_on_its_timer_and_pubacks_do_not_wait(
    tmp_path: Path, clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "s.db"
    c = await coordinator(path, "interval")
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run, NoHost())
        c.route(Publication("t", b"m", 1, False))
        assert c.commit_mark() is None
        await trio.sleep(0.6)
        assert queued_on_disk(path) == 1
        nursery.cancel_scope.cancel()


async def test_sync_off_commits_only_at_its_autosave_and_at_the_stop(
    tmp_path: Path, clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "s.db"
    c = await coordinator(path, "off")
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run, NoHost())
        c.route(Publication("t", b"one", 1, False))
        assert c.commit_mark() is None
        await trio.sleep(30)
        assert queued_on_disk(path) == 0  # Mosquitto's shape: a crash now loses it
        await trio.sleep(31)
        assert queued_on_disk(path) == 1
        c.route(Publication("t", b"two", 1, False))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert queued_on_disk(path) == 2  # the stop commits the rest


async def test_a_commit_that_fails_answers_false_and_health_says_why(
    tmp_path: Path, clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.db"
    c = await coordinator(path, "always")
    assert c.durability is not None
    real_write = c.durability.write

    def full(batch: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    async with trio.open_nursery() as nursery:
        await nursery.start(c.run, NoHost())
        monkeypatch.setattr(c.durability, "write", full)
        c.route(Publication("t", b"m", 1, False))
        mark = c.commit_mark()
        assert mark is not None
        assert not await c.committed(mark)
        assert not c.health().ok and "database or disk is full" in c.health().detail
        writable = [m for m in c.figures() if m.name == "heartbeat_durable_writable"]
        assert writable and writable[0].samples[0].value == 0
        monkeypatch.setattr(c.durability, "write", real_write)
        await trio.sleep(1.5)  # the retry, a second later
        assert c.health().ok and queued_on_disk(path) == 1
        nursery.cancel_scope.cancel()


def test_a_big_registry_comes_back_with_every_online_device_ended_once(tmp_path: Path) -> None:
    """Every record in one commit, in the order of their last change (the order the
    registry sheds by); the time it takes is the benchmark's (benchmarks/durability.py)."""
    clock = Clock()
    box, _ = Box.open(tmp_path / "s.db", clock)
    for i in range(20_000):
        box.registry.online(online(f"d{i}", f"e{i}", clock.now))
    box.registry.offline(offline(online("d5", "e5", clock.now), clock.now + 1))
    assert box.durability.commit()
    box.durability.close(clean=True)
    again, ended = Box.open(tmp_path / "s.db", clock)
    assert len(ended) == 19_999 and len(again.registry) == 20_000
    assert "d5" not in {e.client_id for e in ended}


async def test_the_operators_page_lists_the_ends_from_before_the_restart_then_the_restart_s(
    tmp_path: Path, clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "s.db"
    first = InProcessCoordinator(durability=Durability(str(path), store_clock=trio.current_time))
    early = online("left-earlier", "e1", 100.0)
    first.online(early)
    first.offline(offline(early, 200.0))
    first.online(online("still-on", "e2", 300.0))
    assert first.durability is not None
    first.durability.close(clean=True)

    again = InProcessCoordinator(durability=Durability(str(path), store_clock=trio.current_time))
    body = await again.overview()
    assert body is not None
    recent = [(e["client_id"], e["reason"]) for e in body["recent"]]
    assert recent == [("still-on", "server-shutdown"), ("left-earlier", "disconnect")]  # newest first
    assert body["ends"] == {"server-shutdown": 1}  # this process's own ends: the restart's
    assert again.durability is not None
    again.durability.close(clean=True)


def lone(path: Path, log: Path) -> InProcessCoordinator:
    """A lone worker's coordinator on ``path``, writing its presence log to ``log``."""
    durability = Durability(str(path), store_clock=trio.current_time)
    return InProcessCoordinator([PresenceLog(str(log))], durability=durability)


def logged(*logs: Path) -> list[tuple[str, str, object]]:
    return [
        (e["client_id"], e["status"], e.get("reason"))
        for log in logs
        for e in (json.loads(line) for line in log.read_text().splitlines())
    ]


@pytest.mark.parametrize("crash", ["before-telling", "after-telling"])
async def test_an_event_reaches_the_presence_log_once_whenever_the_crash_comes(
    tmp_path: Path, clock: trio.testing.MockClock, crash: str
) -> None:
    store, first_log, second_log = tmp_path / "s.db", tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    first = lone(store, first_log)
    assert first.durability is not None
    first.online(online("dev", "e1", 100.0))  # held: its record is not on disk yet
    assert logged(first_log) == []
    batch = first.durability.collect()
    first.durability.write(batch)  # on disk...
    if crash == "after-telling":
        first.durability.done(batch, None)  # ...and told; the told row's deletion never committed
        assert logged(first_log) == [("dev", "online", None)]
    first.durability.abandon()  # kill -9

    second = lone(store, second_log)
    everything = logged(first_log, second_log)
    assert everything == [("dev", "online", None), ("dev", "offline", "server-lost")]
    assert check_history(
        json.loads(line) for log in (first_log, second_log) for line in log.read_text().splitlines()
    ).ok
    assert second.durability is not None
    second.durability.close(clean=True)
