"""ASGI 3 for the HTTP server: the types, loading ``module:app``, and the native
interface as an ASGI app.

The server speaks ASGI to every app: an app written for ``servers.http``'s own
``Request -> Response`` interface (:mod:`.app`) is wrapped by :func:`native_asgi`, so
there is one request cycle (:mod:`.exchange`) and one place where timeouts are kept.
Nothing here does I/O or needs trio: an app served by another server (the load
tester's, under uvicorn) may import it. The lifespan runner is :mod:`.lifespan`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from .app import App, Request, Response

__all__ = [
    "ASGI_VERSION",
    "WEBSOCKET_ASGI_VERSION",
    "ASGIApp",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "complete_lifespan",
    "load_app",
    "native_asgi",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
"""``async def app(scope, receive, send)``: an ASGI 3 application."""

ASGI_VERSION = {"version": "3.0", "spec_version": "2.3"}
"""What the server does of ASGI's HTTP spec: 2.3 (``http.disconnect`` from ``receive()``
once the client has gone or the response is complete), as uvicorn says. It also raises
an ``OSError`` from ``send()`` once the client has gone, which 2.4 asks; but an app told
2.4 may stop listening for ``http.disconnect`` (Starlette's streaming responses do), and
then an idle stream runs on after its client left until its next write."""
WEBSOCKET_ASGI_VERSION = {"version": "3.0", "spec_version": "2.4"}
"""ASGI's WebSocket spec as the server speaks it: 2.4, as uvicorn says (close reasons,
and ``websocket.send`` raising once the peer has gone)."""


def load_app(spec: str) -> ASGIApp:
    """The ASGI app named ``module:attribute`` (the attribute may be dotted), as
    uvicorn and hypercorn name it. Raises ``ValueError`` with a readable reason."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"an app is named module:attribute, not {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m uvicorn` does: the working directory's modules
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attribute!r}") from None
    if not callable(found):
        raise ValueError(f"{spec!r} is not callable")
    app: ASGIApp = found
    return app


def native_asgi(app: App, max_body_size: int | None = None) -> ASGIApp:
    """An app of the native interface (``async def app(request) -> Response``) as an
    ASGI app. The request body is read through ``receive()`` as the app asks for it,
    so the server's body timeout and size limit apply as to any ASGI app.
    """

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await complete_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["raw_path"].decode("latin-1")
        query = scope["query_string"]
        target = path + ("?" + query.decode("latin-1") if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # http.disconnect: the body ends where the client did
                body = message.get("body", b"")
                if body:
                    yield body
                if not message.get("more_body", False):
                    return

        request = Request(scope["method"], target, headers, scope["http_version"], chunks)
        response: Response = await app(request)
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers],
            }
        )
        body = response.body
        if isinstance(body, bytes | bytearray):
            await send({"type": "http.response.body", "body": bytes(body)})
            return
        try:
            async for chunk in body:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            # A client gone mid-stream ends the body here, not whenever it is collected:
            # an app counting its open streams (the operator's page) sees it at once.
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()

    asgi.__qualname__ = f"native_asgi({getattr(app, '__qualname__', app)!s})"
    return asgi


async def complete_lifespan(receive: Receive, send: Send) -> None:
    """The lifespan protocol of an app with no start-up or shutdown of its own: each
    step is reported complete at once, until the shutdown."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
