"""The dense HTTP driver's runners: one task takes a pass's exchanges in turn, and an
app that waits holds no other connection's request (``servers/http/dense_server.py``)."""

from __future__ import annotations

import contextvars
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.lowlevel
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from servers.http.server import HttpConfig, HttpServer, serve_asgi

from .asgi_apps import starlette_app
from .test_http_server import GET, read_response

_seen: contextvars.ContextVar[str] = contextvars.ContextVar("_seen", default="unset")


@asynccontextmanager
async def running(app: Any) -> AsyncIterator[tuple[HttpServer, int]]:
    cfg = HttpConfig(port=0, tick=0.1, engine="dense")
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_asgi, app, cfg))
        yield server, server.port
        nursery.cancel_scope.cancel()


@pytest.fixture
def opened() -> Iterator[list[socket.socket]]:
    """The test's client sockets, closed after it."""
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


async def clients(
    server: HttpServer, port: int, n: int, opened: list[socket.socket]
) -> tuple[list[socket.socket], list[trio.SocketStream]]:
    """``n`` connections, every one accepted by the server before it returns: each as
    a plain socket, to write with, and as a trio stream over it, to read with. Each
    socket is added to ``opened``, for the caller to close."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    opened += socks
    with trio.fail_after(5):
        while len(server.connections) < n:  # noqa: ASYNC110  (nothing to wait on for an accept)
            await trio.sleep(0.01)
    return socks, [trio.SocketStream(trio.socket.from_stdlib_socket(s)) for s in socks]


def send_at_once(socks: list[socket.socket], data: bytes = GET) -> None:
    """Every request written before the server can run, so one of its passes reads them all."""
    for sock in socks:
        assert sock.send(data) == len(data)


async def response_bodies(stream: trio.SocketStream, n: int) -> list[bytes]:
    """The bodies of the next ``n`` responses (200, with a Content-Length), and nothing after them."""
    buf, bodies = bytearray(), list[bytes]()
    for _ in range(n):
        head, _, body = (await read_response(stream, buf)).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        bodies.append(body)
    assert buf == b"", "more than was asked for"
    return bodies


async def response_body(stream: trio.SocketStream) -> bytes:
    """The body of the next response."""
    return (await response_bodies(stream, 1))[0]


async def chunked_body(stream: trio.SocketStream) -> bytes:
    """The body of the next response, sent chunked (a streamed response)."""
    buf = b""
    while not buf.endswith(b"\r\n0\r\n\r\n"):
        buf += await stream.receive_some()
    head, _, rest = buf.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            return body
        body, rest = body + rest[: int(size, 16)], rest[int(size, 16) + 2 :]


async def answer(send: Any, body: bytes) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
    )
    await send({"type": "http.response.body", "body": body})


async def test_one_task_takes_a_pass_s_exchanges_in_turn(clock: MockClock, opened: list[socket.socket]) -> None:
    tasks: list[trio.lowlevel.Task] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            tasks.append(trio.lowlevel.current_task())
            await answer(send, b"ok")

    async with running(app) as (server, port):
        socks, streams = await clients(server, port, 100, opened)
        send_at_once(socks)
        with trio.fail_after(5):
            assert [await response_body(s) for s in streams] == [b"ok"] * 100
    # A task each would be a hundred tasks; the turns of 64 are one task's.
    assert len(tasks) == 100
    assert len(set(tasks)) == 1


@pytest.mark.parametrize("waiter", [1, 3])
async def test_an_app_that_waits_holds_no_other_connection_s_request(
    clock: MockClock, opened: list[socket.socket], waiter: int
) -> None:
    """The ``waiter``-th exchange of the pass waits on an event: the ones queued behind it
    are answered meanwhile, by another runner, and it is answered once the event is set."""
    release = trio.Event()
    started = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal started
        if scope["type"] != "http":
            return
        started += 1
        if started == waiter:
            await release.wait()
            await answer(send, b"waited")
        else:
            await answer(send, b"ok")

    async with running(app) as (server, port):
        socks, streams = await clients(server, port, 6, opened)
        answered: list[bytes] = []
        all_but_one = trio.Event()

        async def read(stream: trio.SocketStream) -> None:
            answered.append(await response_body(stream))
            if len(answered) == 5:
                all_but_one.set()

        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(read, stream)
            send_at_once(socks)
            with trio.fail_after(5):
                await all_but_one.wait()
            assert sorted(answered) == [b"ok"] * 5
            assert not release.is_set()
            release.set()
        assert sorted(answered) == [b"ok"] * 5 + [b"waited"]


async def test_exchanges_taken_in_turn_each_start_in_a_fresh_context(
    clock: MockClock, opened: list[socket.socket]
) -> None:
    """An app's context variables do not reach the next request, whichever runner takes it."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            before = _seen.get()
            _seen.set(scope["path"])
            await answer(send, before.encode())

    async with running(app) as (server, port):
        socks, streams = await clients(server, port, 10, opened)
        for _ in range(3):  # the runner parked after the first round takes the next
            send_at_once(socks)
            with trio.fail_after(5):
                assert [await response_body(s) for s in streams] == [b"unset"] * 10
        for _ in range(3):  # one at a time: each awaited plainly, in the step's context
            send_at_once(socks[:1])
            with trio.fail_after(5):
                assert await response_body(streams[0]) == b"unset"
        # Pipelined: the second starts as the first ends, in its runner's step, and
        # wakes a runner from there: a new one, as the server's only runner is that step's.
        socks[1].send(GET * 2)
        with trio.fail_after(5):
            assert await response_bodies(streams[1], 2) == [b"unset"] * 2


