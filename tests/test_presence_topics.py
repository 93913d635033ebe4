"""Presence under ``$SYS/presence/<client-id>`` (issue 28, item 6): a subscriber to ``#``
or ``+/...`` hears devices' own messages and never their presence (MQTT-4.7.2-1), on a
lone server, with ``--workers 2`` and in a Redis fleet; ``$SYS/presence/#`` hears
every device come online and go offline; ``--presence-prefix presence/`` keeps the old
topics; no client may publish, or leave a Will, under the prefix; a bad prefix is
refused at startup.

Pure checks and the in-process server (MockClock) first; then the server as its own
process against paho-mqtt, ``mosquitto_sub``/``mosquitto_pub`` and raw sockets (wall
clock, every process stopped by its PID).

"Never" is checked with a marker: once a ``$SYS/presence/#`` subscriber on a worker
has heard a device's offline event, that worker has handed the event to every local
subscriber it matches, so a ``#`` subscriber there would have it queued before any
message published afterwards. Each ``#`` subscriber's stream is read up to such a
marker message, and must hold no presence.
"""

from __future__ import annotations

import inspect
import json
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.broker.subscriptions import Subscriptions
from servers.heartbeat.broker.topics import FilterIndex, TopicTree
from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.coordination import Coordinator
from servers.heartbeat.coordination.authority import Authority
from servers.heartbeat.coordination.fleet import RedisCoordinator
from servers.heartbeat.coordination.fleet.filters import FilterCache
from servers.heartbeat.coordination.inprocess import InProcessCoordinator
from servers.heartbeat.coordination.local import BusCoordinator
from servers.heartbeat.coordination.retention import matches_every_presence_topic, presence_possible
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.filters import topic_matches
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.policy import LEGACY_PRESENCE_PREFIX, SessionPolicy, check_presence_prefix
from servers.heartbeat.security.acl import AclFile

from .redis_server import RedisServer, require_binary
from .test_heartbeat import Client, publish_topic, running
from .test_heartbeat_clients import IN_CI, ROOT, Server, metric, paho_client, raw_connect, start_server, subscriber
from .test_presence_faults import until, where

__all__ = ["start_server"]  # the fixture, shared with the other process tests

Got = list[tuple[str, dict[str, object]]]

READY = "data/ready"
"""Retained before the subscribers come: a subscriber that has it is subscribed."""
MARKER = "data/end"
"""Published once every presence subscriber heard the device go: read up to here."""
HASH = ["#"]
PLUS_FILTERS = ["+/presence/#", "+/+/dev-1", "+/end"]
"""Filters starting with a wildcard that would match a presence topic if ``$`` did not
keep it out; ``+/end`` only takes the marker."""

needs_mosquitto_clients = pytest.mark.skipif(
    (shutil.which("mosquitto_sub") is None or shutil.which("mosquitto_pub") is None) and not IN_CI,
    reason="mosquitto-clients not installed (apt-get install mosquitto-clients; CI installs it)",
)


# -- the prefix: default, checks ----------------------------------------------------------


def test_the_default_prefix_is_under_sys_and_every_default_is_that_one_constant() -> None:
    assert PRESENCE == "$SYS/presence/"
    assert HeartbeatConfig().presence_prefix == PRESENCE
    assert SessionPolicy().presence_prefix == PRESENCE
    assert Coordinator.presence_prefix == PRESENCE
    for cls in (InProcessCoordinator, BusCoordinator, Authority, RedisCoordinator):
        default = inspect.signature(cls).parameters["presence_prefix"].default
        assert default == PRESENCE, cls


@pytest.mark.parametrize("prefix", [PRESENCE, LEGACY_PRESENCE_PREFIX, "$iot/presence/", "status/", "é/ü/", "/"])
def test_a_prefix_ending_a_level_without_wildcards_is_accepted(prefix: str) -> None:
    assert check_presence_prefix(prefix) == prefix
    assert HeartbeatConfig(presence_prefix=prefix).presence_prefix == prefix


BAD_PREFIXES = [
    ("", "is empty"),
    ("$SYS/presence", "must end with '/'"),
    ("presence/+/", "holds a wildcard"),
    ("presence/#", "holds a wildcard"),
    ("a\x00/", "holds NUL"),
    ("a\x1b[2J/", "control character"),
    ("a\ufffe/", "non-character"),
    ("$share/group/", "$share/"),
    ("p" * 1100 + "/", "longer than 1024 bytes"),
]


