"""An ASGI app whose responses can leave work running after them, as Starlette's and
FastAPI's background tasks do (the work runs inside the app call, after the body is
sent): for ``python -m benchmarks.http_faults``. Framework-neutral (anyio), so any
ASGI server serves it.

``/`` answers at once; ``/bg?s=SECONDS`` answers at once and then works ``s`` seconds
(at most 10) before its call returns; ``/done`` says how many such calls finished in
this process.
"""

from __future__ import annotations

from urllib.parse import parse_qs

import anyio

from servers.http.asgi import Receive, Scope, Send, complete_lifespan

__all__ = ["app"]

_finished = 0


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """See the module docs."""
    global _finished
    if scope["type"] == "lifespan":
        await complete_lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    body = b"hello\n" if path != "/done" else b"%d\n" % _finished
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})
    if path == "/bg":
        try:
            seconds = min(float(parse_qs(scope["query_string"].decode()).get("s", ["1"])[0]), 10.0)
        except ValueError:
            return
        await anyio.sleep(seconds)  # the work after the response
        _finished += 1
