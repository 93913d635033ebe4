"""The dense engine on real loopback sockets, under MockClock(autojump_threshold=0).

Every connection is a real TCP connection to 127.0.0.1, served by one engine task;
the clients are trio sockets in the same run. Timing goes through the mock clock
only: a loopback send reaches the peer's socket within the sending system call, so
by the time trio's run loop polls (with a zero timeout, before autojump may move the
clock) the engine's epoll descriptor is already readable. The clock therefore jumps
only when nothing is in flight, and each step below happens at a known mock time.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import random
import resource
import socket
import struct
import sys
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial

import pytest
import trio
import trio.testing
from trio.testing import MockClock

import idlekeeper
from idlekeeper import Engine, EngineClosedError, ExpiredError, Reason, Transport
from idlekeeper.stall import unread_bytes

HOST = "127.0.0.1"
LINGER_RST = struct.pack("ii", 1, 0)
"""SO_LINGER on, zero seconds: close() sends RST instead of FIN."""
Addr = tuple[str, int]


# -- helpers -----------------------------------------------------------------------------


class Probe(idlekeeper.Protocol):
    """Records each callback (consecutive reads collapse into one "data") and its time."""

    def __init__(self, *, echo: bool = False, keep_open_on_eof: bool = False) -> None:
        self.echo = echo
        self.keep_open_on_eof = keep_open_on_eof
        self.transport: Transport | None = None
        self.events: list[str] = []
        self.received = bytearray()
        self.made_at = -1.0
        self.last_rx_at = -1.0
        self.lost: list[tuple[float, BaseException | None]] = []

    @property
    def t(self) -> Transport:
        assert self.transport is not None
        return self.transport

    def _note(self, event: str) -> None:
        if not (event == "data" and self.events and self.events[-1] == "data"):
            self.events.append(event)

    def connection_made(self, transport: Transport) -> None:
        assert self.transport is None, "connection_made twice"
        self.transport = transport
        self.made_at = trio.current_time()
        self._note("made")

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None and not self.lost, "data after connection_lost"
        self._note("data")
        self.received += data
        self.last_rx_at = trio.current_time()
        if self.echo:
            self.t.write(data)

    def eof_received(self) -> bool | None:
        self._note("eof")
        return True if self.keep_open_on_eof else None

    def pause_writing(self) -> None:
        self._note("pause")

    def resume_writing(self) -> None:
        self._note("resume")

    def connection_lost(self, exc: BaseException | None) -> None:
        self._note("lost")
        self.lost.append((trio.current_time(), exc))

    @property
    def lost_once(self) -> tuple[float, BaseException | None]:
        """(when, exc) of the one connection_lost; fails unless it came exactly once."""
        assert len(self.lost) == 1, f"connection_lost called {len(self.lost)} times"
        return self.lost[0]


def collecting(make: Callable[[], Probe] = Probe) -> tuple[list[Probe], Callable[[], Probe]]:
    probes: list[Probe] = []

    def factory() -> Probe:
        probe = make()
        probes.append(probe)
        return probe

    return probes, factory


def listening_socket(backlog: int = 128) -> socket.socket:
    return socket.create_server((HOST, 0), backlog=backlog)


@asynccontextmanager
async def serving(
    keeper: idlekeeper.Keeper,
    factory: Callable[[], idlekeeper.Protocol],
    *,
    idle: float | None = None,
    receive: float | None = None,
    send: float | None = None,
    max_age: float | None = None,
    high_water: int = 256 * 1024,
    low_water: int = 64 * 1024,
    direct_wait: bool = True,
) -> AsyncIterator[tuple[Engine, Addr]]:
    """An engine serving one fresh loopback listener; yields it and the address."""
    opening = idlekeeper.open_engine(keeper, high_water=high_water, low_water=low_water, direct_wait=direct_wait)
    async with opening as engine:
        [listener] = engine.serve([listening_socket()], factory, idle=idle, receive=receive, send=send, max_age=max_age)
        yield engine, listener.getsockname()


def sock_of(transport: Transport) -> socket.SocketType:
    sock = transport.get_extra_info("socket")
    assert isinstance(sock, socket.SocketType)
    return sock


async def connect(addr: Addr) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    await sock.connect(addr)
    return sock


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the run loop (and so the engine's I/O) turn without moving the mock clock."""
    for _ in range(20_000):
        if condition():
            return
        await trio.lowlevel.checkpoint()
    raise AssertionError(f"never happened: {what}")


async def read_until_eof(sock: trio.socket.SocketType) -> tuple[bytes, float]:
    """Everything the peer sends and the (mock) time of its EOF. A reset raises."""
    data = bytearray()
    while chunk := await sock.recv(1 << 16):
        data += chunk
    return bytes(data), trio.current_time()


