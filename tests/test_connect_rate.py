"""CONNECTs per source address (issue 33): the token buckets, and the server refusing
a source that connects faster than allowed while another source gets in."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.security.connect_rate import ConnectRate

from .test_heartbeat import Client, engine, running

__all__ = ["engine"]  # the fixture: both engines


def test_a_burst_then_the_rate() -> None:
    gate = ConnectRate(rate=2.0, burst=4.0)
    assert [gate.admit("a", 0.0) for _ in range(5)] == [True, True, True, True, False]
    assert gate.admit("b", 0.0)  # another source has its own bucket
    assert not gate.admit("a", 0.4)  # 0.8 of a token refilled: not yet
    assert gate.admit("a", 0.5) and not gate.admit("a", 0.5)
    assert gate.admit("a", 100.0)  # refilled, capped at the burst
    assert sum(gate.admit("a", 100.0) for _ in range(10)) == 3
    assert gate.refused == 10


def test_the_buckets_are_bounded_and_full_ones_go_first() -> None:
    gate = ConnectRate(rate=1.0, burst=2.0, max_sources=3)
    gate.admit("old", 0.0)  # refilled by t=2: full again, the same as no bucket
    gate.admit("busy", 9.9)
    gate.admit("busy", 9.9)
    gate.admit("recent", 9.95)
    gate.admit("new", 10.0)
    assert len(gate) == 3
    assert not gate.admit("busy", 10.0)  # it kept its (empty) bucket: no free burst
    with pytest.raises(ValueError):
        ConnectRate(rate=0)


async def test_a_source_that_connects_too_fast_is_refused_another_is_not(clock: MockClock) -> None:
    # 0.1 a second: a burst of 6 (a minute's worth).
    async with running(HeartbeatConfig(max_connect_rate=0.1)) as (server, _):
        for i in range(6):
            await Client.connect(server.port, f"d{i}")
        refused = await Client.connect(server.port, "d6", expect=None)
        assert await refused.read(4) == encoders.encode_connack(False, 3)
        other = Client(await trio.open_tcp_stream("127.0.0.1", server.port, local_address="127.0.0.2"))
        await other.send(encoders.encode_connect("elsewhere", keep_alive=60))
        assert await other.read(4) == encoders.encode_connack(False, 0)
        await trio.sleep(10)  # a token back
        await Client.connect(server.port, "d7")
        assert server.counters["refused_connect_rate"] == 1
