"""The dense engine's ``coalesce_canned``: windows for the requests it answers itself only.

A presence fleet's traffic is mostly keep-alive probes, each of which would otherwise
cost a wake-up of trio's loop; gathering them costs nothing a device notices. Any
other traffic must be served as without it: the first pass that reads anything but a
canned request ends the run of windows.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from trio.testing import MockClock

import idlekeeper
from idlekeeper import Engine
from idlekeeper.arrival import MARGIN
from idlekeeper.coalesce import CannedPace
from idlekeeper.epochs import latest
from tests.test_engine import Addr, Probe, collecting, connect, listening_socket, recv_exactly

PING, PONG = b"\xc0\x00", b"\xd0\x00"


class Pinged(Probe):
    """Lets the engine answer PINGs, and echoes anything else in brackets."""

    def connection_made(self, transport: idlekeeper.Transport) -> None:
        super().connection_made(transport)
        transport.canned_replies = True

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.t.write(b"[" + data + b"]")


@asynccontextmanager
async def pinged_engine(
    window: float, receive: float = 60.0, rate: float = 0.0
) -> AsyncIterator[tuple[Engine, list[Probe], Addr]]:
    """A keeper (tick 0.1 s) and an engine gathering canned pings for ``window`` seconds
    (while they come at ``rate`` a second or faster), serving :class:`Pinged` on a fresh
    listener: the engine, its protocols, the address."""
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        probes, factory = collecting(Pinged)
        async with idlekeeper.open_engine(keeper, coalesce_canned=window, canned_rate=rate) as engine:
            engine.add_canned_reply(PING, PONG)
            [listener] = engine.serve([listening_socket()], factory, receive=receive)
            yield engine, probes, listener.getsockname()


async def test_pings_alone_are_answered_in_windows_and_within_one(clock: MockClock) -> None:
    """Pings that trickle in are answered a window at a time, none later than the window."""
    async with pinged_engine(0.25) as (engine, probes, addr):
        socks = [await connect(addr) for _ in range(8)]
        await trio.sleep(1.0)
        assert len(probes) == 8
        before = engine.passes
        waits: list[float] = []

        async def pinger(sock: trio.socket.SocketType, offset: float) -> None:
            # 10 pings 0.3 s apart (a ping a read: more than a window), the sockets
            # 37.5 ms apart: 80 pings over 3 s.
            await trio.sleep(offset)
            sent: list[float] = []
            async with trio.open_nursery() as nursery:

                async def answers() -> None:
                    for i in range(10):
                        assert await recv_exactly(sock, 2) == PONG
                        waits.append(trio.current_time() - sent[i])

                nursery.start_soon(answers)
                for _ in range(10):
                    sent.append(trio.current_time())
                    await sock.send(PING)
                    await trio.sleep(0.3)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for i, sock in enumerate(socks):
                    nursery.start_soon(pinger, sock, 0.0375 * i)
        assert len(waits) == 80 and engine.canned == 80 and all(not p.received for p in probes)
        assert max(waits) <= 0.25 + 1e-6  # never later than the window
        assert max(waits) >= 0.1  # gathered: some waited for a window's end
        assert engine.passes - before <= 16  # a pass a window (3 s of pings), not one a ping (80)
        for sock in socks:
            sock.close()


async def test_other_traffic_ends_the_windows_and_is_served_at_once(clock: MockClock) -> None:
    """A packet that comes while a window runs waits for its end (at most the window);
    from then on packets are served as they come, as without the option, until a pass
    again reads nothing but canned requests."""
    async with pinged_engine(1.0) as (_, probes, addr):
        sock = await connect(addr)
        await trio.sleep(1.0)
        [probe] = probes
        await sock.send(PING)  # read at once; a window of 1 s begins
        assert await recv_exactly(sock, 2) == PONG
        await trio.sleep(0.2)
        sent = trio.current_time()
        await sock.send(b"a")  # waits for the window's end
        assert await recv_exactly(sock, 3) == b"[a]"
        first = trio.current_time() - sent
        assert 0.5 <= first <= 0.8 + 1e-6
        waits = []
        for i in range(5):  # a flow: each packet answered before the next is sent
            sent = trio.current_time()
            await sock.send(bytes([0x61 + i]))
            assert await recv_exactly(sock, 3) == b"[" + bytes([0x61 + i]) + b"]"
            waits.append(trio.current_time() - sent)
            await trio.sleep(0.3)
        assert max(waits) <= 1e-6  # no window while other traffic flows
        assert probe.received == b"aabcde"
        # Pings alone again: the windows come back.
        await sock.send(PING)
        assert await recv_exactly(sock, 2) == PONG
        await trio.sleep(0.1)
        sent = trio.current_time()
        await sock.send(PING)
        assert await recv_exactly(sock, 2) == PONG
        assert trio.current_time() - sent >= 0.5
        sock.close()


async def test_a_new_connection_is_not_kept_a_window(clock: MockClock) -> None:
    """Accepting ends the run of windows: the new connection's first packet (an MQTT
    CONNECT) is read as it comes, as without the option."""
    async with pinged_engine(1.0) as (_, probes, addr):
        pinger = await connect(addr)
        await trio.sleep(1.0)
        await pinger.send(PING)  # a window of 1 s begins
        assert await recv_exactly(pinger, 2) == PONG
        newcomer = await connect(addr)  # accepted at once (urgent)
        await trio.sleep(0.01)
        assert len(probes) == 2
        sent = trio.current_time()
        await newcomer.send(b"hello")
        assert await recv_exactly(newcomer, 7) == b"[hello]"
        assert trio.current_time() - sent <= 1e-6
        pinger.close()
        newcomer.close()


async def test_a_silent_peer_is_still_found_within_a_tick_of_its_deadline(clock: MockClock) -> None:
    """Windows pace reads, not the reaper: a connection that stops pinging is closed
    at its deadline while the others' pings keep the engine gathering."""
    async with pinged_engine(0.5, receive=2.0) as (_, probes, addr):
        chatty = await connect(addr)
        silent = await connect(addr)
        await trio.sleep(0.01)
        assert len(probes) == 2
        await silent.send(PING)
        assert await recv_exactly(silent, 2) == PONG
        quiet_probe = next(p for p in probes if p.t.get_extra_info("peername") == silent.getsockname())
        last = latest(quiet_probe.t._rx, math.inf)  # the read's epoch ended when its pass did
        for _ in range(12):
            await chatty.send(PING)
            await trio.sleep(0.25)
        when, exc = quiet_probe.lost_once
        assert isinstance(exc, idlekeeper.ExpiredError)
        assert last + 2.0 <= when <= last + 2.0 + 0.1 + 1e-6
        assert not next(p for p in probes if p is not quiet_probe).lost
        chatty.close()
        silent.close()


