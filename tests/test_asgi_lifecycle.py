"""A request ends with its response, not with the app call (issue 59), on both engines,
in-process under MockClock: FastAPI's and Starlette's background tasks, an app that
waits for ``http.disconnect``, the bounds on work left running, and what the server
says of apps that stop half-way, or raise once the client has left; the server's own
answers dated; the start-up that fails, as uvicorn tells it.

Raw sockets and h11 as the client; times are the mock clock's."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import h11
import pytest
import trio
import trio.testing
from trio.testing import MockClock

from servers.http.asgi import ASGIApp
from servers.http.server import HttpConfig, HttpServer, serve_asgi

from . import asgi_lifecycle_apps as apps
from .test_http_server import read_all

ROOT = Path(__file__).resolve().parent.parent
ENGINES = pytest.mark.parametrize("engine", ["dense", "streams"])


@asynccontextmanager
async def running(app: ASGIApp, engine: str, **settings: float) -> AsyncIterator[HttpServer]:
    cfg = HttpConfig(port=0, tick=0.05, engine=engine, **settings)  # type: ignore[arg-type]
    apps.seen.clear()
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(partial(serve_asgi, app, cfg))
        yield server
        await server.shutdown()
        nursery.cancel_scope.cancel()


class Client:
    """A keep-alive HTTP/1.1 client on one connection (h11 on a trio stream)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> Client:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def get(self, target: str, *headers: tuple[str, str]) -> tuple[int, bytes, float]:
        """The status and body of GET ``target``, and the mock time its end came."""
        request = h11.Request(method="GET", target=target, headers=[("host", "x"), *headers])
        await self.stream.send_all((self.h11.send(request) or b"") + (self.h11.send(h11.EndOfMessage()) or b""))
        status, body = 0, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some())
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                return status, body, trio.current_time()
            else:
                raise AssertionError(f"unexpected {event!r}")


async def until_seen(fact: str) -> float:
    """Wait (on the mock clock) until an app records ``fact``; when it did."""
    for _ in range(100_000):
        if fact in apps.seen:
            return trio.current_time()
        await trio.sleep(0.01)
    raise AssertionError(f"never seen: {fact}")


# ------------------------------------------------------------- the request cycle


@ENGINES
async def test_a_background_task_does_not_hold_the_next_request(engine: str, clock: MockClock) -> None:
    # FastAPI's BackgroundTasks run inside the app call, after the body is sent: the next
    # request on the connection waited behind them (3.03 s; uvicorn 0.02 s).
    async with running(apps.app, engine) as server:
        client = await Client.open(server.port)
        start = trio.current_time()
        status, body, _ = await client.get("/bg?s=3&n=1")
        assert (status, body) == (200, b"queued\n")
        status, body, at = await client.get("/spec")
        assert status == 200 and at - start < 0.1, at - start
        assert "background-done 1" not in apps.seen  # still at work, on its own
        assert server.figures()  # and told: see the figures test below
        done = await until_seen("background-done 1")
        assert 3.0 <= done - start < 3.2
        await client.stream.aclose()


@ENGINES
async def test_a_closing_response_closes_at_once_and_its_background_work_finishes(
    engine: str, clock: MockClock
) -> None:
    # Connection: close (and HTTP/1.0) ended 3.01 s after the response; a client that
    # read its answer and left had the background task cancelled --grace later.
    async with running(apps.app, engine, grace=1.0) as server:
        for request in (
            b"GET /bg?s=3&n=2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"GET /bg-starlette?s=3 HTTP/1.0\r\n\r\n",
        ):
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            start = trio.current_time()
            await stream.send_all(request)
            answer = await read_all(stream)  # to the server's close
            assert answer.endswith(b"queued\n") and trio.current_time() - start < 0.1
            await stream.aclose()
        await until_seen("background-done 2")
        await until_seen("starlette-background-done")  # past the grace: not cancelled
        assert server.in_flight == 0


@ENGINES
async def test_receive_says_disconnect_once_the_response_is_complete(engine: str, clock: MockClock) -> None:
    # ASGI: http.disconnect once the response is complete. An app that waits for it in a
    # task group never returned: two pipelined requests, only the first answered.
    async with running(apps.app, engine) as server:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        request = b"GET /watch HTTP/1.1\r\nHost: x\r\n\r\n"
        await stream.send_all(request * 2)
        got = b""
        with trio.fail_after(1):
            while got.count(b"watched\n") < 2:
                got += await stream.receive_some()
        assert got.count(b"HTTP/1.1 200") == 2
        with trio.fail_after(1):
            while apps.seen.count("watch-heard http.disconnect") < 2:  # noqa: ASYNC110 - an app's note, no event
                await trio.sleep(0.01)
        await stream.aclose()


@ENGINES
async def test_background_calls_are_bounded_and_a_connection_past_it_waits(engine: str, clock: MockClock) -> None:
    # Past --max-background, a connection waits for its app to return before its next
    # request, as every connection did before; counted.
    async with running(apps.app, engine, max_background=1) as server:
        first, second = await Client.open(server.port), await Client.open(server.port)
        start = trio.current_time()
        await first.get("/bg?s=3&n=10")
        await second.get("/bg?s=3&n=11")  # the worker holds one already
        _, _, at = await first.get("/spec")
        assert at - start < 0.1
        _, _, at = await second.get("/spec")
        assert 3.0 <= at - start < 3.2  # waited for its app
        figures = {m.name: m.samples[0].value for m in server.figures()}
        assert figures["http_background_waits"] == 1
        await first.stream.aclose()
        await second.stream.aclose()