@pytest.mark.parametrize(("prefix", "why"), BAD_PREFIXES)
def test_a_bad_prefix_is_refused_with_the_reason(prefix: str, why: str) -> None:
    with pytest.raises(ValueError, match="presence prefix") as info:
        check_presence_prefix(prefix)
    assert why in str(info.value)
    with pytest.raises(ValueError, match="presence prefix"):
        HeartbeatConfig(presence_prefix=prefix)


@pytest.mark.parametrize(("prefix", "why"), [p for p in BAD_PREFIXES if "\x00" not in p[0]])
def test_the_cli_refuses_a_bad_prefix_at_startup(prefix: str, why: str) -> None:
    # Argument parsing fails before any socket is opened: exit 2, the reason on stderr.
    done = subprocess.run(
        [sys.executable, "-m", "servers.heartbeat", "--port", "0", "--presence-prefix", prefix],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m servers.heartbeat: error: --presence-prefix: the presence prefix")
    assert why in last


# -- matching: $ topics and filters that start with a wildcard ------------------------------

PRESENCE_TOPIC = f"{PRESENCE}dev-1"
BLIND = ["#", "+/#", "+/presence/#", "+/+/dev-1", "+/+/+", "+/presence/dev-1"]
"""Filters that start with a wildcard: none matches a $ topic."""
SEEING = ["$SYS/#", "$SYS/+/dev-1", "$SYS/presence/#", "$SYS/presence/+", PRESENCE_TOPIC, "$SYS/+/+"]


def test_no_filter_starting_with_a_wildcard_matches_presence_in_any_matcher() -> None:
    """topic_matches (ACL, retained store), the trees the broker, the supervisor and
    the fleet route by (``FilterIndex``, the fleet's ``FilterCache``): the same answer."""
    subs: Subscriptions[str] = Subscriptions(max_qos=2)
    tree: TopicTree[str] = TopicTree()
    index, cache = FilterIndex(), FilterCache()
    for f in BLIND + SEEING:
        subs.subscribe(f, f, 0)
        tree.set(f, f)
        index.add(f)
        cache.set(f, True)
    for f in BLIND:
        assert not topic_matches(f, PRESENCE_TOPIC), f
        assert topic_matches(f, "SYS/presence/dev-1"), f  # only the $ keeps it out
    for f in SEEING:
        assert topic_matches(f, PRESENCE_TOPIC), f
    assert set(subs.route(PRESENCE_TOPIC)) == set(SEEING)
    assert sorted(tree.match(PRESENCE_TOPIC)) == sorted(SEEING)
    assert sorted(index.matching(PRESENCE_TOPIC)) == sorted(SEEING)
    assert sorted(cache.matching(PRESENCE_TOPIC)) == sorted(SEEING)
    index.replace(frozenset(BLIND))
    assert not index.matches(PRESENCE_TOPIC) and not index.matches_plain(PRESENCE_TOPIC)
    assert index.matches("data/dev-1")


_LEVEL = st.sampled_from(["$SYS", "presence", "dev", "a", "+", ""])
_FILTERS = st.builds(
    lambda levels, hash_: "/".join([*levels, "#"] if hash_ else levels),
    st.lists(_LEVEL, min_size=0, max_size=4),
    st.booleans(),
).filter(bool)
_ID_LEVELS = st.lists(st.sampled_from(["dev", "a", "", "presence", "$SYS"]), min_size=1, max_size=3)
_IDS = _ID_LEVELS.map("/".join).filter(bool)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from([PRESENCE, LEGACY_PRESENCE_PREFIX, "$SYS/", "a/b/"]), _FILTERS, st.lists(_IDS, min_size=1))
def test_retained_presence_is_offered_to_exactly_the_filters_that_match_it(
    prefix: str, topic_filter: str, ids: list[str]
) -> None:
    """The shortcuts retained presence takes (coordinators and fleet alike) agree with
    ``topic_matches``: a filter that matches some presence topic may get presence; one
    said to match every presence topic matches each."""
    matched = [topic_matches(topic_filter, prefix + i) for i in ids]
    if any(matched):
        assert presence_possible(topic_filter, prefix)
    if matches_every_presence_topic(topic_filter, prefix):
        assert all(matched)