async def recv_exactly(sock: trio.socket.SocketType, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = await sock.recv(n - len(data))
        assert chunk, f"EOF after {len(data)} of {n} bytes"
        data += chunk
    return bytes(data)


async def lost(probe: Probe) -> None:
    """Wait (without moving the clock) for connection_lost, which comes on the engine's
    next pass: a client can see the socket closed before that pass runs."""
    await until(lambda: bool(probe.lost), "connection_lost")


def assert_expired(probe: Probe, reason: Reason, since: float, timeout: float, tick: float) -> float:
    """Lost exactly once, with ExpiredError(reason), never before since+timeout and less than a tick after."""
    lost_at, exc = probe.lost_once
    assert isinstance(exc, ExpiredError), exc
    assert exc.reason is reason
    assert probe.t.reason is reason
    assert since + timeout <= lost_at < since + timeout + tick, (lost_at, since, timeout)
    return lost_at


# -- 1. echo and the order of callbacks ------------------------------------------------


async def test_echo_round_trip_and_callback_order(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    probes, factory = collecting(lambda: Probe(echo=True))
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(
            partial(idlekeeper.serve_protocol, factory, 0, keeper=keeper, host=HOST, idle=30)
        )
        port = engine.listeners[0].getsockname()[1]
        client = await connect((HOST, port))
        await client.send(b"hello engine")
        assert await recv_exactly(client, 12) == b"hello engine"
        [probe] = probes
        assert probe.t.get_extra_info("peername") == client.getsockname()
        assert probe.t.get_extra_info("sockname") == (HOST, port)
        assert probe.events == ["made", "data"]
        assert len(engine) == 1 and list(engine.transports()) == [probe.t]
        assert keeper.stats.watched == 1
        assert probe.t.active and probe.t.reading and not probe.t._sending
        client.close()  # a clean close: FIN, nothing unread on either side
        await lost(probe)
        assert probe.events == ["made", "data", "eof", "lost"]
        assert probe.lost_once[1] is None
        assert probe.t.protocol is None
        assert not probe.t.expired
        assert len(engine) == 0 and keeper.stats.watched == 0
        assert engine.accepted == 1 and engine.callback_errors == 0
        nursery.cancel_scope.cancel()
    assert len(probe.lost) == 1  # engine shutdown did not tell it twice


async def test_a_peer_that_reset_before_it_was_read_still_has_its_address(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    # The kernel forgets a reset peer's address (getpeername fails), but accept()
    # returned it: a server logging who sent a reset needs it in connection_made.
    seen: list[object] = []

    class Recorder(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            seen.append(transport.get_extra_info("peername"))

    probes, factory = collecting(Recorder)
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(partial(idlekeeper.serve_protocol, factory, 0, keeper=keeper, host=HOST))
        port = engine.listeners[0].getsockname()[1]
        # Connected, and reset, before the engine runs again to accept it.
        client = socket.create_connection((HOST, port))
        address = client.getsockname()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        await until(lambda: bool(probes), "the accept")
        [probe] = probes
        await lost(probe)
        assert seen == [address]
        assert probe.t.get_extra_info("peername") is None  # afterwards the address is not kept
        nursery.cancel_scope.cancel()


# -- 2. each deadline on a real socket ---------------------------------------------------


async def test_idle_expiry_closes_the_socket(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    probes, factory = collecting()
    async with serving(keeper, factory, idle=5) as (engine, addr):
        client = await connect(addr)
        data, eof_at = await read_until_eof(client)  # the server closes it: EOF
        [probe] = probes
        await lost(probe)
        lost_at = assert_expired(probe, Reason.IDLE, probe.made_at, 5, keeper.tick)
        assert data == b"" and eof_at == lost_at
        assert sock_of(probe.t).fileno() == -1
        assert len(engine) == 0 and keeper.stats.watched == 0
        assert keeper.stats.expired[Reason.IDLE] == 1


async def test_last_words_reach_an_idle_peer_before_the_close(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """A protocol's goodbye (MQTT 5's DISCONNECT 0x8D) is written by the reaper just
    before an expiry's close; the protocol then hears ExpiredError as usual."""

    class Polite(Probe):
        def last_words(self, reason: Reason) -> bytes | None:
            self.events.append(f"last-words {reason.value}")
            return b"bye:" + reason.value.encode()

    probes, factory = collecting(Polite)
    async with serving(keeper, factory, idle=5) as (_engine, addr):
        client = await connect(addr)
        data, eof_at = await read_until_eof(client)
        [probe] = probes
        await lost(probe)
        assert data == b"bye:idle" and eof_at == assert_expired(probe, Reason.IDLE, probe.made_at, 5, keeper.tick)
        assert "last-words idle" in probe.events


async def test_no_last_words_into_a_queue_or_from_a_raising_protocol(
    keeper: idlekeeper.Keeper, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes queued for a peer that does not read: the goodbye would land in the middle
    of them, so it is not asked for; a last_words that raises is logged, and the
    connection still closes."""

    class Flood(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            transport.write(b"z" * (8 << 20))

        def last_words(self, reason: Reason) -> bytes | None:
            raise AssertionError("asked with a queue")

    class Broken(Probe):
        def last_words(self, reason: Reason) -> bytes | None:
            raise RuntimeError("broken goodbye")

    probes, factory = collecting(Flood)
    async with serving(keeper, factory, send=4) as (_engine, addr):
        _client = await connect(addr)  # never reads
        await until(lambda: bool(probes), "accept")
        await trio.sleep(10)
    assert_expired(probes[0], Reason.SEND, probes[0].made_at, 4, keeper.tick)
    broken, factory = collecting(Broken)
    async with serving(keeper, factory, idle=2) as (_engine, addr):
        client = await connect(addr)
        data, _ = await read_until_eof(client)
        await lost(broken[0])
    assert data == b"" and broken[0].t.reason is Reason.IDLE
    assert "broken goodbye" in caplog.text


async def test_receive_expiry_is_deferred_by_client_activity(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    probes, factory = collecting(lambda: Probe(echo=True))
    async with serving(keeper, factory, receive=3) as (_engine, addr):
        client = await connect(addr)
        await until(lambda: bool(probes), "accept")
        [probe] = probes
        for _ in range(3):  # at 2, 4, 6: each send defers the receive timeout
            await trio.sleep(2)
            await client.send(b"x")
            # The server's echo (a write) must not defer a *receive* timeout.
            assert await recv_exactly(client, 1) == b"x"
            assert not probe.lost
        data, eof_at = await read_until_eof(client)
        await lost(probe)
    assert probe.received == b"xxx"
    assert probe.last_rx_at == probe.made_at + 6
    lost_at = assert_expired(probe, Reason.RECEIVE, probe.last_rx_at, 3, keeper.tick)
    assert data == b"" and eof_at == lost_at


async def test_canned_replies_are_answered_by_the_engine_where_the_protocol_allows(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    """A read of exactly a registered request, on a transport that allows canned
    replies, is answered by the engine and never reaches data_received; it is activity
    (it defers a receive timeout). Anything else, the request twice in one read
    included, and every read once the protocol withdraws, goes to the protocol."""

    class Answering(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            assert not transport.canned_replies  # off until the protocol says
            transport.canned_replies = True

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.t.write(b"[" + data + b"]")

    probes, factory = collecting(Answering)
    async with serving(keeper, factory, receive=3) as (engine, addr):
        with pytest.raises(ValueError, match="must not be empty"):
            engine.add_canned_reply(b"", b"x")
        engine.add_canned_reply(b"ping", b"pong")
        client = await connect(addr)
        await until(lambda: bool(probes), "accept")
        [probe] = probes
        for _ in range(3):  # at 2, 4, 6: answered in the engine, and activity each time
            await trio.sleep(2)
            await client.send(b"ping")
            assert await recv_exactly(client, 4) == b"pong"
        assert engine.canned == 3 and probe.received == b"" and not probe.lost
        await client.send(b"pingping")
        assert await recv_exactly(client, 10) == b"[pingping]"
        await client.send(b"pin")
        assert await recv_exactly(client, 5) == b"[pin]"
        probe.t.canned_replies = False
        assert not probe.t.canned_replies
        await client.send(b"ping")
        assert await recv_exactly(client, 6) == b"[ping]"
        assert engine.canned == 3 and probe.received == b"pingpingpinping"
        data, _ = await read_until_eof(client)
        await lost(probe)
    assert data == b""
    assert_expired(probe, Reason.RECEIVE, probe.last_rx_at, 3, keeper.tick)


async def test_absolute_expiry_of_a_busy_connection(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    probes, factory = collecting()
    async with serving(keeper, factory, idle=1, max_age=6) as (_engine, addr):
        client = await connect(addr)
        await until(lambda: bool(probes), "accept")

        async def chatter() -> None:
            while True:  # every 0.35 s: never idle for 1 s, never on the deadline
                await trio.sleep(0.35)
                await client.send(b"hi")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(chatter)
            data, eof_at = await read_until_eof(client)
            nursery.cancel_scope.cancel()
        [probe] = probes
        await lost(probe)
    lost_at = assert_expired(probe, Reason.ABSOLUTE, probe.made_at, 6, keeper.tick)
    assert data == b"" and eof_at == lost_at
    assert probe.received == b"hi" * 17  # 17 * 0.35 = 5.95


async def test_send_expiry_of_a_peer_that_never_reads(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    class Flood(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            transport.write(b"z" * (8 << 20))

    probes, factory = collecting(Flood)
    async with serving(keeper, factory, send=4) as (_engine, addr):
        _client = await connect(addr)  # never reads
        await until(lambda: bool(probes), "accept")
        [probe] = probes
        assert probe.t._sending and probe.t.get_write_buffer_size() > 0
        await trio.sleep(10)
    assert_expired(probe, Reason.SEND, probe.made_at, 4, keeper.tick)
    assert probe.t.get_write_buffer_size() == 0 and not probe.t._sending  # dropped with the socket
    assert keeper.stats.expired[Reason.SEND] == 1


async def test_what_a_peer_sent_before_its_reset_reaches_the_protocol_when_a_send_fails_first(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    # A peer that closes with our bytes unread resets the connection. If the pass flushes
    # the queue before it reads, the send fails first; the peer's last bytes are still in
    # the kernel's queue, and must reach the protocol before the end (an MQTT client's
    # last PUBACKs and DISCONNECT), not be closed away with the socket.
    class Flood(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            transport.write(b"z" * (8 << 20))

    probes, factory = collecting(Flood)
    async with serving(keeper, factory) as (_engine, addr):
        client = await connect(addr)  # never reads: the queue stays
        await until(lambda: bool(probes), "accept")
        [probe] = probes
        assert probe.t._sending
        await client.send(b"last words")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
        client.close()
        await lost(probe)
    assert bytes(probe.received) == b"last words"
    assert probe.events == ["made", "pause", "data", "lost"]  # paused: the queue is past the high-water mark
    assert isinstance(probe.lost_once[1], ConnectionResetError)


async def test_send_timeout_counts_from_when_a_write_starts_waiting(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    """A write queued whole (the kernel's buffer already full of bytes it took earlier)
    starts a pending send then, not at the last write the kernel accepted."""

    class Filler(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            sock = sock_of(transport)
            try:  # what a write the kernel accepted in full leaves behind
                while True:
                    sock.send(b"f" * 65536)
            except BlockingIOError:
                pass

    probes, factory = collecting(Filler)
    async with serving(keeper, factory, send=4) as (_engine, addr):
        _client = await connect(addr)  # never reads
        await until(lambda: bool(probes), "accept")
        [probe] = probes
        await trio.sleep(10)
        assert not probe.lost  # nothing was pending: no send timeout
        probe.t.write(b"late")
        write_at = trio.current_time()
        assert probe.t.get_write_buffer_size() == 4 and probe.t._sending
        await trio.sleep(10)
    assert_expired(probe, Reason.SEND, write_at, 4, keeper.tick)


# -- 3. stall safety -------------------------------------------------------------------------


class Paused(Probe):
    """Stops reading as soon as it is made: the client's bytes wait in the kernel."""

    def connection_made(self, transport: Transport) -> None:
        super().connection_made(transport)
        transport.pause_reading()


async def test_stall_safety_unread_bytes_spare_a_paused_connection(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    probes, factory = collecting(Paused)
    async with serving(keeper, factory, idle=5) as (_engine, addr):
        client = await connect(addr)
        await until(lambda: bool(probes), "accept")
        [probe] = probes
        assert not probe.t.reading
        await trio.sleep(1)
        await client.send(b"ping")  # on time, but the server is not reading
        await trio.sleep(6)  # the deadline at 5 passes
        assert trio.current_time() == probe.made_at + 7
        assert not probe.lost and probe.t.active
        assert keeper.stats.stall_saves == 1
        assert unread_bytes(sock_of(probe.t)) == 4
        assert probe.received == b""
        probe.t.resume_reading()
        await until(lambda: probe.received == b"ping", "the paused bytes")
        read_at = trio.current_time()
        data, eof_at = await read_until_eof(client)
        await lost(probe)
    assert read_at == probe.made_at + 7
    lost_at = assert_expired(probe, Reason.IDLE, read_at, 5, keeper.tick)
    assert data == b"" and eof_at == lost_at
    assert keeper.stats.stall_saves == 1


async def test_stall_safety_control_no_unread_bytes_expires(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    probes, factory = collecting(Paused)
    async with serving(keeper, factory, idle=5) as (_engine, addr):
        client = await connect(addr)
        data, eof_at = await read_until_eof(client)
        [probe] = probes
        await lost(probe)
    lost_at = assert_expired(probe, Reason.IDLE, probe.made_at, 5, keeper.tick)
    assert data == b"" and eof_at == lost_at
    assert keeper.stats.stall_saves == 0


# -- 4. partial writes -------------------------------------------------------------------------


async def test_partial_writes_arrive_intact_to_a_slow_reader(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    payload = random.Random(4).randbytes(8 << 20)
    at_write: list[tuple[int, bool]] = []

    class Sender(Probe):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.t.write(payload)
            at_write.append((self.t.get_write_buffer_size(), self.t._sending))

    probes, factory = collecting(Sender)
    async with serving(keeper, factory, send=5) as (_engine, addr):
        client = await connect(addr)
        await client.send(b"GET")
        got = bytearray()
        mid: list[tuple[int, bool]] = []
        while len(got) < len(payload):
            await trio.sleep(0.2)
            chunk = await client.recv(256 * 1024)
            assert chunk
            got += chunk
            [probe] = probes
            mid.append((probe.t.get_write_buffer_size(), probe.t._sending))
        [(queued, sending)] = at_write
        assert 0 < queued < len(payload) and sending  # the kernel took some, the rest queued
        assert mid[0][0] > 0 and mid[0][1]  # still queued and sending after the first read
        sizes = [size for size, _ in mid]
        assert sizes == sorted(sizes, reverse=True)  # the queue only drains
        assert bytes(got) == payload  # intact and in order
        assert trio.current_time() > 5  # far longer than send=5: steady progress is not stalling
        await until(lambda: probe.t.get_write_buffer_size() == 0, "drained")
        assert not probe.t._sending and not probe.lost
        assert probe.events == ["made", "data", "pause", "resume"]  # default water marks
        client.close()
        await lost(probe)
    assert probe.lost_once[1] is None


# -- 4b. a pass's writes gathered into one send ------------------------------------------------------


async def test_a_pass_sends_its_first_write_at_once_and_gathers_the_rest(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    """In a callback, the first write to a connection goes to the kernel at once; the
    pass's later writes to it wait for its end and go out together, in order (replies,
    and messages forwarded from other connections), counted as queued meanwhile. A
    pass therefore sends at most twice to a connection. Writes from a task go at once."""
    seen: list[tuple[str, int, int]] = []

    class Relay(Probe):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            t = self.t
            for i in range(3):
                t.write(b"reply%d;" % i)
                seen.append(("self", t.gathered, t.get_write_buffer_size()))
            for other in probes:
                if other is not self:
                    for _ in range(2):
                        other.t.write(b"fwd:" + data)
                        seen.append(("other", other.t.gathered, other.t.get_write_buffer_size()))

    probes, factory = collecting(Relay)
    async with serving(keeper, factory) as (_engine, addr):
        a, b = await connect(addr), await connect(addr)
        await until(lambda: len(probes) == 2, "accepts")
        await a.send(b"x")
        assert await recv_exactly(a, 21) == b"reply0;reply1;reply2;"
        assert await recv_exactly(b, 10) == b"fwd:xfwd:x"
        assert seen == [
            ("self", 0, 0),  # the first: sent there and then
            ("self", 7, 7),  # the rest: gathered
            ("self", 14, 14),
            ("other", 0, 0),  # the first write to another connection goes at once too
            ("other", 5, 5),
        ]
        assert all(p.t.gathered == 0 and p.t.get_write_buffer_size() == 0 for p in probes)
        probes[0].t.write(b"now")  # from this task, not a pass: sent at once
        assert probes[0].t.gathered == 0 and probes[0].t.get_write_buffer_size() == 0
        assert await recv_exactly(a, 3) == b"now"
        await a.send(b"y")  # a new pass: its first write goes at once again
        assert await recv_exactly(a, 21) == b"reply0;reply1;reply2;"
        assert seen[5:8] == [("self", 0, 0), ("self", 7, 7), ("self", 14, 14)]


async def test_alone_in_pass_only_while_a_pass_serves_that_connection_and_no_other(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    """Transport.alone_in_pass: True in a callback of a pass that polled this one
    connection; False in a pass that serves two, and outside any pass."""
    seen: list[tuple[bytes, bool]] = []

    class Asking(Probe):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            seen.append((data, self.t.alone_in_pass))

    probes, factory = collecting(Asking)
    async with serving(keeper, factory) as (_engine, addr):
        a = socket.create_connection(addr)
        b = socket.create_connection(addr)
        try:
            await until(lambda: len(probes) == 2, "accepts")
            a.sendall(b"a1")  # no checkpoint between: one pass finds it alone
            await until(lambda: len(seen) == 1, "a1 read")
            a.sendall(b"a2")
            b.sendall(b"b1")  # both ready before the engine's next pass
            await until(lambda: len(seen) == 3, "a2 and b1 read")
            assert seen[0] == (b"a1", True)
            assert sorted(seen[1:]) == [(b"a2", False), (b"b1", False)]
            assert not probes[0].t.alone_in_pass  # a task, not a pass
        finally:
            a.close()
            b.close()


async def test_gathered_writes_go_before_a_close_an_eof_or_an_abort(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    """A close, a half-close or an abort in the same callback sees the gathered bytes
    offered to the kernel first, as they would have been without gathering; a write as
    large as the gathering limit goes at once."""

    class Ender(Probe):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            t = self.t
            t.write(b"bye:" + data)
            if data == b"close":
                t.close()
            elif data == b"eof":
                t.write_eof()
            elif data == b"abort":
                t.abort()
            else:
                t.write(b"z" * idlekeeper.transport.GATHER_LIMIT)
                assert t.gathered == 0  # sent there and then

    _probes, factory = collecting(Ender)
    async with serving(keeper, factory) as (_engine, addr):
        for word in (b"close", b"eof", b"abort"):
            client = await connect(addr)
            await client.send(word)
            data, _ = await read_until_eof(client)
            assert data == b"bye:" + word, word
        client = await connect(addr)
        await client.send(b"big")
        got = await recv_exactly(client, 7 + idlekeeper.transport.GATHER_LIMIT)
        assert got.startswith(b"bye:big") and got.endswith(b"z" * 100)


async def test_a_pass_gathers_no_more_than_the_high_water_mark(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """Past the engine's high-water mark, gathered bytes go to the kernel at once, so
    a writer is paused (or not) where it would have been without gathering."""
    seen: list[int] = []

    class Writer(Probe):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            for _ in range(4):
                self.t.write(b"w" * 500)
                seen.append(self.t.gathered)

    _probes, factory = collecting(Writer)
    async with serving(keeper, factory, high_water=1024, low_water=0) as (_engine, addr):
        client = await connect(addr)
        await client.send(b"go")
        assert await recv_exactly(client, 2000) == b"w" * 2000
        # The first went at once; the fourth took the gathered bytes past 1,024: sent
        # there and then.
        assert seen == [0, 500, 1000, 0]


# -- 5. backpressure -------------------------------------------------------------------------------


async def test_backpressure_pauses_reading_until_the_peer_drains(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    size = 8 << 20
    water: list[tuple[str, int, bool]] = []

    class Flood(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            transport.write(b"w" * size)

        def pause_writing(self) -> None:
            super().pause_writing()
            water.append(("pause", self.t.get_write_buffer_size(), self.t.reading))

        def resume_writing(self) -> None:
            super().resume_writing()
            water.append(("resume", self.t.get_write_buffer_size(), self.t.reading))

    probes, factory = collecting(Flood)
    async with serving(keeper, factory, high_water=64 * 1024, low_water=16 * 1024) as (_engine, addr):
        client = await connect(addr)
        await until(lambda: bool(probes), "accept")
        [probe] = probes
        assert probe.events == ["made", "pause"]
        [(_, queued, reading)] = water
        assert queued > 64 * 1024 and not reading
        assert not probe.t.reading
        await client.send(b"ping")
        for _ in range(50):
            await trio.lowlevel.checkpoint()
        assert unread_bytes(sock_of(probe.t)) == 4  # the engine is not reading this peer
        assert probe.received == b""
        got = 0
        while got < size:
            chunk = await client.recv(1 << 20)
            assert chunk and chunk == b"w" * len(chunk)
            got += len(chunk)
        await until(lambda: probe.received == b"ping", "reading resumed")
        assert probe.events == ["made", "pause", "resume", "data"]
        assert water[1][0] == "resume" and water[1][1] <= 16 * 1024 and water[1][2]
        assert probe.t.reading and not probe.lost


# -- 6. half-close -----------------------------------------------------------------------------------


async def test_peer_half_close_then_reply_and_close(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    class Replier(Probe):
        def eof_received(self) -> bool | None:
            super().eof_received()
            self.t.write(b"you said: " + bytes(self.received))
            return True  # keep the connection to write later

    probes, factory = collecting(Replier)
    async with serving(keeper, factory) as (_engine, addr):
        client = await connect(addr)
        await client.send(b"question")
        client.shutdown(socket.SHUT_WR)
        await until(lambda: bool(probes) and "eof" in probes[0].events, "eof_received")
        [probe] = probes
        assert not probe.lost and not probe.t.is_closing() and not probe.t.reading
        await trio.sleep(1)  # the protocol answers a second later, from elsewhere
        probe.t.write(b"; and later: bye")
        probe.t.close()
        data, eof_at = await read_until_eof(client)
        await lost(probe)
    assert data == b"you said: question; and later: bye"
    assert probe.events == ["made", "data", "eof", "lost"]
    assert probe.lost_once == (eof_at, None)
    assert eof_at == probe.made_at + 1


async def test_eof_received_false_closes_after_the_queue_is_sent(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """Without keep-open, what the protocol queued is still sent before the FIN."""
    big = random.Random(6).randbytes(4 << 20)

    class LastWords(Probe):
        def eof_received(self) -> bool | None:
            super().eof_received()
            self.t.write(big)
            assert self.t.get_write_buffer_size() > 0
            return None

    probes, factory = collecting(LastWords)
    async with serving(keeper, factory) as (_engine, addr):
        client = await connect(addr)
        client.shutdown(socket.SHUT_WR)
        await until(lambda: bool(probes) and "eof" in probes[0].events, "eof_received")
        assert probes[0].t.is_closing() and not probes[0].lost
        data, _ = await read_until_eof(client)
    assert data == big
    assert probes[0].lost_once[1] is None


async def test_server_write_eof_keeps_receiving(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    greeting = random.Random(5).randbytes(8 << 20)  # more than the kernel takes: write_eof waits for it

    class Greeter(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            transport.write(greeting)
            assert transport.get_write_buffer_size() > 0
            transport.write_eof()
            transport.write(b"dropped after write_eof")

    probes, factory = collecting(Greeter)
    async with serving(keeper, factory) as (_engine, addr):
        client = await connect(addr)
        data, _ = await read_until_eof(client)  # the greeting, then EOF
        assert data == greeting
        [probe] = probes
        assert not probe.lost and probe.t.reading
        await client.send(b"still talking")
        await until(lambda: probe.received == b"still talking", "data after write_eof")
        client.close()
        await lost(probe)
    assert probe.events == ["made", "pause", "resume", "data", "eof", "lost"]
    assert probe.lost_once[1] is None


# -- 7. reset ------------------------------------------------------------------------------------------


async def test_peer_reset_gives_connection_reset_error(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    probes, factory = collecting(lambda: Probe(echo=True))
    async with serving(keeper, factory, idle=30) as (engine, addr):
        rude = await connect(addr)
        other = await connect(addr)
        await until(lambda: len(probes) == 2, "accepts")
        await rude.send(b"a")
        assert await rude.recv(1) == b"a"
        rude.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
        rude.close()  # linger (1, 0): RST instead of FIN
        await lost(probes[0])
        _, exc = probes[0].lost_once
        # The server had read everything, so recv reports the reset itself.
        assert type(exc) is ConnectionResetError
        assert "eof" not in probes[0].events
        await other.send(b"still fine")
        assert await recv_exactly(other, 10) == b"still fine"
        assert not probes[1].lost and len(engine) == 1


async def test_reset_while_writes_are_queued(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """The reset is found by the write side when reading is off (backpressure)."""

    class Flood(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            transport.write(b"q" * (8 << 20))

    probes, factory = collecting(Flood)
    async with serving(keeper, factory, high_water=64 * 1024, low_water=0) as (engine, addr):
        rude = await connect(addr)
        await until(lambda: bool(probes), "accept")
        [probe] = probes
        assert not probe.t.reading and probe.t.get_write_buffer_size() > 0
        rude.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
        rude.close()
        await lost(probe)
        _, exc = probe.lost_once
        assert type(exc) is ConnectionResetError
        assert len(engine) == 0 and keeper.stats.watched == 0


# -- 8. out of descriptors at accept -------------------------------------------------------------


@contextmanager
def no_free_descriptors() -> Iterator[None]:
    """Lower RLIMIT_NOFILE so that the process cannot open one more descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)  # the kernel hands out the lowest free one
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_emfile_at_accept_pauses_and_recovers(
    keeper: idlekeeper.Keeper, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    probes, factory = collecting(lambda: Probe(echo=True))
    async with serving(keeper, factory) as (engine, addr):
        early = await connect(addr)
        await until(lambda: len(probes) == 1, "first accept")
        waiting = [trio.socket.socket() for _ in range(3)]  # descriptors made before the limit
        try:
            with no_free_descriptors(), caplog.at_level(logging.WARNING, "idlekeeper.engine"):
                with pytest.raises(OSError) as info:
                    socket.socket()
                assert info.value.errno == errno.EMFILE  # the limit holds in this process
                for sock in waiting:
                    await sock.connect(addr)  # the kernel queues them; accept needs a descriptor
                await trio.sleep(1)
                assert engine.accept_errors >= 5  # retried every 0.1 s, failing each time
                assert engine.accepted == 1 and len(probes) == 1
                # The connection already served goes on.
                await early.send(b"during")
                assert await recv_exactly(early, 6) == b"during"
                assert "pausing accepts" in caplog.text
            errors = engine.accept_errors
            await trio.sleep(0.2)  # the pause passes: the queued connections are accepted
            assert engine.accepted == 4 and len(engine) == 4
            assert engine.accept_errors == errors
            for i, sock in enumerate(waiting):
                await sock.send(b"late %d" % i)
                assert await recv_exactly(sock, 6) == b"late %d" % i
        finally:
            for sock in waiting:
                sock.close()
    assert [type(p.lost_once[1]) for p in probes] == [EngineClosedError] * 4


# -- 9. thousands of connections --------------------------------------------------------------------


async def test_two_thousand_connections_echo_then_expire_once_each(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    n = 2000
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * n + 200:
        pytest.skip(f"needs {2 * n + 200} descriptors, RLIMIT_NOFILE is {soft}")
    probes, factory = collecting(lambda: Probe(echo=True))
    async with idlekeeper.open_engine(keeper) as engine:
        [listener] = engine.serve([listening_socket(backlog=4096)], factory, idle=5)
        addr = listener.getsockname()
        clients = [await connect(addr) for _ in range(n)]
        await until(lambda: len(engine) == n, "all accepted")
        assert keeper.stats.watched == n
        for i, client in enumerate(clients):
            await client.send(b"%05d" % i)
        for i, client in enumerate(clients):
            assert await recv_exactly(client, 5) == b"%05d" % i
        for client in clients:  # then silence: each is closed by the keeper
            data, _ = await read_until_eof(client)
            assert data == b""
            client.close()
        await until(lambda: all(p.lost for p in probes), "every connection_lost")
        assert len(engine) == 0 and keeper.stats.watched == 0 and keeper.stats.filed == 0
        assert engine.accepted == n and engine.callback_errors == 0
    assert len(probes) == n
    for probe in probes:
        assert probe.events == ["made", "data", "lost"]
        assert_expired(probe, Reason.IDLE, probe.last_rx_at, 5, keeper.tick)
    assert keeper.stats.expired[Reason.IDLE] == n


# -- 10. what a connection costs ----------------------------------------------------------------------


class Minimal(idlekeeper.Protocol):
    __slots__ = ("transport",)

    def connection_made(self, transport: Transport) -> None:
        self.transport = transport


def count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(child) for nursery in task.child_nurseries for child in nursery.child_tasks)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return walk(root)


def gc_census() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


async def test_objects_and_memory_per_connection(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    n = 1000
    async with idlekeeper.open_engine(keeper) as engine:
        listener = listening_socket(backlog=n + 10)
        addr = listener.getsockname()
        # The clients first: the kernel completes their handshakes into the backlog,
        # so everything made after the census is the server's side.
        clients = [await connect(addr) for _ in range(n)]
        await trio.lowlevel.checkpoint()
        tasks_before = count_tasks()
        before = gc_census()
        tracemalloc.start()
        try:
            traced_before, _ = tracemalloc.get_traced_memory()
            engine.serve([listener], Minimal, idle=60, receive=30)
            await until(lambda: len(engine) == n, "all accepted")
            gc.collect()
            traced_after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        after = gc_census()
        tasks_after = count_tasks()
        grown = after - before
        per_conn_objects = sum(grown.values()) / n
        per_conn_bytes = (traced_after - traced_before) / n
        print(f"per connection: {per_conn_objects:.2f} gc objects {dict(grown)}, {per_conn_bytes:.0f} bytes traced")
        # A Transport and the protocol; the socket is the C one, which the collector does
        # not track. The rest (trio's and the census's own bookkeeping) is a fixed few
        # dozen, not per connection.
        assert grown["Transport"] == n and grown["Minimal"] == n and grown["socket"] == 0
        assert sum(grown.values()) - 2 * n <= 100
        assert per_conn_objects <= 2.1
        assert per_conn_bytes <= 600
        assert tasks_after == tasks_before  # no task per connection
        assert after["CancelScope"] <= before["CancelScope"]  # and no cancel scope
        assert keeper.stats.watched == n
        for client in clients:
            client.close()
        await until(lambda: len(engine) == 0, "all closed")
        assert keeper.stats.watched == 0


async def test_a_transport_keeps_its_size_class_and_its_timeouts_cost_no_object(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    n = 300
    async with idlekeeper.open_engine(keeper) as engine:
        listener = listening_socket(backlog=n + 10)
        clients = [await connect(listener.getsockname()) for _ in range(n)]
        engine.serve([listener], Minimal)
        await until(lambda: len(engine) == n, "all accepted")
        transports = [t for t in engine._fds.values() if isinstance(t, Transport)]
        assert len(transports) == n
        # The collector's header included: a slot more is the allocator's next size
        # class for every connection (a million devices: 16 MB).
        assert sys.getsizeof(transports[0]) <= 224
        await trio.sleep(1.0)  # a later phase: its timeouts count from now
        gc.collect()
        tracemalloc.start()
        try:
            for t in transports:
                t.receive_timeout = 30
                t.idle_timeout = 60
                t.send_timeout = 10
            snapshot = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        # What is kept, the wheel's filing of each connection aside (its buckets grow):
        # the moment each timeout was set is the pass's epoch, shared, not a float
        # apiece (3 x 24 bytes a connection).
        kept = snapshot.filter_traces([tracemalloc.Filter(False, "*/idlekeeper/wheel.py")])
        per_connection = sum(stat.size for stat in kept.statistics("filename")) / n
        assert per_connection < 8, kept.statistics("lineno")[:3]
        # And they count from then: the receive timeout, the earliest that applies
        # (no send is pending), ends each 30 s later, not sooner, within a tick.
        set_at = trio.current_time()
        await trio.sleep(29.9)
        assert not any(t.expired for t in transports)
        await trio.sleep(0.2 + keeper.tick)
        await until(lambda: len(engine) == 0, "all expired")
        assert {t.reason for t in transports} == {Reason.RECEIVE}
        assert all(30 <= t.lag + 30 <= 30 + keeper.tick for t in transports)
        assert trio.current_time() - set_at <= 30 + 0.2 + keeper.tick
        for client in clients:
            client.close()


# -- 11. a protocol that raises -----------------------------------------------------------------------


class Fragile(Probe):
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if b"boom" in data:
            raise RuntimeError("a protocol bug")


async def test_raising_protocol_closes_only_its_connection(
    keeper: idlekeeper.Keeper, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    probes, factory = collecting(lambda: Fragile(echo=True))
    async with serving(keeper, factory) as (engine, addr):
        victim = await connect(addr)
        bystander = await connect(addr)
        await until(lambda: len(probes) == 2, "accepts")
        await victim.send(b"boom")
        data, _ = await read_until_eof(victim)
        await lost(probes[0])
        assert data == b"boom"  # the echo went out before the raise
        _, exc = probes[0].lost_once
        assert isinstance(exc, RuntimeError) and str(exc) == "a protocol bug"
        assert engine.callback_errors == 1
        assert "a protocol bug" in caplog.text
        host, port = victim.getsockname()[:2]
        # The operator can tell which peer's bytes broke it; the bystander is not named.
        assert f"raised on the connection from {host}:{port}; closing it" in caplog.text
        assert f":{bystander.getsockname()[1]}" not in caplog.text
        await bystander.send(b"fine")
        assert await recv_exactly(bystander, 4) == b"fine"
        assert not probes[1].lost and len(engine) == 1


async def test_raising_pause_writing_closes_its_connection(
    keeper: idlekeeper.Keeper, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    class BadPause(Probe):
        def connection_made(self, transport: Transport) -> None:
            super().connection_made(transport)
            transport.write(b"p" * (8 << 20))

        def pause_writing(self) -> None:
            raise ValueError("cannot pause")

    probes, factory = collecting(BadPause)
    async with serving(keeper, factory, high_water=1024, low_water=0) as (engine, addr):
        client = await connect(addr)
        await until(lambda: bool(probes) and bool(probes[0].lost), "connection_lost")
        _, exc = probes[0].lost_once
        assert isinstance(exc, ValueError)
        assert engine.callback_errors == 1 and len(engine) == 0
        host, port = client.getsockname()[:2]
        assert f"pause_writing of {probes[0]!r} raised on the connection from {host}:{port}" in caplog.text


async def test_raising_connection_made_closes_that_connection_and_names_its_peer(
    keeper: idlekeeper.Keeper, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    made = 0

    class BadStart(Probe):
        def connection_made(self, transport: Transport) -> None:
            nonlocal made
            super().connection_made(transport)
            made += 1
            if made == 1:
                raise KeyError("no room for it")

    probes, factory = collecting(BadStart)
    async with serving(keeper, factory) as (engine, addr):
        first = await connect(addr)
        data, _ = await read_until_eof(first)
        assert data == b""
        second = await connect(addr)
        await second.send(b"still served")
        await until(lambda: len(probes) == 2 and bytes(probes[1].received) == b"still served", "the second's bytes")
        assert engine.callback_errors == 1 and len(engine) == 1
        host, port = first.getsockname()[:2]
        assert f"connection_made of {probes[0]!r} raised on the connection from {host}:{port}" in caplog.text
        assert "no room for it" in caplog.text


# -- adopting a socket made elsewhere -----------------------------------------------------------------


async def test_adopt_serves_a_blocking_socketpair(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    payload = random.Random(7).randbytes(4 << 20)
    ours, theirs = socket.socketpair()  # blocking, as made
    async with idlekeeper.open_engine(keeper) as engine:
        probe = Probe(echo=True)
        transport = engine.adopt(ours, probe, idle=5)
        assert probe.t is transport and probe.events == ["made"]
        # Made non-blocking: a blocking send of more than the buffer holds would
        # otherwise stop the engine's task (and the whole trio thread) until the peer reads.
        assert not ours.getblocking()
        transport.write(payload)
        assert transport.get_write_buffer_size() > 0
        client = trio.socket.from_stdlib_socket(theirs)
        assert await recv_exactly(client, len(payload)) == payload
        await client.send(b"back")
        assert await recv_exactly(client, 4) == b"back"
        data, _ = await read_until_eof(client)
        await lost(probe)
        assert data == b""
        assert_expired(probe, Reason.IDLE, probe.last_rx_at, 5, keeper.tick)
        client.close()


# -- 12. shutdown ------------------------------------------------------------------------------------------


async def test_leaving_open_engine_tells_every_protocol(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    probes, factory = collecting()
    async with serving(keeper, factory, idle=100) as (engine, addr):
        clients = [await connect(addr) for _ in range(3)]
        await until(lambda: len(probes) == 3, "accepts")
        listener = engine.listeners[0]
    for probe in probes:
        _, exc = probe.lost_once
        assert isinstance(exc, EngineClosedError)
        assert probe.t.protocol is None and not probe.t.active
    assert listener.fileno() == -1 and engine.listeners == []
    assert len(engine) == 0 and keeper.stats.watched == 0 and keeper.stats.filed == 0
    for client in clients:
        assert await read_until_eof(client) == (b"", trio.current_time())
    with listening_socket() as spare, pytest.raises(trio.ClosedResourceError):
        engine.serve([spare], Probe)


# -- coalescing: fewer wake-ups while traffic trickles in --------------------------------


class Stamped(Probe):
    """Records the (mock) time of every read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[float] = []

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.reads.extend([trio.current_time()] * len(data))


async def test_coalescing_serves_trickled_packets_in_fewer_passes_within_its_window(clock: MockClock) -> None:
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        probes, factory = collecting(Stamped)
        async with idlekeeper.open_engine(keeper, coalesce=0.25) as engine:
            [listener] = engine.serve([listening_socket()], factory, receive=60.0)
            socks = [await connect(listener.getsockname()) for _ in range(4)]
            await trio.sleep(1.0)  # accepted (the accepts are gathered too)
            assert len(probes) == 4
            before = engine.passes
            sent: list[float] = []
            for _ in range(10):  # 40 one-byte packets, one every 50 ms
                for sock in socks:
                    sent.append(trio.current_time())
                    await sock.send(b"x")
                    await trio.sleep(0.05)
            await trio.sleep(1.0)
            reads = sorted(t for p in probes if isinstance(p, Stamped) for t in p.reads)
            assert len(reads) == 40
            delays = [r - s for r, s in zip(reads, sorted(sent), strict=True)]
            assert min(delays) >= 0 and max(delays) <= 0.25 + 1e-6  # never later than the window
            during = engine.passes - before
            assert during <= 12  # 2 s of traffic in passes of 0.25 s (a pass per packet would be 40)
            await trio.sleep(10)  # idle: back to waiting on epoll, no polling
            assert engine.passes - before == during
            for sock in socks:
                sock.close()


async def test_coalescing_never_costs_a_device_whose_bytes_wait_in_the_kernel(clock: MockClock) -> None:
    """Bytes that arrived before the deadline but are read a window later spare the
    connection (the keeper's stall check), so a coarse window is safe."""
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        probes, factory = collecting(Probe)
        async with idlekeeper.open_engine(keeper, coalesce=0.5) as engine:
            [listener] = engine.serve([listening_socket()], factory, receive=1.0)
            sock = await connect(listener.getsockname())
            await trio.sleep(0.6)
            assert len(probes) == 1
            await sock.send(b"a")  # starts the engine's gathering: the next pass is 0.5 s away
            for _ in range(4):
                await trio.sleep(0.45)
                await sock.send(b"b")  # just in time each time; read up to 0.5 s later
            assert not probes[0].lost
            assert bytes(probes[0].received).startswith(b"ab")
            sock.close()
            await trio.sleep(2.0)  # its EOF is read on a pass a window later
            assert probes[0].lost_once[1] is None


async def test_coalescing_does_not_pace_accepts(clock: MockClock) -> None:
    """More connections waiting than a pass accepts are taken at once, not a window apart."""
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        probes, factory = collecting(Probe)
        async with idlekeeper.open_engine(keeper, coalesce=1.0, accept_batch=16) as engine:
            [listener] = engine.serve([listening_socket(backlog=256)], factory)
            socks = [await connect(listener.getsockname()) for _ in range(100)]
            await trio.sleep(1.5)  # one window: the first accept started it
            assert len(probes) == 100  # 7 batches of 16 in a row, not a window apart
            for sock in socks:
                sock.close()


async def test_coalescing_accepts_a_new_connection_at_once_not_a_window_later(clock: MockClock) -> None:
    """A connection arriving while the engine gathers traffic is accepted then, not at
    the window's end: in a ramp, the kernel's accept queue would overflow meanwhile and
    each dropped SYN costs the client a retransmission timeout (1 s, then 3, 7...)."""
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        probes, factory = collecting(Probe)
        async with idlekeeper.open_engine(keeper, coalesce=1.0) as engine:
            [listener] = engine.serve([listening_socket()], factory, receive=60.0)
            chatty = await connect(listener.getsockname())
            await trio.sleep(1.5)
            await chatty.send(b"x")  # the engine is gathering from here on
            late = []
            for _ in range(5):
                await trio.sleep(0.3)
                await chatty.send(b"x")
                asked = trio.current_time()
                late.append(await connect(listener.getsockname()))
                await trio.sleep(0.05)
                assert len(probes) == 1 + len(late)
                assert probes[-1].made_at - asked <= 0.01
            assert bytes(probes[0].received) == b"x" * 6
            for sock in (chatty, *late):
                sock.close()


async def test_coalescing_does_not_pace_reads_past_a_full_batch_of_events(clock: MockClock) -> None:
    """More sockets ready than one epoll batch holds are all read in the window, not one
    batch a window (at 1,000 heartbeats/s and ``coalesce=1`` the backlog grew by seconds)."""
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        probes, factory = collecting(Stamped)
        async with idlekeeper.open_engine(keeper, coalesce=1.0, max_events=8) as engine:
            [listener] = engine.serve([listening_socket()], factory, receive=60.0)
            socks = [await connect(listener.getsockname()) for _ in range(50)]
            await trio.sleep(2.0)
            assert len(probes) == 50
            for _ in range(3):  # three windows' worth: 50 sockets ready at once, 8 a batch
                sent = trio.current_time()
                for sock in socks:
                    await sock.send(b"x")
                await trio.sleep(1.5)
                reads = [t for p in probes if isinstance(p, Stamped) for t in p.reads if t >= sent]
                assert len(reads) == 50
                assert max(reads) - sent <= 1.0 + 1e-6  # within the window it fell in
            for sock in socks:
                sock.close()


async def test_coalescing_tells_an_expired_connection_at_once_not_a_window_later(clock: MockClock) -> None:
    """The reaper drops a connection while the engine gathers traffic: its protocol
    hears within the tick (when a presence server says offline), not at the next pass."""
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        probes, factory = collecting(Probe)
        async with idlekeeper.open_engine(keeper, coalesce=1.0) as engine:
            [listener] = engine.serve([listening_socket()], factory, receive=3.0)
            chatty = await connect(listener.getsockname())
            silent = await connect(listener.getsockname())
            await trio.sleep(1.5)  # both accepted (the accepts may fall in two windows)
            assert len(probes) == 2
            silent_probe = next(p for p in probes if p.t.get_extra_info("peername") == silent.getsockname())
            deadline = silent_probe.made_at + 3.0
            for _ in range(15):  # keeps the engine gathering in windows of 1 s throughout
                await chatty.send(b"x")
                await trio.sleep(0.4)
            when, exc = silent_probe.lost_once
            assert isinstance(exc, ExpiredError) and exc.reason is Reason.RECEIVE
            assert deadline <= when <= deadline + 0.1 + 1e-6
            assert len(engine) == 1
            chatty.close()
            silent.close()


async def test_a_coalescing_window_ends_with_the_reaper_s_wake_up_in_its_second_half(clock: MockClock) -> None:
    """Ending the window when the reaper wakes anyway costs no wake-up of its own (one
    trio wake-up for both); an alarm early in the window does not cut it short."""
    async with idlekeeper.open_keeper(tick=0.1, lookahead=0) as keeper:
        probes, factory = collecting(Stamped)
        async with idlekeeper.open_engine(keeper, coalesce=1.0) as engine:
            [listener] = engine.serve([listening_socket()], factory, receive=60.0)
            sock = await connect(listener.getsockname())
            await trio.sleep(2.0)
            [probe] = probes
            assert isinstance(probe, Stamped)
            for offset, expected in ((0.7, 0.7), (0.3, 1.0)):
                start = trio.current_time()
                keeper.call_at(start + offset, lambda: None)  # the reaper's alarm
                await sock.send(b"a")  # read at once; a window of 1 s begins
                await trio.sleep(0.1)
                await sock.send(b"b")  # waits for the window's end
                await trio.sleep(2.5)
                read_a, read_b = probe.reads[-2:]
                assert read_a - start <= 0.01
                assert abs(read_b - start - expected) <= 0.01, (offset, read_b - start)
            sock.close()
