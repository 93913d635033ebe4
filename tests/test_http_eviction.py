"""``HttpConfig.evict_at_cap``: at the connection cap a new connection takes the place
of the oldest one (one not with the app if there is one) instead of a 503; both
drivers, real sockets, under MockClock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
from trio.testing import MockClock

from servers.http.app import Request, Response
from servers.http.server import HttpConfig, HttpServer, serve_http

GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
WAIT = b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n"


class Gate:
    """An app whose /wait requests stay with it until :attr:`open` is set."""

    def __init__(self) -> None:
        self.open = trio.Event()
        self.waiting = 0

    async def __call__(self, request: Request) -> Response:
        if request.path == "/wait":
            self.waiting += 1
            await self.open.wait()
        return Response(200, [("content-type", "text/plain")], b"ok\n")


@asynccontextmanager
async def running(engine: str, app: Gate) -> AsyncIterator[tuple[HttpServer, int]]:
    cfg = HttpConfig(port=0, tick=0.1, engine=engine, max_connections=3, evict_at_cap=True, grace=1.0)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_http, app, cfg))
        yield server, server.port
        nursery.cancel_scope.cancel()


async def connect(server: HttpServer, port: int, raw: bytes = b"") -> trio.SocketStream:
    """A connection the server has counted (the drivers count at accept)."""
    before = len(server.connections) + server.evicted_total
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    if raw:
        await stream.send_all(raw)
    await wait_for(lambda: len(server.connections) + server.evicted_total != before)
    return stream


async def closed(stream: trio.SocketStream) -> bool:
    """Whether the server closed ``stream`` (it sent nothing before)."""
    with trio.move_on_after(1):
        try:
            return await stream.receive_some() == b""
        except trio.BrokenResourceError:
            return True
    return False


async def wait_for(predicate: object) -> None:
    with trio.fail_after(5):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 - server counters, not events
            await trio.sleep(0.001)


@pytest.mark.parametrize("engine", ["dense", "streams"])
async def test_the_oldest_idle_connection_gives_way_not_one_with_the_app(clock: MockClock, engine: str) -> None:
    app = Gate()
    async with running(engine, app) as (server, port):
        busy = await connect(server, port, WAIT)
        await wait_for(lambda: app.waiting == 1)
        oldest_idle = await connect(server, port)
        idle = await connect(server, port)
        newcomer = await connect(server, port, GET)
        assert (await newcomer.receive_some()).startswith(b"HTTP/1.1 200")
        assert await closed(oldest_idle)
        assert not await closed(idle)
        assert server.evicted_total == 1 and server.refused_total == 0
        assert len(server.connections) == 3
        app.open.set()  # the request in flight was left alone
        assert (await busy.receive_some()).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("engine", ["dense", "streams"])
async def test_with_every_slot_busy_the_oldest_gives_way(clock: MockClock, engine: str) -> None:
    app = Gate()
    async with running(engine, app) as (server, port):
        busy = [await connect(server, port, WAIT) for _ in range(3)]
        await wait_for(lambda: app.waiting == 3)
        newcomer = await connect(server, port, GET)
        assert (await newcomer.receive_some()).startswith(b"HTTP/1.1 200")
        assert await closed(busy[0])
        # The app of the connection that gave way is cancelled after the grace; the others answer.
        await wait_for(lambda: server.in_flight == 2)
        app.open.set()
        for stream in busy[1:]:
            assert (await stream.receive_some()).startswith(b"HTTP/1.1 200")
        assert server.evicted_total == 1 and server.refused_total == 0
