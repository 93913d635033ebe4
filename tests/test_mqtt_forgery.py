"""Issue 33, as a hostile client tries it, in process on both engines (MockClock):
presence no client can forge, ids and usernames that cannot carry wildcards or grow
without bound, and a client's share of filters."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.security.acl import AclFile

from .test_heartbeat import Client, engine, publish_topic, running

__all__ = ["engine"]  # the fixture: every test here runs on both engines

REFUSED_5 = encoders.encode_connack(False, 5)


async def presence_watcher(port: int) -> Client:
    """A dashboard on ``#`` and on presence (which ``#`` does not match), its own
    retained presence read."""
    watcher = await Client.connect(port, "dashboard")
    await watcher.send(encoders.encode_subscribe(1, [("#", 0), (f"{PRESENCE}#", 0)]))
    assert await watcher.read_packet() == encoders.encode_suback(1, [0, 0])
    packet = await watcher.read_packet()  # its own online presence, retained
    assert publish_topic(packet)[0] == f"{PRESENCE}dashboard"
    return watcher


async def heard(watcher: Client, seconds: float = 5.0) -> list[tuple[str, bytes]]:
    """Every PUBLISH the watcher gets within ``seconds`` (the clock is mocked)."""
    out: list[tuple[str, bytes]] = []
    with trio.move_on_after(seconds):
        while True:
            out.append(publish_topic(await watcher.read_packet()))
    return out


@pytest.mark.parametrize("topic", [f"{PRESENCE}door-lock-7", "$SYS/broker/uptime", "$forged/x"])
async def test_a_will_on_a_topic_only_the_server_writes_refuses_the_connect(clock: MockClock, topic: str) -> None:
    async with running() as (server, events):
        watcher = await presence_watcher(server.port)
        forger = await Client.connect(
            server.port, "forger", expect=None, will_topic=topic, will_message=b'{"status":"online"}', will_retain=True
        )
        assert await forger.read(4) == REFUSED_5
        assert await forger.closed()
        # Nothing was published: not the Will (live or retained), not the forger's presence.
        assert await heard(watcher) == []
        assert "forger" not in server.online
        assert server.counters["refused_wills"] == 1
        late = await Client.connect(server.port, "late")
        await late.send(encoders.encode_subscribe(1, [(f"{PRESENCE}door-lock-7", 0)]))
        assert await late.read_packet() == encoders.encode_suback(1, [0])
        assert await heard(late, 1.0) == []  # no retained "door-lock-7 is online"
    refused = [e for e in events if e.claimed_client_id == "forger"]
    assert [(e.status, e.detail) for e in refused] == [("refused", "not-authorized")]


async def test_a_publish_to_a_dollar_topic_is_dropped(clock: MockClock) -> None:
    async with running() as (server, _):
        watcher = await presence_watcher(server.port)
        await watcher.send(encoders.encode_subscribe(2, [("$app/#", 0)]))
        assert await watcher.read_packet() == encoders.encode_suback(2, [0])
        device = await Client.connect(server.port, "d1")
        assert publish_topic(await watcher.read_packet())[0] == f"{PRESENCE}d1"
        await device.send(encoders.encode_publish("$app/x", b"forged", qos=1, packet_id=1))
        assert await device.read(4) == encoders.encode_puback(1)  # acknowledged, then dropped
        assert await heard(watcher, 1.0) == []
        assert server.online["d1"].session.denied_publishes == 1


def _acl(tmp_path: Path, text: str) -> AclFile:
    path = tmp_path / "acl"
    path.write_text(text)
    return AclFile.load(path)


async def test_a_will_the_acl_forbids_refuses_the_connect_and_a_reload_stops_an_admitted_one(
    clock: MockClock, tmp_path: Path
) -> None:
    acl = _acl(tmp_path, "pattern readwrite devices/%c/#\npattern read #\n")
    async with running(HeartbeatConfig(acl=acl)) as (server, _):
        watcher = await Client.connect(server.port, "dashboard")
        await watcher.send(encoders.encode_subscribe(1, [("devices/#", 0)]))
        assert await watcher.read_packet() == encoders.encode_suback(1, [0])
        thief = await Client.connect(
            server.port, "thief", expect=None, will_topic="devices/victim/cmd", will_message=b"x"
        )
        assert await thief.read(4) == REFUSED_5
        # Its own tree is fine: admitted. Then the operator takes that grant away (SIGHUP).
        own = await Client.connect(
            server.port, "d7", keep_alive=2, will_topic="devices/d7/status", will_message=b"dead"
        )
        (tmp_path / "acl").write_text("pattern read #\n")
        assert server.reload_acl()
        assert await own.closed()  # silent: ended by its keep-alive, the Will due
        assert await heard(watcher, 1.0) == []
        assert server.counters["denied_wills"] == 1
        assert server.counters["wills_published"] == 0


async def test_a_will_the_client_may_publish_still_goes_out(clock: MockClock) -> None:
    async with running() as (server, _):
        watcher = await presence_watcher(server.port)
        await Client.connect(server.port, "d8", keep_alive=2, will_topic="wills/d8", will_message=b"gone")
        assert publish_topic(await watcher.read_packet())[0] == f"{PRESENCE}d8"
        got = await heard(watcher, 10.0)
        assert ("wills/d8", b"gone") in got
        assert server.counters["wills_published"] == 1


@pytest.mark.parametrize("client_id", ["a+b", "a#", "+", "#"])
async def test_a_client_id_with_a_wildcard_is_refused(clock: MockClock, client_id: str) -> None:
    async with running() as (server, events):
        watcher = await presence_watcher(server.port)
        bad = await Client.connect(server.port, client_id, expect=None)
        assert await bad.read(4) == encoders.encode_connack(False, 2)
        assert await bad.closed()
        assert await heard(watcher, 1.0) == []  # no presence topic with a wildcard in it
    assert not any(e.client_id == client_id for e in events)


async def test_ids_and_usernames_past_their_length_are_refused(clock: MockClock) -> None:
    async with running(HeartbeatConfig(max_client_id=32, max_username=16)) as (server, _):
        assert await Client.connect(server.port, "x" * 32)
        long_id = await Client.connect(server.port, "x" * 33, expect=None)
        assert await long_id.read(4) == encoders.encode_connack(False, 2)
        multibyte = await Client.connect(server.port, "é" * 17, expect=None)  # 34 bytes of UTF-8
        assert await multibyte.read(4) == encoders.encode_connack(False, 2)
        assert await Client.connect(server.port, "u16", username="u" * 16, password=b"p")
        long_name = await Client.connect(server.port, "u17", username="u" * 17, password=b"p", expect=None)
        assert await long_name.read(4) == encoders.encode_connack(False, 4)


async def test_a_client_holds_at_most_its_share_of_filters(clock: MockClock) -> None:
    cfg = HeartbeatConfig(max_subscriptions=3, max_subscription_bytes=1000)
    async with running(cfg) as (server, _):
        client = await Client.connect(server.port, "many")
        await client.send(encoders.encode_subscribe(1, [("a/+", 0), ("b/+", 1), ("a/+", 1)]))  # a/+ again: one
        assert await client.read_packet() == encoders.encode_suback(1, [0, 1, 1])
        await client.send(encoders.encode_subscribe(2, [("c/#", 0), ("d/#", 0), ("a/+", 0)]))
        assert await client.read_packet() == encoders.encode_suback(2, [0, 0x80, 0])  # the 4th filter, refused
        assert server.counters["refused_subscriptions"] == 1
        await client.send(encoders.encode_unsubscribe(3, ["b/+"]))
        assert await client.read_packet() == encoders.encode_unsuback(3)
        await client.send(encoders.encode_subscribe(4, [("d/#", 0)]))  # room again
        assert await client.read_packet() == encoders.encode_suback(4, [0])
        other = await Client.connect(server.port, "other")  # another client's share is its own
        await other.send(encoders.encode_subscribe(1, [("x/1", 0), ("x/2", 0), ("x/3", 0)]))
        assert await other.read_packet() == encoders.encode_suback(1, [0, 0, 0])


async def test_filter_bytes_count_as_well_as_filters(clock: MockClock) -> None:
    async with running(HeartbeatConfig(max_subscription_bytes=10)) as (server, _):
        client = await Client.connect(server.port, "bytes")
        await client.send(encoders.encode_subscribe(1, [("abcde", 0), ("fghij", 0), ("k", 0)]))
        assert await client.read_packet() == encoders.encode_suback(1, [0, 0, 0x80])


async def test_refusals_a_client_repeats_are_logged_once(clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="servers.heartbeat")
    async with running() as (server, _):
        device = await Client.connect(server.port, "noisy" * 40)
        for i in range(1, 51):
            await device.send(encoders.encode_publish(f"{PRESENCE}x", b"forged", qos=1, packet_id=i))
            assert await device.read(4) == encoders.encode_puback(i)
        assert server.counters["denied_publishes"] == 50
    lines = [r.getMessage() for r in caplog.records if "denied" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "(200 characters)" in lines[0] and "noisy" * 40 not in lines[0]


async def test_one_client_fills_only_its_share_of_the_retained_store(clock: MockClock) -> None:
    # Issue 33: an attacker filled the store; the victim's next update was refused and
    # its old value removed.
    cfg = HeartbeatConfig(max_retained_bytes=400, max_retained_per_client=5)
    async with running(cfg) as (server, _):
        victim = await Client.connect(server.port, "victim")
        await victim.send(encoders.encode_publish("victim/state", b"on", retain=True))
        attacker = await Client.connect(server.port, "attacker")
        for i in range(50):
            await attacker.send(encoders.encode_publish(f"junk/{i}", b"x" * 40, retain=True))
        await attacker.send(encoders.encode_pingreq())
        assert await attacker.read(2) == encoders.encode_pingresp()
        await victim.send(encoders.encode_publish("victim/state", b"off", retain=True))
        await victim.send(encoders.encode_pingreq())
        assert await victim.read(2) == encoders.encode_pingresp()
        store = server.coordinator.retention.store  # type: ignore[attr-defined]
        assert store.held_by("attacker")[0] == 5
        reader = await Client.connect(server.port, "reader")
        await reader.send(encoders.encode_subscribe(1, [("victim/state", 0)]))
        assert await reader.read_packet() == encoders.encode_suback(1, [0])
        assert publish_topic(await reader.read_packet()) == ("victim/state", b"off")


async def test_new_persistent_sessions_past_the_bound_are_refused(clock: MockClock) -> None:
    async with running(HeartbeatConfig(max_persistent_sessions=2)) as (server, _):
        for client_id in ("p1", "p2"):
            await (await Client.connect(server.port, client_id, clean_session=False)).send(encoders.encode_disconnect())
        third = await Client.connect(server.port, "p3", clean_session=False, expect=None)
        assert await third.read(4) == encoders.encode_connack(False, 3)
        back = await Client.connect(server.port, "p1", clean_session=False, expect=None)
        assert await back.read(4) == encoders.encode_connack(True, 0)  # a stored one resumes
        assert await Client.connect(server.port, "clean")  # clean sessions are not counted