@ENGINES
async def test_a_shutdown_gives_background_work_the_grace_then_cancels_it(engine: str, clock: MockClock) -> None:
    async with running(apps.app, engine, grace=2.0) as server:
        client = await Client.open(server.port)
        await client.get("/bg?s=60&n=20")
        await client.get("/spec")  # the connection has moved on, its app at work
        await trio.testing.wait_all_tasks_blocked()  # the /spec app's call has ended too
        figures = {m.name: m.samples[0].value for m in server.figures()}
        assert figures["http_background_app_calls"] == 1 and figures["http_requests_in_flight"] == 1
        start = trio.current_time()
        await server.shutdown()
        assert 2.0 <= trio.current_time() - start < 2.2
        assert "background-done 20" not in apps.seen
        await trio.sleep(0.1)
        assert server.in_flight == 0


# ------------------------------------------------------ what the server says of apps


@ENGINES
async def test_an_app_that_returns_mid_response_is_logged_and_its_connection_cut(
    engine: str, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # It was cut with nothing logged; uvicorn logs it in these words. With nothing of the
    # response out yet, the client is told 500 (uvicorn sent the 200 head at once).
    caplog.set_level(logging.INFO, logger="servers.http")
    async with running(apps.app, engine) as server:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET /partial HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await read_all(stream)
        assert answer.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in answer.lower()
        assert b"partial" in answer and not answer.endswith(b"0\r\n\r\n")  # never completed: cut
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET /started HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await read_all(stream)
        assert answer.startswith(b"HTTP/1.1 500")
    for path in ("/partial", "/started"):
        assert f"ASGI callable returned without completing response to GET {path}" in caplog.text


@ENGINES
async def test_an_exception_after_the_client_left_is_a_line_not_a_traceback(
    engine: str, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="servers.http")
    async with running(apps.app, engine) as server:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET /raise-after-leaving HTTP/1.1\r\nHost: x\r\n\r\n")
        await stream.receive_some()
        await stream.aclose()
        for _ in range(100):
            if "raised after the client left" in caplog.text:
                break
            await trio.sleep(0.1)
    records = [r for r in caplog.records if "raised after the client left" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO and records[0].exc_info is None
    assert "the client disconnected" in records[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@ENGINES
async def test_a_body_timeout_after_the_response_began_cuts_rather_than_answer_408(
    engine: str, clock: MockClock
) -> None:
    # An app that answers as the body comes (the head and part of a chunked body out)
    # while the body stalls: a 408 written then landed inside the 200 (dense engine).
    async def echo(scope: dict[str, object], receive: object, send: object) -> None:
        assert callable(receive) and callable(send)
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            await send({"type": "http.response.body", "body": message.get("body", b""), "more_body": True})
            if not message.get("more_body"):
                await send({"type": "http.response.body", "body": b""})
                return

    async with running(echo, engine, body_timeout=2.0) as server:  # type: ignore[arg-type]
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"a" * 10)
        answer = await read_all(stream)
    assert answer.startswith(b"HTTP/1.1 200") and b"408" not in answer


# ---------------------------------------------------------- the server's own answers


@ENGINES
async def test_the_servers_own_answers_carry_a_date(engine: str) -> None:
    # RFC 9110 §6.6.1: an origin server sends Date with every response it makes.
    async with running(apps.app, engine, max_body_size=10, max_header_size=200) as server:
        for request, status in (
            (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", b"400"),
            (b"POST /bg HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n", b"413"),
            (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 400 + b"\r\n\r\n", b"431"),
            (
                b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Version: 13\r\n\r\n",
                b"400",
            ),
        ):
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            await stream.send_all(request)
            head = (await read_all(stream)).split(b"\r\n\r\n")[0].lower()
            assert head.startswith(b"http/1.1 " + status) and b"\r\ndate: " in head, head


@ENGINES
async def test_spec_versions_say_what_the_server_does(engine: str, clock: MockClock) -> None:
    # 2.3 for HTTP, as uvicorn: told 2.4, Starlette's streaming responses stop listening
    # for http.disconnect, and an idle event stream outlives its client.
    async with running(apps.app, engine) as server:
        client = await Client.open(server.port)
        assert (await client.get("/spec"))[1] == b"2.3"
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        start = trio.current_time()
        await stream.send_all(b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"data: first" in await stream.receive_some()
        await stream.aclose()
        ended = await until_seen("sse-ended")
        assert ended - start < 0.5  # heard the client leave; not the grace later
        await client.stream.aclose()


def test_a_failed_start_up_is_told_as_uvicorn_tells_it_and_exits_3(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "servers.http", "tests.asgi_lifecycle_apps:failing_startup", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(lines) == 2, proc.stderr
    assert lines[0].endswith("no database at db:5432") and lines[1].endswith("Application startup failed. Exiting.")
    assert "Traceback" not in proc.stderr
