"""``--max-inflight-bytes`` on running brokers: the server's engines, clean and persistent
sessions, the supervisor's authority (``--workers``), a fleet's Redis-side sessions, and
Mosquitto itself given the same ``max_inflight_bytes``, side by side.

A subscriber on a raw socket acknowledges nothing until the test says so: what it is
sent by then is the window."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import coredis
import pytest

from loadtest.processes import free_port, start_heartbeat, wait_listening
from servers.heartbeat.broker.reports import Acked, Detach
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.publication import Publication

from .mosquitto_peer import require_mosquitto
from .mqtt_wire import Sent
from .redis_server import RedisServer
from .test_fleet import PREFIX, drain, fleet, redis_server, until
from .test_fleet_sessions import attach, held_session, knows, pid, publishes
from .test_heartbeat_clients import Server, start_server
from .test_mqtt_state import Raw, publish
from .test_tls_servers import stop

__all__ = ["redis_server", "start_server"]  # the fixtures


def payloads(sizes: list[int]) -> list[bytes]:
    """Payloads of ``sizes`` bytes, each starting with its number (at most 10 of them)."""
    return [(b"%d" % n).ljust(size, b".") for n, size in enumerate(sizes)]


def acknowledge(sub: Raw, window: list[Sent]) -> None:
    sub.send(b"".join(encoders.encode_puback(p.packet_id) for p in window))


@pytest.mark.parametrize(
    ("engine", "clean", "workers"), [("dense", True, 1), ("streams", False, 1), ("dense", False, 2)]
)
def test_a_subscriber_that_does_not_acknowledge_gets_what_the_bytes_allow(
    start_server: object, engine: str, clean: bool, workers: int
) -> None:
    """Ten may be in flight, but 100 bytes stop the window at four 30-byte messages
    (0, 30, 60 and 90 are below 100); each acknowledgement lets one more through; a
    200-byte message goes alone once nothing is in flight."""
    extra = ("--engine", engine, "--max-inflight", "10", "--max-inflight-bytes", "100")
    server: Server = start_server(*extra, workers=workers)  # type: ignore[operator]
    sub = Raw(server.port, "slow", clean=clean)
    assert sub.subscribe("cmd/slow", 1) == encoders.encode_suback(1, [1])
    sent = payloads([30] * 8 + [200, 10])
    publish(server.port, "cmd/slow", sent)
    window = sub.drain()
    assert [p.payload for p in window] == sent[:4]
    acknowledge(sub, window[:1])
    more = sub.drain()
    assert [p.payload for p in more] == sent[4:5]  # 90 below 100 again, then 120
    window = window[1:] + more
    acknowledge(sub, window)
    window = sub.drain()
    assert [p.payload for p in window] == sent[5:9]  # three of 30 (90), then the 200
    acknowledge(sub, window[:3])
    assert sub.quiet_for(0.3)  # the 200 bytes alone keep the window closed
    acknowledge(sub, window[3:])
    last = sub.drain()
    assert [p.payload for p in last] == sent[9:]
    acknowledge(sub, last)
    assert sub.quiet_for(0.3)
    sub.close()


# ------------------------------------------------------------------ side by side

CONF = """\
# As root (the tests, CI) Mosquitto would drop to the "mosquitto" user; this server warns.
{user}listener {port} 127.0.0.1
allow_anonymous true
persistence false
max_inflight_messages {window}
max_inflight_bytes 100
"""


def in_flight(port: int, sizes: list[int]) -> int:
    """How many messages of ``sizes`` bytes a subscriber that acknowledges none is sent."""
    sub = Raw(port, "slow")
    assert sub.subscribe("cmd/slow", 1) == encoders.encode_suback(1, [1])
    publish(port, "cmd/slow", payloads(sizes))
    count = len(sub.drain(quiet=0.5))
    sub.close()
    return count


# Each scene's count bound is one more than its bytes let in, so the bytes are what stops
# the window. Not more than one: Mosquitto before 2.0.13 (Debian's 2.0.11) spends two of
# its count on a message it queues and at once sends, so with room for two or more it
# sends past its own byte bound (its issue 2306); with room for one it is exact, and so is
# every version since.
SCENES = {
    "30-byte messages": ([30] * 8, 5, 4),  # 0, 30, 60 and 90 are below 100
    "one past the bound, first": ([150, 10, 10], 2, 1),  # alone, however large
    "exactly the bound": ([50] * 4, 3, 2),  # 100 is not below 100
}


@pytest.mark.parametrize("scene", SCENES)
def test_mosquitto_and_the_server_keep_the_same_number_in_flight(tmp_path: Path, scene: str) -> None:
    binary = require_mosquitto()
    sizes, window, expected = SCENES[scene]
    user = "user root\n" if os.geteuid() == 0 else ""

    def conf(port: int) -> Path:
        path = tmp_path / f"mosquitto-{port}.conf"
        path.write_text(CONF.format(user=user, port=port, window=window))
        return path

    theirs, ours = free_port(), free_port()
    mosquitto = subprocess.Popen([binary, "-c", str(conf(theirs))], stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(theirs, mosquitto)
        mosquittos = in_flight(theirs, sizes)
    finally:
        stop(mosquitto)
    server = start_heartbeat(ours, extra=["-c", str(conf(ours))])
    try:
        ours_ = in_flight(ours, sizes)
    finally:
        stop(server)
    assert (ours_, mosquittos) == (expected, expected)


# ------------------------------------------------------------------ the fleet


async def test_the_fleets_sessions_keep_the_byte_window_in_redis(redis_server: RedisServer) -> None:
    """The session script counts payload bytes in flight beside its window: three of 40
    bytes go (0, 40 and 80 are below 100), an acknowledgement lets one more through, and
    a reconnect on another node resends those in flight, in order, and nothing more."""
    async with fleet(redis_server.url, "a", "b", max_inflight=10, max_inflight_bytes=100) as (a, b):
        await held_session(a, "c1", "e1", {"cmd/c1": 1})
        await knows(b, "cmd/c1")
        sent = payloads([40] * 6)
        for payload in sent:
            b.coord.route(Publication("cmd/c1", payload, 1))
        await drain(a, b)
        await until(lambda: len(publishes(a.host, "c1")) == 3)
        await drain(a, b)
        window = publishes(a.host, "c1")
        assert [p.payload for p in window] == sent[:3]
        async with coredis.Redis.from_url(redis_server.url) as r:
            assert await r.hget(PREFIX + "ps:c1", "fb") == b"120"
        a.coord.session(Acked("c1", "e1", "puback", pid(window[0])))
        await until(lambda: len(publishes(a.host, "c1")) == 4)
        await drain(a, b)
        assert [p.payload for p in publishes(a.host, "c1")] == sent[:4]
        a.coord.session(Detach("c1", "e1"))
        await drain(a)
        assert await b.coord.open_session("c1") is not None
        attach(b, "c1", "e2")
        await until(lambda: len(publishes(b.host, "c1")) == 3)
        await drain(a, b)
        again = publishes(b.host, "c1")
        assert [(p.payload, p.dup) for p in again] == [(s, True) for s in sent[1:4]]
        b.coord.session(Acked("c1", "e2", "puback", pid(again[0])))
        await until(lambda: len(publishes(b.host, "c1")) == 4)
        assert publishes(b.host, "c1")[3].payload == sent[4]
