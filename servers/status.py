"""The status endpoint, ``/healthz``, ``/metrics`` and ``/<kind>/<key>``, as an app of
:mod:`servers.http`, served on a worker's own keeper.

It binds to loopback by default. Its connections get the HTTP server's timeouts,
tighter than a public server's: 10 s idle, 10 s to send, and each request head must
be complete 10 s after its first byte (408 otherwise).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable
from typing import Protocol
from urllib.parse import unquote

import trio

import idlekeeper

from .http.app import App, Request, Response
from .http.server import HttpConfig, HttpServer, serve_http
from .listeners import open_listeners
from .prometheus import CONTENT_TYPE

__all__ = ["STATUS_CONFIG", "StatusSource", "fetch_json", "serve_status", "status_app"]

STATUS_CONFIG = HttpConfig(
    keep_alive_timeout=10.0,
    header_timeout=10.0,
    body_timeout=10.0,
    send_timeout=10.0,
    max_header_size=16 * 1024,
    max_body_size=64 * 1024,
    max_connections=256,
    grace=1.0,
)
"""The status endpoint's timeouts and limits: for operators and scrapers, not the public."""


class StatusSource(Protocol):
    """What the endpoint reports on."""

    def healthy(self) -> bool | str:
        """Whether to answer /healthz with 200 ``ok``; a string is a reason for 200
        ``degraded: <reason>`` (serving, but something is behind); False gives 503."""
        ...

    def metrics(self) -> bytes:
        """Prometheus exposition text for /metrics."""
        ...

    def lookup(self, kind: str, key: str, local: bool = False) -> object | Awaitable[object | None] | None:
        """A JSON-ready object for /<kind>/<key>, or None for 404 (may be async).

        ``local`` is set for ``?local=1``: answer from this process only (workers use
        it to ask each other without asking back).
        """
        ...


def _text(status: int, body: bytes, *extra: tuple[str, str]) -> Response:
    return Response(status, [("content-type", "text/plain"), *extra], body)


def status_app(source: StatusSource) -> App:
    """The status endpoint as an app for :func:`servers.http.server.serve_http`."""

    async def app(request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return _text(405, b"method not allowed\n", ("allow", "GET, HEAD"))
        path = request.path
        if path == "/healthz":
            health = source.healthy()
            if isinstance(health, str):
                return _text(200, f"degraded: {health}\n".encode())
            return _text(200, b"ok\n") if health else _text(503, b"unhealthy\n")
        if path == "/metrics":
            return Response(200, [("content-type", CONTENT_TYPE)], source.metrics())
        parts = path.strip("/").split("/", 1)
        if len(parts) == 2 and parts[0] and parts[1]:
            found = source.lookup(parts[0], unquote(parts[1]), local="local=1" in request.query.split("&"))
            if inspect.isawaitable(found):
                found = await found
            if found is not None:
                return Response(200, [("content-type", "application/json")], json.dumps(found).encode() + b"\n")
        return Response(404, [("content-type", "application/json")], b'{"error": "not found"}\n')

    return app


async def serve_status(
    source: StatusSource,
    port: int,
    *,
    keeper: idlekeeper.Keeper,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the status endpoint on ``keeper`` until cancelled; ``nursery.start``
    returns the port (0 picks a free one)."""
    listeners = open_listeners(host, port)
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(
            lambda task_status: serve_http(
                status_app(source), STATUS_CONFIG, listeners=listeners, keeper=keeper, task_status=task_status
            )
        )
        task_status.started(server.port)


async def fetch_json(host: str, port: int, path: str) -> object | None:
    """GET ``path`` from another status endpoint; the JSON body on 200, else None.

    Callers bound it with a cancel scope (``trio.move_on_after``)."""
    try:
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            raw = b""
            while chunk := await stream.receive_some(65536):
                raw += chunk
    except (OSError, trio.BrokenResourceError):
        return None
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return None
    try:
        found: object = json.loads(body)
    except ValueError:
        return None
    return found
