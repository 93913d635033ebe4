"""A trivial ASGI app for the HTTP peers (hypercorn, uvicorn) in ``python -m loadtest compare``.

It answers every request as ``servers.http``'s built-in app answers ``/``: 200 and
``hello from idlekeeper\\n`` as text/plain, so all three servers send the same bytes.
It also completes the lifespan protocol: hypercorn's trio worker crashes at start-up
on an app that returns at once on ``lifespan``.

A WebSocket at any path is accepted (with the first subprotocol offered) and echoes
every message, text as text and bytes as bytes, until the client leaves; ``/flood``
instead sends 64 KiB messages until the client is gone (a peer that stops reading).
"""

from __future__ import annotations

# servers.http.asgi needs neither trio nor h11: a peer's process loads only it and
# servers.http.app of ours, not our server.
from servers.http.asgi import Receive, Scope, Send, complete_lifespan

__all__ = ["app"]

BODY = b"hello from idlekeeper\n"


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Hello world, and lifespan."""
    if scope["type"] == "lifespan":
        await complete_lifespan(receive, send)
        return
    if scope["type"] == "websocket":
        await websocket(scope, receive, send)
        return
    if scope["type"] != "http":
        return
    while True:  # drain the request body (there is none for GET, but be correct)
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            break
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(BODY)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": BODY})


async def websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """Echo (or, at ``/flood``, send until the client is gone)."""
    if (await receive())["type"] != "websocket.connect":
        return
    offered = scope.get("subprotocols") or []
    await send({"type": "websocket.accept", "subprotocol": offered[0] if offered else None})
    if scope["path"] == "/flood":
        chunk = b"x" * 65536
        try:
            while True:
                await send({"type": "websocket.send", "bytes": chunk})
        except OSError:  # ASGI: send() raises an OSError once the client is gone
            return
    while True:
        message = await receive()
        if message["type"] != "websocket.receive":
            return
        text = message.get("text")
        if text is not None:
            await send({"type": "websocket.send", "text": text})
        else:
            await send({"type": "websocket.send", "bytes": message.get("bytes") or b""})
