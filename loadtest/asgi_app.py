"""A trivial ASGI app for the HTTP peers (hypercorn, uvicorn) in ``python -m loadtest compare``.

It answers every request as ``servers.http``'s built-in app answers ``/``: 200 and
``hello from idlekeeper\\n`` as text/plain, so all three servers send the same bytes.
It also completes the lifespan protocol: hypercorn's trio worker crashes at start-up
on an app that returns at once on ``lifespan``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["app"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

BODY = b"hello from idlekeeper\n"


async def app(
    scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
) -> None:
    """Hello world, and lifespan."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
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
