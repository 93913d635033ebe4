"""Each deadline kind on real loopback sockets, under MockClock; stall safety; SSL."""

from __future__ import annotations

import socket as stdlib_socket
import ssl
from functools import partial

import pytest
import trio
import trio.testing
import trustme
from trio.testing import MockClock

import idlekeeper
from idlekeeper import Reason
from servers.prometheus import KeeperCollector

from .conftest import tcp_pair


async def read_until_eof(stream: trio.abc.Stream) -> float:
    """Drain a stream; return the (mock) time at which the peer closed it."""
    try:
        while await stream.receive_some(65536):
            pass
    except trio.BrokenResourceError:
        pass
    return trio.current_time()


async def test_silent_client_is_closed_at_idle_timeout(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    server, client = await tcp_pair()
    start = trio.current_time()
    with keeper.watch(server, idle=5) as w:
        await w.stream.receive_some()
    assert w.reason is Reason.IDLE
    closed_at = await read_until_eof(client)  # keeper closed the socket: client sees EOF
    assert 5 <= closed_at - start < 5 + keeper.tick
    assert server.socket.fileno() == -1


async def test_receive_timeout_with_trickling_client(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    server, client = await tcp_pair()

    async def trickle() -> None:
        for _ in range(3):
            await trio.sleep(2)
            await client.send_all(b"x")

    received = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        with keeper.watch(server, receive=3) as w:
            while True:
                received += await w.stream.receive_some()
                # The server keeps sending: that must not extend a receive timeout.
                await w.stream.send_all(b"ack")
    assert received == b"xxx"
    assert w.reason is Reason.RECEIVE
    assert 9 <= trio.current_time() < 9 + keeper.tick
    await client.aclose()


async def test_send_timeout_when_peer_stops_reading(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    server, client = await tcp_pair()
    sent_until = 0.0
    with keeper.watch(server, send=4, idle=None) as w:
        payload = b"x" * (1 << 20)
        while True:
            await w.stream.send_all(payload)  # the client never reads: this blocks
            sent_until = trio.current_time()
    assert w.reason is Reason.SEND
    assert w.lag < keeper.tick
    assert sent_until + 4 <= trio.current_time()
    await client.aclose()


async def test_slow_but_steady_reader_is_not_cut_off(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """send_timeout is between two writes (nginx), not for the whole response."""
    server, client = await tcp_pair()
    # A small send buffer makes the sender wake often. (Tiny receive windows would
    # bring in the kernel's persist timer, which runs on real time, not mock time.)
    server.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_SNDBUF, 65536)
    total = 16 << 20
    got = 0

    async def slow_reader() -> None:
        nonlocal got
        while got < total:
            await trio.sleep(0.5)
            data = await client.receive_some(256 * 1024)
            if not data:
                break
            got += len(data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow_reader)
        with keeper.watch(server, send=5) as w:
            await w.stream.send_all(b"y" * total)
        assert not w.expired
    assert got == total
    assert trio.current_time() > 5 * 4  # the whole transfer took far longer than send=5


async def test_absolute_deadline_on_busy_connection(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    server, client = await tcp_pair()

    async def chatter() -> None:
        try:
            while True:
                await trio.sleep(0.25)
                await client.send_all(b"hi")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chatter)
        with keeper.watch(server, idle=1, max_age=6) as w:
            while await w.stream.receive_some():
                pass
        assert w.reason is Reason.ABSOLUTE
        assert 6 <= trio.current_time() < 6 + keeper.tick
        nursery.cancel_scope.cancel()


async def test_stall_safety_with_real_unread_bytes(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """Bytes that arrived in time but sit unread (server busy) keep the peer alive."""
    server, client = await tcp_pair()

    async def client_side() -> None:
        await trio.sleep(1)
        await client.send_all(b"ping")  # on time, but the server is "busy"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client_side)
        with keeper.watch(server, idle=5) as w:
            await trio.sleep(7)  # busy: not reading, the deadline at t=5 passes
            assert not w.expired
            assert keeper.stats.stall_saves == 1
            assert await w.stream.receive_some() == b"ping"
            read_at = trio.current_time()
            await w.stream.receive_some()
    assert w.reason is Reason.IDLE
    assert read_at + 5 <= trio.current_time() < read_at + 5 + keeper.tick


async def test_without_unread_bytes_the_same_server_expires(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """The control for the stall test: no bytes waiting, expired on time."""
    server, _client = await tcp_pair()
    with keeper.watch(server, idle=5) as w:
        await trio.sleep(7)
    assert w.reason is Reason.IDLE
    assert keeper.stats.stall_saves == 0
    assert 5 <= trio.current_time() < 5 + keeper.tick


async def test_an_absolute_deadline_passed_in_our_stall_gives_bytes_sent_in_time_a_tick(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    """Guarantee 6 for absolute deadlines: a request head's last bytes came before its
    deadline, but we stalled past it without reading them. The reader gets one tick."""
    server, client = await tcp_pair()
    with keeper.watch(server) as w:
        w.deadline = trio.current_time() + 1
        await client.send_all(b"the head's end")  # at t=0: in time
        clock.jump(3)  # a stall of ours: nothing ran at t=1
        await trio.sleep(keeper.tick / 2)  # the reaper's late pass
        assert not w.expired
        assert keeper.stats.stall_graces == 1
        assert await w.stream.receive_some() == b"the head's end"
        w.deadline = None  # the head is complete: its deadline goes
        # The next deadline gets its own grace.
        w.deadline = trio.current_time() + 1
        await client.send_all(b"next head")
        clock.jump(3)
        await trio.sleep(keeper.tick / 2)
        assert not w.expired and keeper.stats.stall_graces == 2
        assert await w.stream.receive_some() == b"next head"
        w.deadline = None
        await trio.sleep(5)
    assert not w.expired


async def test_the_grace_is_one_tick_once_and_only_after_a_stall(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """Not read within the grace, the connection ends; and with no stall, bytes unread at
    an absolute deadline spare nobody (a slowloris's last byte would extend it)."""
    server, client = await tcp_pair()
    with keeper.watch(server) as w:
        w.deadline = trio.current_time() + 1
        await client.send_all(b"x")
        clock.jump(3)
        stalled_until = trio.current_time()
        await trio.sleep(60)  # never read
    assert w.reason is Reason.ABSOLUTE and keeper.stats.stall_graces == 1
    assert stalled_until + keeper.tick <= trio.current_time() < stalled_until + 2 * keeper.tick
    server, client = await tcp_pair()
    with keeper.watch(server) as w:
        start = trio.current_time()
        w.deadline = start + 1
        await client.send_all(b"x")
        await trio.sleep(60)  # no stall: the reaper is on time
    assert w.reason is Reason.ABSOLUTE and keeper.stats.stall_graces == 1
    assert start + 1 <= trio.current_time() < start + 1 + keeper.tick


async def test_late_with_unread_asks_for_both_a_stall_and_bytes(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """The check a timer standing for a deadline (a request head's) makes before acting."""
    server, client = await tcp_pair()
    sock = server.socket
    now = trio.current_time()
    assert not keeper.late_with_unread(sock, now - 5, now)  # late, nothing unread
    await client.send_all(b"x")
    await trio.testing.wait_all_tasks_blocked()
    assert not keeper.late_with_unread(sock, now - keeper.tick, now)  # unread, on time
    assert keeper.late_with_unread(sock, now - 5, now)
    assert keeper.stats.stall_graces == 1
    assert keeper.stats.as_dict()["stall_graces"] == 1
    exported = {m.name: m.samples[0].value for m in KeeperCollector(keeper.stats, {}).collect()}
    assert exported["idlekeeper_stall_graces"] == 1


async def test_close_false_leaves_socket_open_for_a_goodbye(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """close=False lets a protocol answer (an HTTP 408, say) before closing itself."""
    server, client = await tcp_pair()
    with keeper.watch(server, idle=2, close=False) as w:
        await w.stream.receive_some()
    assert w.reason is Reason.IDLE
    await w.stream.send_all(b"408 goodbye")
    await w.stream.aclose()
    assert await client.receive_some() == b"408 goodbye"


async def test_serve_tcp_hands_out_watched_streams(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    reasons: list[Reason | None] = []

    async def echo(stream: idlekeeper.WatchedStream) -> None:
        if not stream.watch.active:
            raise AssertionError("not watched")
        async for data in stream:
            if data == b"crash":
                raise RuntimeError("a handler bug must not kill the server")
            await stream.send_all(data)

    def note(w: idlekeeper.Watch) -> None:
        reasons.append(w.reason)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            lambda task_status: idlekeeper.serve_tcp(
                echo, 0, host="127.0.0.1", keeper=keeper, idle=3, on_expire=note, task_status=task_status
            )
        )
        port = listeners[0].socket.getsockname()[1]
        crasher = await trio.open_tcp_stream("127.0.0.1", port)
        await crasher.send_all(b"crash")
        assert await crasher.receive_some() == b""
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"hello")
        assert await client.receive_some() == b"hello"
        t0 = trio.current_time()
        assert await client.receive_some() == b""  # closed by the keeper
        assert 3 <= trio.current_time() - t0 < 3 + keeper.tick
        await keeper.wait_hooks()
        assert reasons == [Reason.IDLE]
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


async def test_ssl_stream_is_watched_and_closed(keeper: idlekeeper.Keeper, clock: MockClock, ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    raw_server, raw_client = await tcp_pair()
    server = trio.SSLStream(raw_server, server_ctx, server_side=True)
    client = trio.SSLStream(raw_client, client_ctx, server_hostname="localhost")

    async def client_side() -> None:
        await client.send_all(b"secret")
        assert await client.receive_some() == b"SECRET"
        # then silence

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client_side)
        with keeper.watch(server, idle=4) as w:
            assert w.socket is raw_server.socket
            data = await w.stream.receive_some()
            await w.stream.send_all(data.upper())
            active_at = trio.current_time()
            await w.stream.receive_some()
        assert w.reason is Reason.IDLE
        assert active_at + 4 <= trio.current_time() < active_at + 4 + keeper.tick
        await w.stream.aclose()  # quiet after the keeper closed the transport
    assert raw_server.socket.fileno() == -1


async def test_serve_tcp_close_false_lets_the_handler_say_goodbye(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    async def handler(conn: idlekeeper.WatchedStream) -> None:
        try:
            await conn.receive_some()
        finally:
            if conn.expired:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await conn.send_all(b"408 too slow\n")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(idlekeeper.serve_tcp, handler, 0, host="127.0.0.1", keeper=keeper, idle=2, close=False)
        )
        client = await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1])
        got = b""
        while chunk := await client.receive_some():
            got += chunk
        assert got == b"408 too slow\n"
        assert 2 <= trio.current_time() < 2 + keeper.tick
        nursery.cancel_scope.cancel()