async def test_a_gathered_ping_is_stamped_with_its_arrival_not_its_read() -> None:
    """Real clock (the kernel's stamps are wall-clock time): a ping read a window after it
    came defers the receive deadline from when it came, not from when it was read."""
    async with (
        idlekeeper.open_keeper(tick=0.01) as keeper,
        idlekeeper.open_engine(keeper, coalesce_canned=0.2) as engine,
    ):
        assert engine.arrivals is not None
        probes, factory = collecting(Pinged)
        engine.add_canned_reply(PING, PONG)
        [listener] = engine.serve([listening_socket()], factory, receive=60.0)
        client = await connect(listener.getsockname())
        with trio.fail_after(5):
            await client.send(PING)  # read as it comes (after the accept): a window begins
            assert await recv_exactly(client, 2) == PONG
            await trio.sleep(0.02)
            sent_at = trio.current_time()
            await client.send(PING)  # waits in the kernel for the window's end
            sent_by = trio.current_time()
            assert await recv_exactly(client, 2) == PONG
            answered = trio.current_time()
        rx = probes[0].t._rx
        assert isinstance(rx, float)  # the arrival itself: no epoch object of its own
        seen = (sent_at, sent_by, rx, answered, engine.arrivals.stamped, engine.arrivals.declined)
        assert answered - sent_at >= 0.05, seen  # it did wait for the window
        assert sent_at + MARGIN - 1e-5 <= rx <= sent_by + MARGIN + 1e-5, seen
        client.close()


