"""The keeper's reference model again, with each connection a real socket pair served
by the dense engine instead of a watched block.

Same draws and same verdict as tests/test_keeper_model.py: when and why each
connection ends, never early, at most one wheel slot (half a tick) late, exactly
once. Here an "rx" is the client sending a byte, which the engine must read and
stamp; a "tx" is the protocol writing a byte, which the client drains. The end is
what the protocol hears in ``connection_lost``: ``ExpiredError(reason)``, or
``EngineClosedError`` for a connection with no deadline when the engine stops.

MockClock(autojump_threshold=0) and real sockets agree because a send on a Unix
socket pair is in the peer's buffer when the system call returns: trio's run loop
polls (timeout 0) before autojump may move the clock, so the engine reads each byte
at the mock instant it was sent.
"""

from __future__ import annotations

import contextlib
import math
import socket

import trio
import trio.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st

import idlekeeper
from idlekeeper import EngineClosedError, ExpiredError, Transport

from .test_keeper_model import Conn, conns, model

END = 10_000.0
"""When the drawn schedules are long over: the engine stops then."""


class Served(idlekeeper.Protocol):
    """Counts bytes and records how the connection ended (relative to the start).

    With ``canned``, a read of exactly one "r" is the engine's to answer (with "R"),
    as a keep-alive probe is, and never reaches the protocol."""

    def __init__(self, start: float, canned: bool = False) -> None:
        self.start = start
        self.canned = canned
        self.received = 0
        self.lost: list[tuple[float, BaseException | None]] = []

    def connection_made(self, transport: Transport) -> None:
        transport.canned_replies = self.canned

    def data_received(self, data: bytes) -> None:
        self.received += len(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.append((trio.current_time() - self.start, exc))


class Client:
    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.received = 0
        self.answered = 0
        self.closed_at = math.nan

    async def drain(self, start: float) -> None:
        try:
            while data := await self.sock.recv(4096):
                self.answered += data.count(b"R")
                self.received += len(data) - data.count(b"R")
        except ConnectionResetError:
            pass
        self.closed_at = trio.current_time() - start
        self.sock.close()


def count_before(conn: Conn, kind: str, until: float) -> int:
    t = 0.0
    n = 0
    for delay, k in conn.events:
        t += delay
        if t < until and k == kind:
            n += 1
    return n


# Ticks chosen so that no wheel slot boundary (a multiple of tick/2) falls on the
# 1/64 s grid of activity within the times drawn here (about a minute): the order of
# a reaper wake-up and a client's send at one mock instant never decides a verdict.
#
# With ``canned``, every "rx" read alone is a keep-alive probe the engine answers itself,
# without the protocol: it must be the same activity to the keeper (the examples: a
# probe defers a receive timeout, and never an absolute deadline).
@settings(max_examples=50, deadline=None)
@given(st.lists(conns, min_size=1, max_size=4), st.sampled_from([0.0107131, 0.10713, 0.2997]), st.booleans())
@example([Conn(idle=None, receive=0.5078125, max_age=None, events=[(0.5, "rx")])], 0.0107131, True)
@example([Conn(idle=None, receive=1.0078125, max_age=2.0078125, events=[(0.5, "rx")] * 5)], 0.10713, True)
def test_engine_matches_model(connections: list[Conn], tick: float, canned: bool) -> None:
    served: list[Served] = []
    clients: list[Client] = []
    transports: list[Transport] = []

    async def main() -> None:
        async with idlekeeper.open_keeper(tick=tick) as keeper, trio.open_nursery() as drains:
            async with idlekeeper.open_engine(keeper) as engine:
                engine.add_canned_reply(b"r", b"R")
                start = trio.current_time()
                assert start == 0.0  # the wheel's slots count from 0, as the model's do
                for conn in connections:
                    ours, theirs = socket.socketpair()
                    protocol = Served(start, canned)
                    transport = engine.adopt(ours, protocol, idle=conn.idle, receive=conn.receive, max_age=conn.max_age)
                    assert not ours.getblocking()
                    client = Client(trio.socket.from_stdlib_socket(theirs))
                    drains.start_soon(client.drain, start)
                    served.append(protocol)
                    clients.append(client)
                    transports.append(transport)

                async def run(conn: Conn, transport: Transport, client: Client) -> None:
                    for delay, kind in conn.events:
                        await trio.sleep(delay)
                        if kind == "tx":
                            transport.write(b"t")  # dropped quietly once the connection is gone
                        else:
                            with contextlib.suppress(OSError):  # EPIPE once the server closed it
                                await client.sock.send(b"r")
                    await trio.sleep_until(start + END)

                async with trio.open_nursery() as runs:
                    for conn, transport, client in zip(connections, transports, clients, strict=True):
                        runs.start_soon(run, conn, transport, client)
                assert len(engine) == sum(1 for p in served if not p.lost)
            # The engine stopped: the survivors were told, their clients see EOF.
            assert keeper.stats.watched == 0
            assert keeper.stats.filed == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for conn, protocol, client in zip(connections, served, clients, strict=True):
        when, reason = model(conn, tick / 2)
        assert len(protocol.lost) == 1, "connection_lost must come exactly once"
        [(ended_at, exc)] = protocol.lost
        assert client.closed_at == ended_at  # the socket closed at the verdict
        if reason is None:
            assert isinstance(exc, EngineClosedError)
            assert ended_at >= END  # never expired: no deadline at all
        else:
            assert isinstance(exc, ExpiredError)
            assert exc.reason is reason
            assert ended_at >= when - 1e-9, "expired early"
            assert ended_at < when + tick / 2 + 1e-9, "expired more than one slot late"
        # Every byte sent before the end was read and stamped; none after. A canned
        # probe is answered unless it came in one read with another (then the protocol
        # has both).
        assert protocol.received + client.answered == count_before(conn, "rx", ended_at)
        assert client.answered == 0 or canned
        assert client.received == count_before(conn, "tx", ended_at)