async def test_a_request_after_a_lone_waiting_one_is_answered(clock: MockClock, opened: list[socket.socket]) -> None:
    """A pass that starts a single exchange hands it over plainly: if its app waits, the
    next pass's request goes to another runner."""
    release = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if scope["path"] == "/wait":
                await release.wait()
            await answer(send, scope["path"].encode())

    async with running(app) as (server, port):
        socks, streams = await clients(server, port, 2, opened)
        async with trio.open_nursery() as nursery:
            waited: list[bytes] = []

            async def wait() -> None:
                waited.append(await response_body(streams[0]))

            nursery.start_soon(wait)
            send_at_once(socks[:1], b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(1)
            send_at_once(socks[1:])
            with trio.fail_after(5):
                assert await response_body(streams[1]) == b"/"
            assert waited == []
            release.set()
        assert waited == [b"/wait"]


async def test_a_starlette_app_s_requests_taken_in_turn(clock: MockClock, opened: list[socket.socket]) -> None:
    """A real third-party app on anyio: routing, lifespan state, JSON, and a streamed
    response (which runs a task group in the exchange's task and waits in it), thirty
    requests that one pass reads, each answered as on its own."""
    async with running(starlette_app) as (server, port):
        socks, streams = await clients(server, port, 30, opened)
        paths = [b"/", b"/items/7", b"/numbers"] * 10
        for sock, path in zip(socks, paths, strict=True):
            sock.send(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(5):
            for stream, path in zip(streams, paths, strict=True):
                if path == b"/numbers":
                    assert await chunked_body(stream) == b"".join(b"%d\n" % i for i in range(100))
                else:
                    assert (
                        await response_body(stream)
                        == {
                            b"/": b"hello from starlette",
                            b"/items/7": b'{"id":7,"q":null}',
                        }[path]
                    )


# What an app does with a request, by its path: answer at once, wait (virtual time),
# yield to trio without waiting, or raise (answered 500).
_KINDS = ("now", "wait", "yield", "raise")


async def _mixed_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    kind, _, n = scope["path"][1:].partition("/")
    if kind == "wait":
        await trio.sleep(int(n) / 100)
    elif kind == "yield":
        await trio.lowlevel.checkpoint()
    elif kind == "raise":
        raise RuntimeError("on purpose")
    await answer(send, scope["path"].encode())


# No shrinking: a failing example here waits out its deadline in each of the hundreds
# of runs a shrink makes (minutes); the first one found is reported as it is.
@settings(max_examples=40, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(
    plans=st.lists(
        st.lists(st.tuples(st.sampled_from(_KINDS), st.integers(0, 30)), min_size=1, max_size=4),
        min_size=1,
        max_size=12,
    ),
    pipelined=st.booleans(),
)
def test_every_request_of_a_mixed_load_answered_once_in_order(
    plans: list[list[tuple[str, int]]], pipelined: bool
) -> None:
    """Connections each with a few requests whose apps answer at once, wait, yield or
    raise, sent at once (pipelined, or each after the last answer): every request is
    answered once, in its connection's order, each as its own app said."""

    opened: list[socket.socket] = []

    async def main() -> None:
        async with running(_mixed_app) as (server, port):
            socks, streams = await clients(server, port, len(plans), opened)
            answers: list[list[bytes]] = [[] for _ in plans]

            async def client(i: int) -> None:
                paths = [f"/{kind}/{n}".encode() for kind, n in plans[i]]
                heads = [b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n" for path in paths]
                buf = bytearray()
                for k, head in enumerate(heads):
                    if not pipelined:
                        socks[i].send(head)
                    elif k == 0:
                        socks[i].send(b"".join(heads))
                    status_line, _, body = (await read_response(streams[i], buf)).partition(b"\r\n")
                    answers[i].append(status_line.split(b" ", 2)[1] + b" " + body.partition(b"\r\n\r\n")[2])
                assert buf == b"", "an answer more than was asked for"

            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    for i in range(len(plans)):
                        nursery.start_soon(client, i)
            expected = [
                [
                    b"500 internal server error\n" if kind == "raise" else b"200 /" + f"{kind}/{n}".encode()
                    for kind, n in plan
                ]
                for plan in plans
            ]
            assert answers == expected

    try:
        trio.run(main, clock=MockClock(autojump_threshold=0))
    finally:
        for sock in opened:
            sock.close()
