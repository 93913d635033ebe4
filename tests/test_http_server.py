"""The HTTP server in-process under MockClock, with raw-socket clients: timeouts, limits, shutdown."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from idlekeeper import Reason
from servers.http.app import Request, Response
from servers.http.builtin import builtin_app
from servers.http.server import HttpConfig, HttpServer, serve_http

TICK = 0.1
GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


@asynccontextmanager
async def running(config: HttpConfig | None = None, app: object = None) -> AsyncIterator[tuple[HttpServer, int]]:
    cfg = config or HttpConfig()
    cfg.port = 0
    cfg.tick = TICK
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_http, app or builtin_app(), cfg))  # type: ignore[arg-type]
        yield server, server.port
        nursery.cancel_scope.cancel()


async def read_all(stream: trio.SocketStream) -> bytes:
    out = b""
    try:
        while chunk := await stream.receive_some():
            out += chunk
    except trio.BrokenResourceError:
        pass
    return out


async def read_response(stream: trio.SocketStream, buf: bytearray) -> bytes:
    """One response with a Content-Length body."""
    while b"\r\n\r\n" not in buf:
        buf += await stream.receive_some()
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        rest += await stream.receive_some()
    del buf[: len(head) + 4 + length]
    return head + b"\r\n\r\n" + rest[:length]


async def test_keep_alive_and_pipelining(clock: MockClock) -> None:
    async with running() as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        buf = bytearray()
        await client.send_all(GET)
        first = await read_response(client, buf)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"hello from idlekeeper\n")
        await client.send_all(GET + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello" + GET)
        responses = [await read_response(client, buf) for _ in range(3)]
        assert [r.split(b" ", 2)[1] for r in responses] == [b"200"] * 3
        assert responses[1].endswith(b"hello")


async def test_idle_connection_closed_silently_at_keep_alive_timeout(clock: MockClock) -> None:
    async with running(HttpConfig(keep_alive_timeout=15)) as (_, port):
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()
        assert await read_all(silent) == b""  # never sent a byte: closed, no response
        assert 15 <= trio.current_time() - start < 15 + TICK
        reused = await trio.open_tcp_stream("127.0.0.1", port)
        await reused.send_all(GET)
        buf = bytearray()
        await read_response(reused, buf)
        start = trio.current_time()
        assert await read_all(reused) == b""  # idle between requests: the same timeout
        assert 15 <= trio.current_time() - start < 15 + TICK


async def test_slowloris_gets_408_at_the_header_deadline(clock: MockClock) -> None:
    async with running(HttpConfig(header_timeout=10, keep_alive_timeout=60)) as (_, port):
        healthy = await trio.open_tcp_stream("127.0.0.1", port)
        loris = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()
        got = b""

        async def trickle() -> None:
            try:
                for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                    await loris.send_all(bytes([byte]))
                    await trio.sleep(1)  # a byte a second keeps any idle timer fresh
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            got = await read_all(loris)
            closed_at = trio.current_time() - start
            buf = bytearray()
            await healthy.send_all(GET)
            assert (await read_response(healthy, buf)).startswith(b"HTTP/1.1 200")
            nursery.cancel_scope.cancel()
        assert got.startswith(b"HTTP/1.1 408")
        assert 10 <= closed_at < 10 + TICK


async def test_slow_body_gets_408(clock: MockClock) -> None:
    async with running(HttpConfig(body_timeout=5)) as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        sent = trio.current_time()
        got = await read_all(client)
        assert got.startswith(b"HTTP/1.1 408")
        assert 5 <= trio.current_time() - sent < 5 + TICK


async def test_slow_reader_closed_at_send_timeout(clock: MockClock) -> None:
    async with running(HttpConfig(send_timeout=5)) as (server, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"GET /download?size=1000000000 HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.sleep(30)  # never reads
        assert not server.connections  # cut, with only its kernel buffers ever filled
        assert server.keeper.stats.expired[Reason.SEND] == 1


async def test_limits_and_malformed_input(clock: MockClock) -> None:
    cfg = HttpConfig(max_header_size=4096, max_body_size=1000)
    async with running(cfg) as (_, port):
        healthy = await trio.open_tcp_stream("127.0.0.1", port)
        healthy_buf = bytearray()

        async def still_fine() -> None:
            await healthy.send_all(GET)
            assert (await read_response(healthy, healthy_buf)).startswith(b"HTTP/1.1 200")

        async def exchange(raw: bytes) -> bytes:
            await still_fine()
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(raw)
            return await read_all(stream)

        assert (await exchange(b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 8000 + b"\r\n\r\n")).startswith(
            b"HTTP/1.1 431"
        )
        assert (await exchange(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")).startswith(
            b"HTTP/1.1 413"
        )
        chunked = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"y" * 1024
        assert (await exchange(chunked + b"\r\n0\r\n\r\n")).startswith(b"HTTP/1.1 413")
        assert (await exchange(b"NONSENSE\r\n\r\n")).startswith(b"HTTP/1.1 400")
        assert (await exchange(b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 400")  # no Host
        await still_fine()


async def test_connection_cap_answers_503(clock: MockClock) -> None:
    async with running(HttpConfig(max_connections=1)) as (_, port):
        first = await trio.open_tcp_stream("127.0.0.1", port)
        await first.send_all(GET)
        await read_response(first, bytearray())
        second = await trio.open_tcp_stream("127.0.0.1", port)
        assert (await read_all(second)).startswith(b"HTTP/1.1 503")


async def test_max_requests_and_age_end_politely(clock: MockClock) -> None:
    async with running(HttpConfig(max_requests=2)) as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        buf = bytearray()
        await client.send_all(GET)
        assert b"connection: close" not in (await read_response(client, buf)).lower()
        await client.send_all(GET)
        assert b"connection: close" in (await read_response(client, buf)).lower()
        assert await read_all(client) == b""
    async with running(HttpConfig(max_connection_age=30, keep_alive_timeout=100)) as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        buf = bytearray()
        await client.send_all(GET)
        assert b"connection: close" not in (await read_response(client, buf)).lower()
        await trio.sleep(31)
        await client.send_all(GET)
        assert b"connection: close" in (await read_response(client, buf)).lower()


async def test_app_errors_are_500_and_the_server_lives(clock: MockClock) -> None:
    async def app(request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("app bug")
        return Response(200, [], b"fine")

    async with running(app=app) as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        buf = bytearray()
        await client.send_all(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(client, buf)).startswith(b"HTTP/1.1 500")
        await client.send_all(GET)
        assert (await read_response(client, buf)).endswith(b"fine")


async def test_graceful_shutdown_finishes_the_request_in_flight(clock: MockClock) -> None:
    async def slow(request: Request) -> Response:
        await trio.sleep(3)
        return Response(200, [], b"done")

    cfg = HttpConfig(grace=10, port=0, tick=TICK)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_http, slow, cfg))
        idle = await trio.open_tcp_stream("127.0.0.1", server.port)
        busy = await trio.open_tcp_stream("127.0.0.1", server.port)
        await busy.send_all(GET)
        await trio.sleep(1)
        started = trio.current_time()
        await server.shutdown()
        assert trio.current_time() - started < 3  # waited for the request, not the grace
        response = await read_all(busy)
        assert response.startswith(b"HTTP/1.1 200") and b"connection: close" in response.lower()
        assert response.endswith(b"done")
        assert await read_all(idle) == b""
        try:
            late = await trio.open_tcp_stream("127.0.0.1", server.port)
            assert await read_all(late) == b""
        except OSError:
            pass  # refused outright: not accepting any more
        nursery.cancel_scope.cancel()


async def test_a_reader_that_stops_costs_no_memory(clock: MockClock) -> None:
    """A gigabyte download to a client that never reads: the server holds one piece."""
    import gc
    import tracemalloc

    tracemalloc.start()
    try:
        async with running(HttpConfig(send_timeout=5)) as (server, port):
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(b"GET /download?size=1000000000 HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(2)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
            assert server.connections  # still trying to send
            await trio.sleep(10)
            assert not server.connections
    finally:
        tracemalloc.stop()
    assert grown < 2 * 1024 * 1024


@settings(max_examples=60, deadline=None)
@given(junk=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=5))
def test_fuzz_any_bytes_never_crash_the_server(junk: list[bytes]) -> None:
    async def main() -> None:
        async with running(HttpConfig(header_timeout=2, body_timeout=2, keep_alive_timeout=2)) as (_, port):
            bad = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                for piece in junk:
                    await bad.send_all(piece)
            except trio.BrokenResourceError:
                pass
            reply = await read_all(bad)
            assert reply == b"" or reply.startswith(b"HTTP/1.1 ")
            healthy = await trio.open_tcp_stream("127.0.0.1", port)
            await healthy.send_all(GET)
            assert (await read_response(healthy, bytearray())).startswith(b"HTTP/1.1 200")

    trio.run(main, clock=MockClock(autojump_threshold=0))
