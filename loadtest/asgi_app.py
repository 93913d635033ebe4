"""A trivial ASGI app for the HTTP peers (hypercorn, uvicorn) in ``python -m loadtest compare``.

It answers every request as ``servers.http``'s built-in app answers ``/``: 200 and
``hello from idlekeeper\\n`` as text/plain, so all three servers send the same bytes.
It also completes the lifespan protocol: hypercorn's trio worker crashes at start-up
on an app that returns at once on ``lifespan``.
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
