"""The status endpoint, ``/healthz``, ``/metrics`` and ``/<kind>/<key>`` (and the
operator's page, :mod:`servers.page`, where a server has one), as an app of
:mod:`servers.http`, served on a worker's own keeper.

It binds to loopback by default. Its connections get the HTTP server's timeouts,
tighter than a public server's: 5 s idle (before the first request too), 5 s between
two reads of a body, 10 s to send, and each request head must be complete 5 s after
its first byte (408 otherwise). At its 256 connections a new one takes the place of
the oldest (one not with the app if there is one) instead of a 503, so ``/healthz``
answers however many idle connections anyone holds or renews.

With a :class:`~servers.bearer.TokenFile`, everything but ``/healthz`` (which
liveness probes ask without credentials) needs ``Authorization: Bearer <token>``;
without one, or with a wrong one, the answer is 401 with ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable
from typing import Protocol
from urllib.parse import unquote

import trio

import idlekeeper

from .bearer import TokenFile
from .http.app import App, Request, Response
from .http.server import HttpConfig, HttpServer, serve_http
from .listeners import open_listeners
from .page import Page
from .prometheus import CONTENT_TYPE

__all__ = ["STATUS_CONFIG", "StatusSource", "fetch_json", "serve_status", "status_app"]

STATUS_CONFIG = HttpConfig(
    # Probes and scrapers send their request at once: a few seconds of idleness or
    # of an unfinished head is a client that holds a slot, not one that is slow.
    keep_alive_timeout=5.0,
    header_timeout=5.0,
    body_timeout=5.0,
    send_timeout=10.0,
    max_header_size=16 * 1024,
    max_body_size=64 * 1024,
    max_connections=256,
    evict_at_cap=True,
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


def _unauthorized(authorization: str | None) -> Response:
    challenge = 'Bearer realm="status"'
    if authorization is not None:
        challenge += ', error="invalid_token"'  # RFC 6750 3.1: credentials were sent, and are wrong
    return _text(401, b"unauthorized\n", ("www-authenticate", challenge))


def status_app(source: StatusSource, tokens: TokenFile | None = None, page: Page | None = None) -> App:
    """The status endpoint as an app for :func:`servers.http.server.serve_http`;
    with ``tokens``, all but ``/healthz`` need one of them as a bearer token; with
    ``page``, the operator's page (:mod:`servers.page`) is served too."""

    async def app(request: Request) -> Response:
        path = request.path
        if tokens is not None and path != "/healthz":
            authorization = request.header("authorization")
            if not tokens.allows(authorization):
                return _unauthorized(authorization)
        if request.method not in ("GET", "HEAD"):
            return _text(405, b"method not allowed\n", ("allow", "GET, HEAD"))
        if path == "/healthz":
            health = source.healthy()
            if isinstance(health, str):
                return _text(200, f"degraded: {health}\n".encode())
            return _text(200, b"ok\n") if health else _text(503, b"unhealthy\n")
        if path == "/metrics":
            return Response(200, [("content-type", CONTENT_TYPE)], source.metrics())
        if page is not None:
            answer = await page.respond(request)
            if answer is not None:
                return answer
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
    tokens: TokenFile | None = None,
    page: Page | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the status endpoint on ``keeper`` until cancelled; ``nursery.start``
    returns the port (0 picks a free one). With ``tokens``, all but ``/healthz`` need
    a bearer token; with ``page``, the operator's page is served too (see :func:`status_app`)."""
    listeners = open_listeners(host, port)
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(
            lambda task_status: serve_http(
                status_app(source, tokens, page),
                STATUS_CONFIG,
                listeners=listeners,
                keeper=keeper,
                task_status=task_status,
            )
        )
        task_status.started(server.port)


async def fetch_json(host: str, port: int, path: str, authorization: str | None = None) -> object | None:
    """GET ``path`` from another status endpoint (with an ``Authorization`` header, if
    given); the JSON body on 200, else None.

    Callers bound it with a cancel scope (``trio.move_on_after``)."""
    credential = "" if authorization is None else f"Authorization: {authorization}\r\n"
    try:
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{credential}Connection: close\r\n\r\n"
            await stream.send_all(request.encode())
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