@pytest.mark.parametrize(
    ("topic_filter", "possible", "every"),
    [
        ("#", False, False),
        ("+/#", False, False),
        ("+/presence/#", False, False),
        ("$SYS/#", True, True),
        ("$SYS/+/#", True, True),
        (f"{PRESENCE}#", True, True),
        (f"{PRESENCE}+", True, False),
        (f"{PRESENCE}dev-1", True, False),
        ("$SYS/+/dev-1", True, False),
        ("$SYS/presence", False, False),
        ("$SYS/other/#", False, False),
        ("presence/#", False, False),
    ],
)
def test_which_filters_retained_presence_is_offered_to(topic_filter: str, possible: bool, every: bool) -> None:
    assert presence_possible(topic_filter, PRESENCE) is possible
    assert matches_every_presence_topic(topic_filter, PRESENCE) is every


def test_an_acl_grant_of_hash_does_not_cover_presence(tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text("topic read #\nuser ops\ntopic read $SYS/presence/#\n")
    acl = AclFile.load(path)
    assert acl.can_read_filter(None, "anon", "#")
    assert not acl.can_read_filter(None, "anon", f"{PRESENCE}#")  # as Mosquitto: "#" reads no $ topic
    assert not acl.can_read(None, "anon", PRESENCE_TOPIC)
    assert acl.can_read_filter("ops", "ops-1", f"{PRESENCE}#")
    assert acl.can_read_filter("ops", "ops-1", f"{PRESENCE}dev-1")
    assert acl.can_read("ops", "ops-1", PRESENCE_TOPIC)


# -- in process (MockClock) ---------------------------------------------------------------


async def heard(client: Client, seconds: float = 5.0) -> list[tuple[str, bytes]]:
    """Every PUBLISH ``client`` gets within ``seconds`` (the clock is mocked)."""
    out: list[tuple[str, bytes]] = []
    with trio.move_on_after(seconds):
        while True:
            out.append(publish_topic(await client.read_packet()))
    return out


async def test_late_subscribers_get_retained_presence_under_sys_only(clock: MockClock) -> None:
    async with running() as (server, _):
        up = await Client.connect(server.port, "dev-up")
        down = await Client.connect(server.port, "dev-down")
        await down.send(encoders.encode_disconnect())
        assert await down.closed()
        await up.send(encoders.encode_publish("data/dev-up", b"21.5", retain=True))
        everything = await Client.connect(server.port, "everything")
        await everything.send(encoders.encode_subscribe(1, [("#", 0), ("+/presence/#", 0), ("+/+/dev-up", 0)]))
        assert await everything.read_packet() == encoders.encode_suback(1, [0, 0, 0])
        assert await heard(everything) == [("data/dev-up", b"21.5")]  # the retained message, no presence
        dashboard = await Client.connect(server.port, "dashboard")
        await dashboard.send(encoders.encode_subscribe(1, [(f"{PRESENCE}#", 0)]))
        assert await dashboard.read_packet() == encoders.encode_suback(1, [0])
        got = {t: json.loads(p)["status"] for t, p in await heard(dashboard)}
        assert got == {
            f"{PRESENCE}dev-up": "online",
            f"{PRESENCE}dev-down": "offline",
            f"{PRESENCE}everything": "online",
            f"{PRESENCE}dashboard": "online",
        }
        one = await Client.connect(server.port, "one")
        await one.send(encoders.encode_subscribe(1, [("$SYS/+/dev-down", 0)]))
        assert await one.read_packet() == encoders.encode_suback(1, [0])
        assert [t for t, _ in await heard(one)] == [f"{PRESENCE}dev-down"]
        # Live: the dashboard hears a device come and one go; "everything" does not.
        await up.send(encoders.encode_disconnect())
        live = [(t, json.loads(p)["status"]) for t, p in await heard(dashboard)]
        assert live == [(f"{PRESENCE}one", "online"), (f"{PRESENCE}dev-up", "offline")]
        assert await heard(everything, 1.0) == []


async def test_a_publish_and_a_will_under_the_prefix_are_refused_and_counted(clock: MockClock) -> None:
    async with running() as (server, _):
        dashboard = await Client.connect(server.port, "dashboard")
        await dashboard.send(encoders.encode_subscribe(1, [(f"{PRESENCE}#", 0)]))
        assert await dashboard.read_packet() == encoders.encode_suback(1, [0])
        victim = await Client.connect(server.port, "victim")
        assert [t for t, _ in await heard(dashboard, 1.0)] == [f"{PRESENCE}dashboard", f"{PRESENCE}victim"]
        forger = await Client.connect(server.port, "forger")
        forged = json.dumps({"status": "offline", "client_id": "victim", "reason": "disconnect"}).encode()
        await forger.send(encoders.encode_publish(f"{PRESENCE}victim", forged, qos=1, packet_id=1))
        assert await forger.read(4) == encoders.encode_puback(1)  # acknowledged (3.1.1 has no refusal), dropped
        await forger.send(encoders.encode_publish(f"{PRESENCE}ghost", forged, retain=True))
        willer = await Client.connect(
            server.port, "willer", expect=None, will_topic=f"{PRESENCE}victim", will_message=forged, will_retain=True
        )
        assert await willer.read(4) == encoders.encode_connack(False, 5)
        assert await willer.closed()
        assert [t for t, _ in await heard(dashboard, 1.0)] == [f"{PRESENCE}forger"]  # its own online, nothing forged
        assert server.counters["denied_publishes"] == 2
        assert server.counters["refused_wills"] == 1
        assert "victim" in server.online and "willer" not in server.online
        late = await Client.connect(server.port, "late")
        await late.send(encoders.encode_subscribe(1, [(f"{PRESENCE}ghost", 0), (f"{PRESENCE}victim", 0)]))
        assert await late.read_packet() == encoders.encode_suback(1, [0, 0])
        [(topic, payload)] = await heard(late, 1.0)  # the server's own record, not the forgery
        assert topic == f"{PRESENCE}victim" and json.loads(payload)["status"] == "online"
        await victim.send(encoders.encode_disconnect())


async def test_the_acl_decides_who_reads_presence(clock: MockClock, tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text("topic read #\nuser ops\ntopic read $SYS/presence/#\n")
    async with running(HeartbeatConfig(acl=AclFile.load(path))) as (server, _):
        anon = await Client.connect(server.port, "anon")
        await anon.send(encoders.encode_subscribe(1, [("#", 0), (f"{PRESENCE}#", 0)]))
        assert await anon.read_packet() == encoders.encode_suback(1, [0, 0x80])
        ops = await Client.connect(server.port, "ops-1", username="ops", password=b"x")
        await ops.send(encoders.encode_subscribe(1, [(f"{PRESENCE}#", 0)]))
        assert await ops.read_packet() == encoders.encode_suback(1, [0])
        assert [t for t, _ in await heard(ops, 1.0)] == [f"{PRESENCE}anon", f"{PRESENCE}ops-1"]
        device = await Client.connect(server.port, "dev-1")
        assert [t for t, _ in await heard(ops, 1.0)] == [f"{PRESENCE}dev-1"]
        assert await heard(anon, 1.0) == []
        await device.send(encoders.encode_disconnect())


# -- real processes -----------------------------------------------------------------------


class PahoWatcher:
    """A paho-mqtt client subscribed to ``filters``, collecting what it is sent."""

    def __init__(self, port: int, client_id: str, filters: Sequence[str]) -> None:
        self.got: list[tuple[str, bytes]] = []
        subscribed = threading.Event()
        self.client = paho_client(client_id)
        self.client.on_message = lambda c, u, msg: self.got.append((msg.topic, bytes(msg.payload)))
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        self.client.subscribe([(f, 0) for f in filters])
        assert subscribed.wait(5), "no SUBACK"

    def topics(self) -> list[str]:
        return [t for t, _ in list(self.got)]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class MosquittoSub:
    """``mosquitto_sub -t FILTER -v``, read a line at a time (it flushes each one)."""

    def __init__(self, port: int, topic_filter: str) -> None:
        args = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-t", topic_filter, "-v", "-W", "30"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        assert self.read_until(READY), self.lines  # subscribed: the retained message came

    def read_until(self, topic: str) -> bool:
        """Read lines until one on ``topic``; False if mosquitto_sub ended first."""
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            self.lines.append(line.rstrip("\n"))
            if line.split(" ", 1)[0] == topic:
                return True
        return False

    def topics(self) -> list[str]:
        return [line.split(" ", 1)[0] for line in self.lines]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by PID
        self.proc.wait()


def publish_raw(port: int, client_id: str, topic: str, payload: dict[str, object], retain: bool = False) -> None:
    """A QoS 1 PUBLISH from a client of its own, acknowledged, then DISCONNECT."""
    sock = raw_connect(port, client_id, keep_alive=30)
    sock.sendall(encoders.encode_publish(topic, json.dumps(payload).encode(), qos=1, packet_id=1, retain=retain))
    assert sock.recv(4) == encoders.encode_puback(1)
    sock.sendall(encoders.encode_disconnect())
    sock.close()


def set_ready(pub_port: int, sub_port: int) -> None:
    """Retain :data:`READY` through ``pub_port`` and wait until a new subscription on
    ``sub_port`` is given it (a PUBACK comes before the supervisor or Redis has it)."""
    publish_raw(pub_port, "setup", READY, {"ready": True}, retain=True)
    for i in range(50):
        sock, got = subscriber(sub_port, f"ready-{i}", [READY])
        try:
            until(lambda got=got: bool(got), 0.5, READY)
            return
        except AssertionError:
            pass
        finally:
            sock.close()
    raise AssertionError(f"{READY} never retained")


def spread(server: Server, workers: int, name: str, filters: Sequence[str]) -> list[tuple[socket.socket, Got]]:
    """Raw subscribers named ``name-<i>`` until every worker holds one (the kernel picks)."""
    subs: dict[str, tuple[socket.socket, Got]] = {}
    for i in range(40):
        client_id = f"{name}-{i}"
        subs[client_id] = subscriber(server.port, client_id, filters)
        until(lambda: set(where(server, set(subs))) == set(subs), 10, f"{client_id} online")
        if len(set(where(server, set(subs)).values())) == workers:
            return list(subs.values())
    raise AssertionError(f"40 subscribers and still not one on each of {workers} workers")


def presence_of(got: Got, client_id: str) -> list[tuple[str, object]]:
    """(status, reason) of every presence event on ``client_id``'s topic."""
    return [(str(e["status"]), e["reason"]) for t, e in list(got) if t == PRESENCE + client_id]


def device_comes_and_goes(port: int) -> None:
    """paho device ``dev-1``: online, one message of its own on ``data/dev-1``, DISCONNECT."""
    device = paho_client("dev-1")
    device.connect("127.0.0.1", port, keepalive=30)
    device.loop_start()
    try:
        device.publish("data/dev-1", json.dumps({"t": 21.5}).encode(), qos=1).wait_for_publish(5)
    finally:
        device.disconnect()
        device.loop_stop()


def check_hash_subscribers(
    sub_port: int,
    pub_port: int,
    presence_subs: list[tuple[socket.socket, Got]],
    raw_hash: list[tuple[socket.socket, Got]],
    raw_plus: list[tuple[socket.socket, Got]],
) -> None:
    """The device comes and goes on ``pub_port``; subscribers on ``sub_port`` (paho and
    mosquitto_sub on ``#`` among them) are read up to the marker and checked."""
    paho = PahoWatcher(sub_port, "paho-hash", ["#"])
    mosq = MosquittoSub(sub_port, "#")
    try:
        device_comes_and_goes(pub_port)
        came_and_went = [("online", None), ("offline", "disconnect")]
        for _, got in presence_subs:  # every worker with a "#" subscriber has handed the events out
            until(lambda got=got: presence_of(got, "dev-1") == came_and_went, 15, "dev-1 online and offline")
        publish_raw(pub_port, "marker", MARKER, {"end": True})
        assert mosq.read_until(MARKER), mosq.lines
        until(lambda: MARKER in paho.topics(), 10, "paho hears the marker")
        for _, got in [*raw_hash, *raw_plus]:
            until(lambda got=got: MARKER in [t for t, _ in list(got)], 10, "the raw subscribers hear the marker")
        wanted = [READY, "data/dev-1", MARKER]
        assert mosq.topics() == wanted  # mosquitto_sub -t '#': the device's message, no presence
        assert paho.topics() == wanted
        for _, got in raw_hash:
            assert [t for t, _ in list(got)] == wanted
        for _, got in raw_plus:
            assert [t for t, _ in list(got)] == [MARKER]  # +/presence/#, +/+/dev-1: nothing
        for _, got in presence_subs:
            assert all(t.startswith(PRESENCE) for t, _ in list(got))
    finally:
        paho.close()
        mosq.close()


@needs_mosquitto_clients
@pytest.mark.parametrize("workers", [1, 2])
def test_a_hash_subscriber_hears_a_device_and_never_its_presence(start_server: object, workers: int) -> None:
    server: Server = start_server(workers=workers)  # type: ignore[operator]
    set_ready(server.port, server.port)
    presence_subs = spread(server, workers, "presence", [f"{PRESENCE}#"])
    raw_hash = spread(server, workers, "hash", HASH)
    raw_plus = spread(server, workers, "plus", PLUS_FILTERS)
    try:
        check_hash_subscribers(server.port, server.port, presence_subs, raw_hash, raw_plus)
    finally:
        for sock, _ in [*presence_subs, *raw_hash, *raw_plus]:
            sock.close()


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer(binary=require_binary())
    server.start()
    yield server
    server.stop()


@needs_mosquitto_clients
def test_a_hash_subscriber_in_a_fleet_hears_a_device_on_another_gateway_and_never_its_presence(
    redis: RedisServer, tmp_path: Path
) -> None:
    gateways = []
    subs: list[tuple[socket.socket, Got]] = []
    try:
        for i in range(2):
            port = free_port()
            args = ["--cluster", redis.url, "--node", f"gw{i}", "--tick", "0.05"]
            args += ["--presence-log", str(tmp_path / f"gw{i}.jsonl")]
            gateways.append((start_heartbeat(port, 1, args, cwd=str(ROOT)), port))
        (_, port0), (_, port1) = gateways
        set_ready(port0, port1)
        presence_subs = [subscriber(port1, "presence-0", [f"{PRESENCE}#"])]
        raw_hash = [subscriber(port1, "hash-0", HASH)]
        raw_plus = [subscriber(port1, "plus-0", PLUS_FILTERS)]
        subs = [*presence_subs, *raw_hash, *raw_plus]
        check_hash_subscribers(port1, port0, presence_subs, raw_hash, raw_plus)
    finally:
        for sock, _ in subs:
            sock.close()
        for proc, _ in gateways:
            proc.terminate()  # SIGTERM by PID
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@needs_mosquitto_clients
def test_sys_presence_subscribers_hear_online_and_offline(start_server: object) -> None:
    server: Server = start_server()  # type: ignore[operator]
    one = PahoWatcher(server.port, "watch-one", [f"{PRESENCE}silent-1"])
    sub = subprocess.Popen(
        ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(server.port), "-t", f"{PRESENCE}#", "-v", "-W", "30"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sub.stdout is not None
        first = sub.stdout.readline()  # its own online presence, retained: it is subscribed
        assert first.startswith(f"{PRESENCE}") and '"status":"online"' in first, first
        done = subprocess.run(
            ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(server.port), "-i", "mosq-dev", "-t", "t", "-m", "hi"],
            capture_output=True,
            timeout=10,
        )
        assert done.returncode == 0, done.stderr
        silent = raw_connect(server.port, "silent-1", keep_alive=1)  # then nothing: cut at 1.5 s
        lines: list[str] = []
        while len(lines) < 4 and (line := sub.stdout.readline()):
            if line.startswith((f"{PRESENCE}mosq-dev ", f"{PRESENCE}silent-1 ")):  # not the retained others
                lines.append(line)
        silent.close()
    finally:
        sub.kill()  # by PID
        sub.wait()
        one.close()
    events = [(line.split(" ", 1)[0], json.loads(line.split(" ", 1)[1])) for line in lines]
    assert [(t, e["status"], e["reason"]) for t, e in events] == [
        (f"{PRESENCE}mosq-dev", "online", None),
        (f"{PRESENCE}mosq-dev", "offline", "disconnect"),
        (f"{PRESENCE}silent-1", "online", None),
        (f"{PRESENCE}silent-1", "offline", "keepalive-timeout"),
    ]
    statuses = [(t, json.loads(p)["status"]) for t, p in one.got]
    assert statuses == [(f"{PRESENCE}silent-1", "online"), (f"{PRESENCE}silent-1", "offline")]


@needs_mosquitto_clients
def test_presence_prefix_presence_keeps_the_old_topics(start_server: object) -> None:
    """Migration: ``--presence-prefix presence/`` publishes where earlier versions did,
    where ``#`` hears it; ``$SYS/presence/`` is then silent; devices still may not
    write under either."""
    server: Server = start_server("--presence-prefix", LEGACY_PRESENCE_PREFIX, status=True)  # type: ignore[operator]
    old = subscriber(server.port, "old-dashboard", [f"{LEGACY_PRESENCE_PREFIX}#"])
    hash_ = subscriber(server.port, "hash", ["#"])
    new = subscriber(server.port, "new-dashboard", [f"{PRESENCE}#", MARKER])
    try:
        device_comes_and_goes(server.port)
        old_topic = f"{LEGACY_PRESENCE_PREFIX}dev-1"
        came_and_went = [("online", None), ("offline", "disconnect")]
        for _, got in (old, hash_):
            until(
                lambda got=got: (
                    [(str(e["status"]), e["reason"]) for t, e in list(got) if t == old_topic] == came_and_went
                ),
                10,
                f"dev-1 on {LEGACY_PRESENCE_PREFIX}",
            )
        forger = raw_connect(server.port, "forger", keep_alive=30)
        for i, topic in enumerate([f"{LEGACY_PRESENCE_PREFIX}dev-1", f"{PRESENCE}dev-1"], start=1):
            forger.sendall(encoders.encode_publish(topic, b'{"status":"online"}', qos=1, packet_id=i))
            assert forger.recv(4) == encoders.encode_puback(i)
        forger.close()
        publish_raw(server.port, "marker", MARKER, {"end": True})
        until(lambda: MARKER in [t for t, _ in list(new[1])], 10, "the marker")
        assert [t for t, _ in list(new[1])] == [MARKER]  # nothing under $SYS/presence/
        assert "data/dev-1" in [t for t, _ in list(hash_[1])]
        assert metric(server, "heartbeat_denied_publishes_total") == 2
        statuses = [e["status"] for t, e in list(old[1]) if t == old_topic]
        assert statuses == ["online", "offline"]  # the forged "online" never reached it
    finally:
        for sock, _ in (old, hash_, new):
            sock.close()


@needs_mosquitto_clients
def test_mosquitto_pub_cannot_forge_presence_by_publish_or_will(start_server: object) -> None:
    server: Server = start_server(status=True)  # type: ignore[operator]
    watch = subscriber(server.port, "dashboard", [f"{PRESENCE}#", MARKER])
    victim = raw_connect(server.port, "victim", keep_alive=30)
    try:
        until(lambda: presence_of(watch[1], "victim") == [("online", None)], 10, "victim online")
        base = ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(server.port)]
        forged = json.dumps({"status": "offline", "client_id": "victim", "reason": "disconnect"})
        done = subprocess.run(
            [*base, "-i", "forger", "-q", "1", "-r", "-t", f"{PRESENCE}victim", "-m", forged],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert done.returncode == 0, done.stderr  # PUBACK: acknowledged, then dropped
        will = ["--will-topic", f"{PRESENCE}victim", "--will-payload", forged, "--will-retain"]
        done = subprocess.run(
            [*base, "-i", "willer", *will, "-t", "data/x", "-m", "hi"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert done.returncode != 0 and "not authori" in done.stderr.lower(), done.stderr  # CONNACK 5
        publish_raw(server.port, "marker", MARKER, {"end": True})
        until(lambda: MARKER in [t for t, _ in list(watch[1])], 10, "the marker")
        assert presence_of(watch[1], "victim") == [("online", None)]  # never the forged offline
        assert "willer" not in {t.removeprefix(PRESENCE) for t, _ in list(watch[1])}  # refused: no session
        assert metric(server, "heartbeat_denied_publishes_total") == 1
        assert metric(server, "heartbeat_refused_wills_total") == 1
        late = subscriber(server.port, "late", [f"{PRESENCE}victim"])
        until(lambda: late[1], 10, "the retained presence")
        [(topic, event)] = list(late[1])
        assert (topic, event["status"], "epoch" in event) == (f"{PRESENCE}victim", "online", True)
        late[0].close()
    finally:
        victim.close()
        watch[0].close()
