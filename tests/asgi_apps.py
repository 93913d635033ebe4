"""ASGI apps for servers.http's conformance tests: hand-written ones that each do one
thing the spec allows (or an app gets wrong), and a small Starlette app."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from servers.http.asgi import Message, Receive, Scope, Send

Events = list[str]


class Recorder:
    """An ASGI app whose behaviour is picked by the path, recording what it saw."""

    def __init__(self) -> None:
        self.events: Events = []
        self.state_seen: list[Any] = []
        self.disconnected = trio.Event()
        self.cancelled = trio.Event()
        self.startup_fails = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        path = scope["path"]
        if path == "/count":  # the request body as it came: pieces and bytes
            pieces, size = 0, 0
            while True:
                message = await receive()
                assert message["type"] == "http.request", message
                pieces += bool(message.get("body"))
                size += len(message.get("body", b""))
                if not message.get("more_body"):
                    break
            await _answer(send, 200, json.dumps({"pieces": pieces, "bytes": size}).encode())
        elif path == "/stream":  # a response in five pieces, length unknown to the server
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for i in range(5):
                await send({"type": "http.response.body", "body": b"piece %d\n" % i, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/state":
            self.state_seen.append(dict(scope.get("state", {})))
            await _answer(send, 200, str(scope.get("state", {}).get("token")).encode())
        elif path == "/raise":
            raise RuntimeError("the app failed")
        elif path == "/raise-late":  # after the head went out
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("the app failed half-way")
        elif path == "/nothing":
            return  # no response at all
        elif path == "/hang":  # never answers; told of the client leaving, ignores it
            try:
                await trio.sleep_forever()
            finally:
                self.cancelled.set()
        elif path == "/wait-disconnect":  # reads the body until the client goes
            while True:
                message = await receive()
                self.events.append(message["type"])
                if message["type"] == "http.disconnect":
                    self.disconnected.set()
                    return
        elif path == "/bad-header":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-evil", b"a\r\nset-cookie: x")]})
            await send({"type": "http.response.body", "body": b"never"})
        else:
            await _answer(send, 200, b"hello\n")

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.events.append("startup")
                if self.startup_fails:
                    await send({"type": "lifespan.startup.failed", "message": "no database"})
                    return
                scope["state"]["token"] = "from-startup"
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.events.append("shutdown")
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _answer(send: Send, status: int, body: bytes) -> None:
    start: Message = {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]}
    await send(start)
    await send({"type": "http.response.body", "body": body})


# -- a real third-party app -------------------------------------------------------------

starlette_events: Events = []


@asynccontextmanager
async def _starlette_lifespan(app: Starlette) -> AsyncIterator[MutableMapping[str, Any]]:
    starlette_events.append("startup")
    yield {"greeting": "hello from starlette"}
    starlette_events.append("shutdown")


async def _home(request: Request) -> PlainTextResponse:
    return PlainTextResponse(request.state.greeting)


async def _items(request: Request) -> JSONResponse:
    return JSONResponse({"id": int(request.path_params["item"]), "q": request.query_params.get("q")})


async def _upload(request: Request) -> JSONResponse:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
    return JSONResponse({"bytes": size})


async def _numbers(request: Request) -> StreamingResponse:
    async def numbers() -> AsyncIterator[bytes]:
        for i in range(100):
            yield b"%d\n" % i

    return StreamingResponse(numbers(), media_type="text/plain")


async def _ws_echo(websocket: WebSocket) -> None:
    offered = websocket.scope["subprotocols"]
    await websocket.accept(subprotocol="chat" if "chat" in offered else None)
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                starlette_events.append(f"ws-disconnect {message.get('code')}")
                return
            if message.get("text") == "greeting":
                await websocket.send_text(websocket.state.greeting)
            elif message.get("text") is not None:
                await websocket.send_text(message["text"])
            else:
                await websocket.send_bytes(message["bytes"])
    except WebSocketDisconnect as exc:  # pragma: no cover - receive() above returns it
        starlette_events.append(f"ws-disconnect {exc.code}")


async def _ws_private(websocket: WebSocket) -> None:
    if websocket.query_params.get("token") != "let-me-in":
        await websocket.send_denial_response(PlainTextResponse("a token, please", status_code=401))
        return
    await websocket.accept()
    await websocket.send_text("welcome")
    await websocket.close(code=4000, reason="that is all")


starlette_app = Starlette(
    routes=[
        Route("/", _home),
        Route("/items/{item}", _items),
        Route("/upload", _upload, methods=["POST"]),
        Route("/numbers", _numbers),
        WebSocketRoute("/ws/echo", _ws_echo),
        WebSocketRoute("/ws/private", _ws_private),
    ],
    lifespan=_starlette_lifespan,
)
