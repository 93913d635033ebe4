"""servers.http as an ASGI server, on both engines: streaming both ways, lifespan, apps
that raise or never answer, a client leaving mid-body, 100-continue, a real Starlette
app; and the whole-response path that writes past h11, against h11's own output.

Clients are httpx, curl and raw sockets; the server runs in-process. Timeouts
(grace) run under MockClock."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from loadtest.processes import free_port, start_http, stop
from servers.http import linememo, whole
from servers.http.asgi import ASGIApp
from servers.http.lifespan import LifespanFailed
from servers.http.server import HttpConfig, HttpServer, serve_asgi

from .asgi_apps import Recorder, starlette_app, starlette_events
from .test_http_server import read_all

ROOT = Path(__file__).resolve().parent.parent
ENGINES = pytest.mark.parametrize("engine", ["dense", "streams"])


@asynccontextmanager
async def running(app: ASGIApp, engine: str, **settings: float) -> AsyncIterator[tuple[HttpServer, str]]:
    cfg = HttpConfig(port=0, tick=0.05, engine=engine, **settings)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(partial(serve_asgi, app, cfg))
        yield server, f"http://127.0.0.1:{server.port}"
        await server.shutdown()
        nursery.cancel_scope.cancel()


async def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` on a new connection and read until the server closes it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(request)
    out = await read_all(stream)
    await stream.aclose()
    return out


@ENGINES
async def test_streaming_request_body(engine: str) -> None:
    """A chunked upload reaches the app in pieces as they come, not gathered first."""
    app = Recorder()

    async def upload() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"x" * 50_000
            await trio.sleep(0.02)

    async with running(app, engine) as (_, base), httpx.AsyncClient(base_url=base) as client:
        r = await client.post("/count", content=upload())
        assert r.status_code == 200
        counted = r.json()
        assert counted["bytes"] == 200_000
        assert counted["pieces"] >= 4


@ENGINES
async def test_streaming_response_keeps_the_connection(engine: str) -> None:
    """A response sent in pieces is framed chunked, and the connection carries the next
    request (a streamed response once made the server close it unannounced)."""
    app = Recorder()
    async with running(app, engine) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        reader = h11.Connection(h11.CLIENT)
        for path in ("/stream", "/stream", "/"):
            await stream.send_all(reader.send(h11.Request(method="GET", target=path, headers=[("host", "x")])) or b"")
            reader.send(h11.EndOfMessage())
            body = b""
            while True:
                event = reader.next_event()
                if event is h11.NEED_DATA:
                    reader.receive_data(await stream.receive_some())
                elif isinstance(event, h11.Response):
                    assert event.status_code == 200
                    assert (b"transfer-encoding", b"chunked") in list(event.headers) or path == "/"
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    raise AssertionError(f"unexpected {event!r}")
            assert body == (b"".join(b"piece %d\n" % i for i in range(5)) if path == "/stream" else b"hello\n")
            reader.start_next_cycle()
        await stream.aclose()


@ENGINES
async def test_lifespan_state_and_shutdown_order(engine: str) -> None:
    """Start-up runs before the first request and its state reaches every scope; shutdown
    runs after the server stopped serving."""
    app = Recorder()
    async with running(app, engine) as (server, base):
        assert app.events == ["startup"]
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/state")).text == "from-startup"
        await server.shutdown()
        assert app.events == ["startup", "shutdown"]
        assert app.state_seen == [{"token": "from-startup"}]


async def test_lifespan_startup_failure_is_raised() -> None:
    app = Recorder()
    app.startup_fails = True
    with pytest.RaisesGroup(pytest.RaisesExc(LifespanFailed, match="no database"), flatten_subgroups=True):
        async with running(app, "dense"):
            raise AssertionError("served despite a failed start-up")


@ENGINES
async def test_app_that_raises_gets_500_and_the_server_goes_on(engine: str, caplog: pytest.LogCaptureFixture) -> None:
    app = Recorder()
    caplog.set_level(logging.INFO, logger="servers.http")
    async with running(app, engine) as (_, base), httpx.AsyncClient(base_url=base) as client:
        r = await client.get("/raise")
        assert r.status_code == 500 and r.text == "internal server error\n"
        assert (await client.get("/nothing")).status_code == 500  # returned without answering
        assert (await client.get("/")).text == "hello\n"
        # Raised after the head went out: nothing more can be said but a cut connection.
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get("/raise-late")
        assert (await client.get("/")).text == "hello\n"
    logged = caplog.text
    assert "the app raised on GET /raise" in logged and "the app failed half-way" in logged
    assert "returned without a response to GET /nothing" in logged


@ENGINES
async def test_bad_response_header_cuts_that_connection_only(engine: str, caplog: pytest.LogCaptureFixture) -> None:
    """A header value with CR LF (response splitting) never reaches the wire."""
    app = Recorder()
    caplog.set_level(logging.INFO, logger="servers.http")
    async with running(app, engine) as (server, base):
        out = await exchange(server.port, b"GET /bad-header HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"set-cookie" not in out.lower() and b"never" not in out
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/")).text == "hello\n"
    assert "the app raised on GET /bad-header" in caplog.text


@ENGINES
async def test_client_leaving_mid_body_is_http_disconnect(engine: str) -> None:
    app = Recorder()
    async with running(app, engine) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"POST /wait-disconnect HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"y" * 10)
        await trio.sleep(0.1)
        await stream.aclose()
        with trio.fail_after(5):
            await app.disconnected.wait()
        assert app.events[:2] == ["startup", "http.request"] and app.events[-1] == "http.disconnect"


async def test_app_that_never_answers_is_cancelled_after_grace(clock: MockClock) -> None:
    """The client leaves; the app goes on regardless and is cancelled a grace later.
    (The dense engine reads while the app runs; the streams driver hears of a client
    only when the app reads or writes, and cuts a hung app at shutdown.)"""
    app = Recorder()
    async with running(app, "dense", grace=3.0) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.sleep(1)
        assert server.in_flight == 1
        await stream.aclose()
        left = trio.current_time()
        await app.cancelled.wait()
        assert 3.0 <= trio.current_time() - left <= 3.0 + 0.2
        await trio.sleep(0.1)
        assert server.in_flight == 0


@ENGINES
async def test_shutdown_waits_for_a_hung_app_only_the_grace(engine: str, clock: MockClock) -> None:
    app = Recorder()
    async with running(app, engine, grace=2.0) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.sleep(0.5)
        began = trio.current_time()
        await server.shutdown()
        assert 2.0 <= trio.current_time() - began <= 2.0 + 0.2
        assert app.cancelled.is_set() and app.events == ["startup", "shutdown"]
        await stream.aclose()


@ENGINES
async def test_expect_100_continue_is_answered_when_the_app_reads(engine: str) -> None:
    app = Recorder()
    async with running(app, engine) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"POST /count HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        with trio.fail_after(5):
            interim = await stream.receive_some()
        assert interim.startswith(b"HTTP/1.1 100 ")
        await stream.send_all(b"hello")
        with trio.fail_after(5):
            final = b""
            while b'"bytes": 5' not in final:
                final += await stream.receive_some()
        assert final.startswith(b"HTTP/1.1 200 ")
        await stream.aclose()


@ENGINES
async def test_starlette_app(engine: str) -> None:
    """A real third-party app: routing, lifespan state, JSON, a streamed upload and a
    streamed response, all on one keep-alive connection."""
    starlette_events.clear()
    async with running(starlette_app, engine) as (server, base):
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/")).text == "hello from starlette"
            assert (await client.get("/items/7?q=x")).json() == {"id": 7, "q": "x"}
            assert (await client.post("/upload", content=b"z" * 300_000)).json() == {"bytes": 300_000}
            numbers = await client.get("/numbers")
            assert numbers.text == "".join(f"{i}\n" for i in range(100))
            assert (await client.get("/nope")).status_code == 404
            assert (await client.head("/")).content == b""
        assert server.requests_total == 6
        await server.shutdown()
    assert starlette_events == ["startup", "shutdown"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed (apt install curl)")
def test_cli_serves_a_starlette_app_to_curl() -> None:
    """``python -m servers.http module:app``, as an operator runs it, and curl."""
    port = free_port()
    proc = start_http(port, 1, ["tests.asgi_apps:starlette_app"], cwd=str(ROOT))
    try:
        base = f"http://127.0.0.1:{port}"
        done = subprocess.run(
            ["curl", "-sv", f"{base}/", f"{base}/items/3", "--next", "-sv", "--data-binary", "@-", f"{base}/upload"],
            input=b"q" * 5000,
            capture_output=True,
            timeout=20,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == b'hello from starlette{"id":3,"q":null}{"bytes":5000}'
        assert done.stderr.count(b"Re-using existing connection") == 2
    finally:
        stop(proc)


def test_cli_refuses_an_app_it_cannot_load() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "servers.http", "tests.asgi_apps:missing", "--port", "0"],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=30,
    )
    assert done.returncode == 2
    assert "has no attribute 'missing'" in done.stderr


# -- the whole-response path against h11's own ------------------------------------------

_token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)
_value = st.binary(max_size=30)
_headers = st.lists(st.tuples(_token.map(str.encode), _value), max_size=5)


def _served(request: bytes, status: int, headers: list[tuple[bytes, bytes]], body: bytes, fast: bool) -> bytes:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request)
    conn.next_event()
    conn.next_event()
    out = whole.whole_response(conn, status, b"OK", headers, body, send_body=True) if fast else None
    if out is None:
        length = [] if any(n == b"content-length" for n, _ in headers) else [(b"content-length", b"%d" % len(body))]
        try:
            out = b"".join(
                conn.send(event) or b""
                for event in (
                    h11.Response(status_code=status, headers=[*headers, *length], reason=b"OK"),
                    h11.Data(data=body),
                    h11.EndOfMessage(),
                )
            )
        except h11.LocalProtocolError:
            return b"refused"
    assert conn.our_state is h11.DONE or conn.our_state is h11.MUST_CLOSE
    conn.start_next_cycle() if conn.our_state is h11.DONE else None
    return out


def _parsed(raw: bytes, head_request: bool) -> tuple[object, ...]:
    if raw == b"refused":
        return ("refused",)
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="HEAD" if head_request else "GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(raw)
    events = []
    while (event := client.next_event()) is not h11.NEED_DATA:
        events.append(event)
        if isinstance(event, h11.EndOfMessage):
            break
    response = events[0]
    assert isinstance(response, h11.Response)
    body = b"".join(e.data for e in events if isinstance(e, h11.Data))
    return response.status_code, sorted(response.headers), body, client.their_state


@settings(max_examples=300, deadline=None)
@given(status=st.sampled_from([200, 201, 204, 301, 404, 500]), headers=_headers, body=st.binary(max_size=40))
def test_whole_response_matches_h11(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """Any header list and body: the fast path's bytes parse as h11's own do, and it
    refuses (falls back) on anything h11 would refuse."""
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    fast = _served(request, status, list(headers), body, fast=True)
    slow = _served(request, status, list(headers), body, fast=False)
    assert _parsed(fast, False) == _parsed(slow, False)
    # Written again, its lines now remembered: the same bytes.
    assert _served(request, status, list(headers), body, fast=True) == fast


def test_whole_bytes_line_memo_is_bounded_and_keeps_only_what_does_not_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linememo, "LINES", 4)
    whole._lines.clear()
    for i in range(20):
        headers = [(b"x-n", b"%d" % i), (b"content-length", b"2"), (b"date", b"then")]
        out = whole.whole_bytes(200, b"OK", headers, b"hi", send_body=True, date=b"now")
        assert out is not None and b"x-n: %d\r\n" % i in out and b"date: then\r\n" in out
        assert b"now" not in out and out.count(b"content-length") == 1
        assert len(whole._lines) <= 4
    assert not any(name in (b"content-length", b"date") for name, _ in whole._lines)
    long_value = b"v" * linememo.LINE_BYTES
    assert whole.whole_bytes(200, b"OK", [(b"x-long", long_value)], b"", send_body=True) is not None
    assert (b"x-long", long_value) not in whole._lines
    # A remembered line still needs its pair as it was: other values are checked.
    assert whole.whole_bytes(200, b"OK", [(b"x-n", b"a\r\nb: c")], b"", send_body=True) is None
    assert whole.whole_bytes(200, b"OK", [(b"content-length", b"3")], b"hi", send_body=True) is None
    not_bytes: Any = [(b"x", bytearray(b"v"))]  # ASGI allows it; h11's path converts it
    assert whole.whole_bytes(200, b"OK", not_bytes, b"hi", send_body=True) is None


def test_whole_response_declines_what_h11_must_handle() -> None:
    def conn(request: bytes) -> h11.Connection:
        c = h11.Connection(h11.SERVER)
        c.receive_data(request)
        c.next_event()
        return c

    plain = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    ok = [(b"content-type", b"text/plain")]
    assert whole.whole_response(conn(plain), 200, b"OK", ok, b"hi", send_body=True) is not None
    for request, headers in (
        (b"GET / HTTP/1.0\r\n\r\n", ok),  # HTTP/1.0: h11 closes
        (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", ok),  # the client closes
        (plain, [(b"connection", b"close")]),
        (plain, [(b"transfer-encoding", b"chunked")]),
        (plain, [(b"content-length", b"3")]),  # not the body's length
        (plain, [(b"x", b"a\r\nb: c")]),
        (plain, [(b"X-Upper", b"v")]),  # ASGI names are lowercase; h11 decides
    ):
        assert whole.whole_response(conn(request), 200, b"OK", headers, b"hi", send_body=True) is None, headers
    head = conn(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
    out = whole.whole_response(head, 200, b"OK", ok, b"hello", send_body=False)
    assert out is not None and out.endswith(b"content-length: 5\r\n\r\n") and head.our_state is h11.DONE


# -- a client that pipelines and does not read ------------------------------------------


async def test_pipelining_reader_that_stops_is_held_then_cut() -> None:
    """2,000 pipelined requests, never read: the server stops answering once the kernel
    holds 16 KiB of unread responses (not 2,000 answers into a megabyte send buffer),
    and cuts the connection a send timeout after the client's last acknowledgement.
    A client that pipelines as much and reads gets every answer. Wall clock, ~2 s."""
    app = Recorder()
    async with running(app, "dense", send_timeout=1.0, keep_alive_timeout=30.0) as (server, _):
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            reader.connect(("127.0.0.1", server.port))
        await trio.lowlevel.wait_writable(reader)
        sent = reader.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 2000)
        began = trio.current_time()
        with trio.fail_after(5):
            while server.unread_cut_total == 0:  # noqa: ASYNC110 - a counter, not an event
                await trio.sleep(0.05)
        held = trio.current_time() - began
        assert 1.0 <= held <= 2.5
        assert server.requests_total < 1000 < sent // 27  # answered far fewer than were sent
        reader.close()

        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 2000)
        got = b""
        with trio.fail_after(10):
            while got.count(b"hello\n") < 2000:
                got += await stream.receive_some()
        assert got.count(b"HTTP/1.1 200 OK") == 2000
        await stream.aclose()


async def _responses(stream: trio.SocketStream, buf: bytearray, count: int) -> list[tuple[int, bytes]]:
    """The next ``count`` responses on ``stream`` (pipelined ones too): (status, body)
    each, the body read by its length or its chunks."""

    async def until(sep: bytes) -> bytes:
        while sep not in buf:
            data = await stream.receive_some()
            assert data, "closed before a whole response"
            buf.extend(data)
        part, _, rest = bytes(buf).partition(sep)
        buf[:] = rest
        return part

    async def take(n: int) -> bytes:
        while len(buf) < n:
            buf.extend(await stream.receive_some())
        part = bytes(buf[:n])
        del buf[:n]
        return part

    out = []
    for _ in range(count):
        head = (await until(b"\r\n\r\n")).split(b"\r\n")
        fields = dict(line.lower().split(b": ", 1) for line in head[1:])
        body = b""
        if fields.get(b"transfer-encoding") == b"chunked":
            while size := int(await until(b"\r\n"), 16):
                body += await take(size + 2)
                body = body[:-2]
            await until(b"\r\n")
        else:
            body = await take(int(fields[b"content-length"]))
        out.append((int(head[0].split()[1]), body))
    return out


async def test_plain_requests_are_read_past_h11_and_the_rest_by_it_on_one_connection() -> None:
    """Plain heads skip h11 (servers/http/quickhead.py); a body, a split head, a streamed
    or bodiless response bring h11 in for that exchange, and it leaves at the next
    boundary with nothing buffered. Pipelined, in one send, and one byte at a time."""
    app = Recorder()
    async with running(app, "dense") as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        reader = bytearray()
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await _responses(stream, reader, 1) == [(200, b"hello\n")]
        [conn] = server.connections
        assert conn.h11 is None  # answered without it
        await stream.send_all(
            b"POST /count HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde"  # a body: h11's
            b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"  # quick, then a streamed response needs h11
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        got = await _responses(stream, reader, 3)
        assert got[0] == (200, b'{"pieces": 1, "bytes": 5}')
        assert got[1] == (200, b"".join(b"piece %d\n" % i for i in range(5)))
        assert got[2] == (200, b"hello\n")
        assert conn.h11 is None  # gone again at the boundary
        for byte in b"GET /split HTTP/1.1\r\nHost: x\r\n\r\n":  # trickled: h11 reads it
            await stream.send_all(bytes([byte]))
            await trio.sleep(0.001)
        assert await _responses(stream, reader, 1) == [(200, b"hello\n")]
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert await _responses(stream, reader, 1) == [(200, b"hello\n")]
        assert await stream.receive_some() == b""  # closed, as asked
        await stream.aclose()


async def test_a_plain_request_s_client_half_closing_is_http_disconnect() -> None:
    """The end of input comes while the app has a request h11 never read: h11 is made
    then, told of the request, and the app hears http.disconnect."""
    app = Recorder()
    async with running(app, "dense") as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET /wait-disconnect HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.sleep(0.05)
        [conn] = server.connections
        assert conn.h11 is None and conn.exchange is not None
        await stream.send_eof()
        with trio.fail_after(5):
            await app.disconnected.wait()
        assert app.events[-2:] == ["http.request", "http.disconnect"]
        assert await read_all(stream) == b""  # cut: nothing was answered
        await stream.aclose()
