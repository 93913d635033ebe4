"""A small HTTP/1.1 status endpoint on h11: ``/healthz``, ``/metrics``, ``/<kind>/<key>``.

Shared by the servers. It binds to loopback by default, and every connection is
watched by idlekeeper: 10 s idle, 10 s to send, and each request head must be
complete 10 s after its first byte.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from collections.abc import Awaitable, Sequence
from functools import partial
from typing import Protocol
from urllib.parse import unquote

import h11
import trio

import idlekeeper

from .listeners import open_listeners, port_of
from .prometheus import CONTENT_TYPE

__all__ = ["StatusSource", "linger", "send_error", "serve_status"]

logger = logging.getLogger("servers.status")

HEAD_TIMEOUT = 10.0
MAX_HEAD = 16 * 1024


class StatusSource(Protocol):
    """What the endpoint reports on."""

    def healthy(self) -> bool:
        """Whether to answer /healthz with 200."""
        ...

    def metrics(self) -> str:
        """Prometheus text for /metrics."""
        ...

    def lookup(self, kind: str, key: str, local: bool = False) -> object | Awaitable[object | None] | None:
        """A JSON-ready object for /<kind>/<key>, or None for 404 (may be async).

        ``local`` is set for ``?local=1``: answer from this process only (workers use
        it to ask each other without asking back).
        """
        ...


async def _respond(source: StatusSource, method: str, target: str) -> tuple[int, str, bytes, list[tuple[str, str]]]:
    if method not in ("GET", "HEAD"):
        return 405, "text/plain", b"method not allowed\n", [("Allow", "GET, HEAD")]
    path, _, query = target.partition("?")
    if path == "/healthz":
        ok = source.healthy()
        return (200, "text/plain", b"ok\n", []) if ok else (503, "text/plain", b"unhealthy\n", [])
    if path == "/metrics":
        return 200, CONTENT_TYPE, source.metrics().encode(), []
    parts = path.strip("/").split("/", 1)
    if len(parts) == 2 and parts[0] and parts[1]:
        found = source.lookup(parts[0], unquote(parts[1]), local="local=1" in query.split("&"))
        if inspect.isawaitable(found):
            found = await found
        if found is not None:
            return 200, "application/json", json.dumps(found).encode() + b"\n", []
    return 404, "application/json", b'{"error": "not found"}\n', []


async def _send(conn: idlekeeper.WatchedStream, h: h11.Connection, events: Sequence[h11.Event]) -> None:
    for event in events:
        data = h.send(event)
        if data:
            await conn.send_all(data)


async def _serve_one(source: StatusSource, conn: idlekeeper.WatchedStream) -> None:
    h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    while True:
        try:
            event = h.next_event()
        except h11.RemoteProtocolError as exc:
            await send_error(conn, exc.error_status_hint)  # 400 malformed, 431 head too large
            return
        if event is h11.NEED_DATA:
            data = await conn.receive_some(8192)
            if data and conn.deadline == math.inf and h.their_state is h11.IDLE:
                conn.deadline = trio.current_time() + HEAD_TIMEOUT  # a request head has begun
            h.receive_data(bytes(data))  # b"" tells h11 the peer closed
            continue
        if isinstance(event, h11.Request):
            conn.deadline = None
            status, ctype, body, extra = await _respond(source, event.method.decode(), event.target.decode())
            headers = [("Content-Type", ctype), ("Content-Length", str(len(body))), *extra]
            out: list[h11.Event] = [h11.Response(status_code=status, headers=headers)]
            if event.method != b"HEAD":
                out.append(h11.Data(data=body))
            out.append(h11.EndOfMessage())
            await _send(conn, h, out)
            continue
        if isinstance(event, h11.ConnectionClosed):
            return
        if isinstance(event, h11.EndOfMessage):
            if h.our_state is h11.DONE and h.their_state is h11.DONE:
                try:
                    h.start_next_cycle()
                except h11.LocalProtocolError:
                    return
            elif h.our_state is h11.MUST_CLOSE or h.their_state is h11.MUST_CLOSE:
                return
            continue
        # Data of a request body we do not read: keep going until EndOfMessage.


_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


async def send_error(stream: idlekeeper.WatchedStream, status: int, linger_for: float = 1.0) -> None:
    """An error response written directly (h11 may already be in an error state),
    then a lingering close of ``linger_for`` seconds so that the client reads it
    rather than a reset."""
    reason = _REASONS.get(status, "Error")
    body = f"{status} {reason}\n".encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        await stream.send_all(head + body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    await linger(stream, linger_for)


async def linger(conn: idlekeeper.WatchedStream, seconds: float = 1.0, limit: int = 256 * 1024) -> None:
    """Half-close, then read and discard for a moment before closing (nginx's lingering
    close): closing with the client's bytes unread would reset the connection, and the
    reset can destroy the error response before the client reads it."""
    with trio.move_on_after(seconds):
        try:
            await conn.send_eof()
            drained = 0
            while drained < limit:
                data = await conn.receive_some(65536)
                if not data:
                    break
                drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def serve_status(
    source: StatusSource,
    port: int,
    *,
    keeper: idlekeeper.Keeper,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the status endpoint until cancelled; ``nursery.start`` returns the port."""
    listeners = open_listeners(host, port)
    bound = port_of(listeners)

    async def handler(conn: idlekeeper.WatchedStream) -> None:
        await _serve_one(source, conn)

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(idlekeeper.serve_listeners, handler, listeners, keeper=keeper, idle=10, send=10))
        task_status.started(bound)


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
