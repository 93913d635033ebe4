"""The built-in app, for demos and tests: ``/``, ``/healthz``, ``/metrics``, ``/echo``, ``/download``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from ..prometheus import CONTENT_TYPE
from .app import App, Request, Response

__all__ = ["builtin_app"]

_CHUNK = b"x" * 65536
MAX_DOWNLOAD = 1 << 30


def builtin_app(metrics: Callable[[], bytes] | None = None) -> App:
    """The demo app. ``metrics()`` is the exposition text that /metrics answers with
    (see :func:`servers.prometheus.render`); without it /metrics is 404."""

    async def app(request: Request) -> Response:
        path = request.path
        if request.method not in ("GET", "HEAD", "POST", "PUT"):
            return Response(405, [("allow", "GET, HEAD, POST, PUT")], b"method not allowed\n")
        if path == "/":
            return Response(200, [("content-type", "text/plain")], b"hello from idlekeeper\n")
        if path == "/healthz":
            return Response(200, [("content-type", "text/plain")], b"ok\n")
        if path == "/metrics" and metrics is not None:
            return Response(200, [("content-type", CONTENT_TYPE)], metrics())
        if path == "/echo":
            body = await request.body()  # bounded by the server's body-size limit
            return Response(200, [("content-type", "application/octet-stream")], body)
        if path == "/download":
            try:
                size = min(int(request.query.partition("size=")[2] or 10 << 20), MAX_DOWNLOAD)
            except ValueError:
                return Response(400, [("content-type", "text/plain")], b"size must be a number of bytes\n")
            return Response(200, [("content-type", "application/octet-stream")], _stream(size))
        return Response(404, [("content-type", "text/plain")], b"not found\n")

    return app


async def _stream(size: int) -> AsyncIterator[bytes]:
    # Generated piece by piece: a reader that stops reading costs one piece, not the file.
    remaining = size
    while remaining > 0:
        piece = _CHUNK if remaining >= len(_CHUNK) else _CHUNK[:remaining]
        remaining -= len(piece)
        yield piece