async def test_without_the_option_no_pass_waits(clock: MockClock) -> None:
    """The default: every ping is answered as it comes, and reads are stamped by their pass."""
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        _, factory = collecting(Pinged)
        async with idlekeeper.open_engine(keeper) as engine:
            assert engine.arrivals is None and engine.coalesce_canned == 0
            engine.add_canned_reply(PING, PONG)
            [listener] = engine.serve([listening_socket()], factory, receive=60.0)
            sock = await connect(listener.getsockname())
            await trio.sleep(0.5)
            for _ in range(5):
                sent = trio.current_time()
                await sock.send(PING)
                assert await recv_exactly(sock, 2) == PONG
                assert trio.current_time() - sent <= 1e-6
                await trio.sleep(0.05)
            sock.close()


@pytest.mark.parametrize("name", ["coalesce", "coalesce_canned", "canned_rate"])
async def test_a_negative_window_or_rate_is_refused(name: str) -> None:
    async with idlekeeper.open_keeper() as keeper:
        with pytest.raises(ValueError, match=f"^{name} must be >= 0"):
            async with idlekeeper.open_engine(keeper, **{name: -0.1}):  # type: ignore[arg-type]
                pass  # pragma: no cover - refused before the block


def test_the_pace_says_busy_from_its_threshold_over_spans_of_its_length() -> None:
    assert CannedPace(0.0).busy(0, 0.0)  # no threshold: a window after every canned pass
    pace = CannedPace(20.0, span=0.5)
    assert not pace.busy(0, 10.0)  # the first call only starts the span
    assert not pace.busy(30, 10.2)  # a span not yet over: the last verdict holds
    assert pace.busy(30, 10.5)  # 30 in 0.5 s: 60 a second
    assert pace.busy(31, 10.7)
    assert not pace.busy(35, 11.0)  # 5 in 0.5 s: 10 a second
    assert not pace.busy(36, 20.0)  # one after a quiet spell: alone


async def test_a_lone_ping_is_answered_at_once_and_a_stream_of_them_is_gathered(clock: MockClock) -> None:
    """With a rate: a device pinging on its own (one a second against 4 a second) gets
    every answer as its ping comes; eight pinging together (about 27 a second) are
    gathered into windows, none answered later than one."""
    async with pinged_engine(0.25, rate=4.0) as (engine, probes, addr):
        socks = [await connect(addr) for _ in range(8)]
        await trio.sleep(1.0)
        assert len(probes) == 8
        alone: list[float] = []
        for _ in range(6):
            sent = trio.current_time()
            await socks[0].send(PING)
            assert await recv_exactly(socks[0], 2) == PONG
            alone.append(trio.current_time() - sent)
            await trio.sleep(1.0)
        assert max(alone) <= 1e-6 and engine.windows == 0
        waits: list[float] = []

        async def pinger(sock: trio.socket.SocketType, offset: float) -> None:
            await trio.sleep(offset)
            for _ in range(10):
                sent = trio.current_time()
                await sock.send(PING)
                assert await recv_exactly(sock, 2) == PONG
                waits.append(trio.current_time() - sent)
                await trio.sleep(0.3)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i, sock in enumerate(socks):
                    nursery.start_soon(pinger, sock, 0.0375 * i)
        assert len(waits) == 80 and max(waits) <= 0.25 + 1e-6
        assert engine.windows > 0 and max(waits) >= 0.1  # gathered, once the pace was seen
        for sock in socks:
            sock.close()
