"""ASGI WebSockets on servers.http, both engines, in-process under MockClock: the
handshake and its refusals, messages both ways, close codes both ways, and every
deadline the keeper holds (pings, a reader that stopped, the closing handshake),
with a trio + wsproto client that can misbehave on purpose."""

from __future__ import annotations

import logging
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
from trio.testing import MockClock
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Request

from servers.http.asgi import Message, Receive, Scope, Send
from servers.http.exchange import ClientDisconnected
from servers.http.server import HttpConfig, HttpServer, serve_asgi

from .test_http_server import read_all
from .ws_client import Refused, WsClient

TICK = 0.05
ENGINES = pytest.mark.parametrize("engine", ["dense", "streams"])


class WsApp:
    """An ASGI app whose path picks a behaviour; it records what it heard."""

    def __init__(self) -> None:
        self.heard: list[Message] = []
        self.send_error: BaseException | None = None
        self.scopes: list[Scope] = []
        self.ended = trio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            return
        self.scopes.append(scope)
        try:
            await getattr(self, scope["path"].strip("/").replace("-", "_"))(scope, receive, send)
        finally:
            self.ended.set()

    async def _accept(self, scope: Scope, receive: Receive, send: Send, **extra: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept", **extra})

    async def echo(self, scope: Scope, receive: Receive, send: Send) -> None:
        offered = scope["subprotocols"]
        await self._accept(
            scope, receive, send, subprotocol=offered[-1] if offered else None, headers=[(b"x-hello", b"there")]
        )
        while True:
            message = await receive()
            self.heard.append(message)
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") == "close please":
                await send({"type": "websocket.close", "code": 4000, "reason": "as asked"})
                continue
            await send({"type": "websocket.send", **{k: message[k] for k in ("text", "bytes") if k in message}})

    async def deny(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "websocket.http.response.start", "status": 401, "headers": [(b"x-why", b"token")]})
        await send({"type": "websocket.http.response.body", "body": b"no ", "more_body": True})
        await send({"type": "websocket.http.response.body", "body": b"entry"})

    async def close_first(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "websocket.close"})

    async def forget(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()

    async def boom(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._accept(scope, receive, send)
        raise RuntimeError("the app broke")

    async def silent(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._accept(scope, receive, send)
        self.heard.append(await receive())

    async def flood(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._accept(scope, receive, send)
        try:
            while True:
                await send({"type": "websocket.send", "bytes": b"x" * 65536})
        except ClientDisconnected as exc:
            self.send_error = exc
        self.heard.append(await receive())

    async def closer(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._accept(scope, receive, send)
        await send({"type": "websocket.close", "code": 4001, "reason": "bye"})
        self.heard.append(await receive())


@asynccontextmanager
async def running(engine: str, **settings: Any) -> AsyncIterator[tuple[HttpServer, WsApp]]:
    app = WsApp()
    cfg = HttpConfig(port=0, tick=TICK, engine=engine, **settings)
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(partial(serve_asgi, app, cfg, lifespan=False))
        yield server, app
        nursery.cancel_scope.cancel()


@ENGINES
async def test_messages_both_ways_with_subprotocol_and_headers(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, app):
        client = await WsClient.open(server.port, "/echo?room=1", subprotocols=["v1", "chat"])
        assert client.accepted is not None and client.accepted.subprotocol == "chat"
        assert (b"x-hello", b"there") in [(k.lower(), v) for k, v in client.accepted.extra_headers]
        await client.send("héllo")
        assert await client.receive() == "héllo"
        await client.send(b"\x00\xff" * 40_000)  # over several reads
        assert await client.receive() == b"\x00\xff" * 40_000
        scope = app.scopes[0]
        assert scope["scheme"] == "ws" and scope["path"] == "/echo" and scope["query_string"] == b"room=1"
        assert scope["subprotocols"] == ["v1", "chat"] and "method" not in scope
        await client.close(4002, "done")
        assert (await client.until_closed()).code == 4002
        await app.ended.wait()
        assert app.heard[-1] == {"type": "websocket.disconnect", "code": 4002, "reason": "done"}


@ENGINES
async def test_the_app_closes_with_its_code(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, app):
        client = await WsClient.open(server.port, "/closer")
        closed = await client.until_closed()
        assert (closed.code, closed.reason) == (4001, "bye")
        await app.ended.wait()
        assert app.heard == [{"type": "websocket.disconnect", "code": 4001, "reason": "bye"}]
        assert await read_all(client.stream) == b""  # the server closes the TCP connection first


@ENGINES
async def test_frames_that_come_with_the_upgrade_request_are_kept(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        client = WsClient(stream, answer_pings=True)
        upgrade = client.ws.send(Request(host="x", target="/echo"))
        early = bytes([0x81, 0x80 | 5]) + b"\x00" * 4 + b"early"  # a text frame, masked with a zero key
        await stream.send_all(upgrade + early)
        while client.accepted is None:
            for event in await client._read():
                if isinstance(event, AcceptConnection):
                    client.accepted = event
                else:
                    client._events.append(event)
        assert await client.receive() == "early"


@ENGINES
async def test_refusals_before_the_accept(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, _app):
        with pytest.raises(Refused) as denied:
            await WsClient.open(server.port, "/deny")
        assert (denied.value.status, denied.value.body) == (401, b"no entry")
        with pytest.raises(Refused) as closed:
            await WsClient.open(server.port, "/close-first")
        assert closed.value.status == 403
        with pytest.raises(Refused) as forgot:
            await WsClient.open(server.port, "/forget")
        assert forgot.value.status == 500


@ENGINES
async def test_bad_upgrade_requests_are_refused_without_the_app(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, app):
        base = b"GET /echo HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        key = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        cases = {
            base + key + b"Sec-WebSocket-Version: 8\r\n\r\n": b"426",
            base + b"Sec-WebSocket-Version: 13\r\n\r\n": b"400",  # no key
            base + b"Sec-WebSocket-Key: short\r\nSec-WebSocket-Version: 13\r\n\r\n": b"400",
            base.replace(b"Upgrade\r\n", b"keep-alive\r\n") + key + b"Sec-WebSocket-Version: 13\r\n\r\n": b"400",
            base.replace(b"GET", b"POST") + key + b"Sec-WebSocket-Version: 13\r\n\r\n": b"400",
        }
        for request, status in cases.items():
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            await stream.send_all(request)
            answer = await read_all(stream)
            assert answer.split(b" ")[1] == status, (request, answer)
            if status == b"426":
                assert b"sec-websocket-version: 13" in answer.lower()
        assert app.scopes == []


@ENGINES
async def test_websockets_off_is_404(engine: str, clock: MockClock) -> None:
    async with running(engine, websockets=False) as (server, _app):
        with pytest.raises(Refused) as refused:
            await WsClient.open(server.port, "/echo")
        assert refused.value.status == 404


@ENGINES
async def test_an_app_that_raises_closes_1011(engine: str, clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    async with running(engine) as (server, _):
        client = await WsClient.open(server.port, "/boom")
        assert (await client.until_closed()).code == 1011
    assert "the app broke" in caplog.text


@ENGINES
async def test_a_peer_that_never_answers_pings_is_closed_1011_in_time(engine: str, clock: MockClock) -> None:
    async with running(engine, ws_ping_interval=5.0, ws_ping_timeout=3.0) as (server, app):
        healthy = await WsClient.open(server.port, "/echo")
        dead = await WsClient.open(server.port, "/silent", answer_pings=False)
        async with trio.open_nursery() as nursery:

            async def keep_reading() -> None:
                with pytest.raises(AssertionError):  # cancelled below, never closed
                    await healthy.receive()

            nursery.start_soon(keep_reading)
            start = trio.current_time()
            closed = await dead.until_closed()
            took = trio.current_time() - start
            await trio.sleep(60)
            nursery.cancel_scope.cancel()
        assert closed.code == 1011 and closed.reason == "keepalive ping timeout"
        assert 5.0 + 3.0 <= took <= 5.0 + 3.0 + TICK + 0.01, took  # never early, at most a tick late
        assert dead.pings >= 1
        await app.ended.wait()
        assert app.heard[-1] == {"type": "websocket.disconnect", "code": 1011, "reason": "keepalive ping timeout"}
        assert healthy.pings >= 12 and healthy.closed is None
        await healthy.send("still here")
        assert await healthy.receive() == "still here"


@ENGINES
async def test_a_client_that_stopped_reading_is_cut_and_the_app_told(
    engine: str, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "servers.http")
    async with running(engine, send_timeout=4.0, ws_ping_interval=None) as (server, app):
        client = await WsClient.open(server.port, "/flood")
        start = trio.current_time()
        await app.ended.wait()
        assert 4.0 <= trio.current_time() - start <= 4.0 + 1.0
        assert isinstance(app.send_error, ClientDisconnected)
        assert app.heard == [{"type": "websocket.disconnect", "code": 1008, "reason": "the client stopped reading"}]
        await client.stream.aclose()
    assert caplog.text.count("websocket client stopped reading") == 1


@ENGINES
async def test_a_close_left_unanswered_is_cut_at_the_close_timeout(engine: str, clock: MockClock) -> None:
    async with running(engine, ws_close_timeout=3.0, ws_ping_interval=None) as (server, _):
        client = await WsClient.open(server.port, "/closer")
        event = await client.event()
        assert isinstance(event, CloseConnection) and event.code == 4001
        start = trio.current_time()
        assert await read_all(client.stream) == b""  # the close is never answered
        assert 3.0 <= trio.current_time() - start <= 3.0 + TICK + 0.01


@ENGINES
async def test_messages_over_max_size_close_1009(engine: str, clock: MockClock) -> None:
    async with running(engine, ws_max_size=1000) as (server, _app):
        whole = await WsClient.open(server.port, "/echo")
        await whole.send("y" * 1000)
        assert await whole.receive() == "y" * 1000
        await whole.send("y" * 1001)
        assert (await whole.until_closed()).code == 1009
        fragmented = await WsClient.open(server.port, "/echo")
        for _ in range(3):
            await fragmented.stream.send_all(fragmented.ws.send(BytesMessage(data=b"z" * 400, message_finished=False)))
        assert (await fragmented.until_closed()).code == 1009


@ENGINES
async def test_a_decompression_bomb_is_refused_1009(engine: str, clock: MockClock) -> None:
    async with running(engine, ws_max_size=100_000) as (server, app):
        client = await WsClient.open(server.port, "/echo", deflate=True)
        extensions = client.accepted.extensions if client.accepted else []
        assert [e.name for e in extensions] == ["permessage-deflate"]
        await client.send("a" * 50_000)  # compressed both ways, within the limit
        assert await client.receive() == "a" * 50_000
        bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
        payload = bomb.compress(b"\x00" * 50_000_000) + bomb.flush(zlib.Z_SYNC_FLUSH)[:-4]
        assert len(payload) < 60_000
        # A binary frame, FIN and RSV1 (compressed), masked with a zero key.
        head = bytes([0xC2, 0x80 | 126]) + len(payload).to_bytes(2, "big") + b"\x00" * 4
        await client.stream.send_all(head + payload)
        assert (await client.until_closed()).code == 1009
        await app.ended.wait()
        assert app.heard[-1]["type"] == "websocket.disconnect" and app.heard[-1]["code"] == 1009


@ENGINES
async def test_invalid_utf8_and_protocol_errors_close_with_wsprotos_codes(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, _):
        text = await WsClient.open(server.port, "/echo")
        await text.stream.send_all(bytes([0x81, 0x82, 0, 0, 0, 0, 0xC3, 0x28]))  # text frame, invalid UTF-8
        assert (await text.until_closed()).code == 1007
        unmasked = await WsClient.open(server.port, "/echo")
        await unmasked.stream.send_all(bytes([0x81, 0x02]) + b"hi")  # a client must mask
        assert (await unmasked.until_closed()).code == 1002


@ENGINES
async def test_graceful_shutdown_says_going_away(engine: str, clock: MockClock) -> None:
    async with running(engine) as (server, app):
        client = await WsClient.open(server.port, "/echo")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.shutdown)
            closed = await client.until_closed()
        assert closed.code == 1001
        await app.ended.wait()
        assert app.heard[-1]["type"] == "websocket.disconnect" and app.heard[-1]["code"] == 1001
