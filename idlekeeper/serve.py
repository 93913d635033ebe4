"""``serve_tcp`` / ``serve_listeners``: trio's serving helpers, with every connection watched.

Given an ``ssl_context`` they serve TLS, the handshake under a deadline of its own
(see :mod:`idlekeeper.tls`).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import NoReturn

import trio

from .keeper import Keeper
from .tls import DEFAULT_HANDSHAKE_TIMEOUT, serve_tls
from .tls_transport import check_handshake_timeout
from .watch import ExpireHook, WatchedStream

__all__ = ["Handler", "serve_listeners", "serve_tcp"]

logger = logging.getLogger("idlekeeper.serve")

Handler = Callable[[WatchedStream], Awaitable[object]]
"""``async def handler(stream)``: ``stream.watch`` changes deadlines per phase."""


async def serve_listeners(
    handler: Handler,
    listeners: list[trio.SocketListener],
    *,
    keeper: Keeper,
    idle: float | None = None,
    receive: float | None = None,
    send: float | None = None,
    max_age: float | None = None,
    close: bool = True,
    on_expire: ExpireHook | None = None,
    ssl_context: ssl.SSLContext | None = None,
    https_compatible: bool = False,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Like :func:`trio.serve_listeners`, handing each handler a watched stream.

    The deadlines given here are where every connection starts; the handler can
    change them through ``stream.watch``. With ``close=False`` an expiry only
    cancels the handler, which may then say goodbye (an HTTP 408, say) from a
    shielded, time-bounded scope before the connection is closed. An exception from
    one handler is logged and ends only that connection, never the server.

    With an ``ssl_context`` (server side: ``ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)``
    with ``load_cert_chain``) each connection is TLS, and the handler's stream carries
    plaintext. The handshake must complete within ``handshake_timeout`` seconds of
    accept, or the connection is cut then (logged, and counted in
    ``keeper.stats.handshake_failures``); ``idle``, ``receive`` and ``send`` start when
    it completes. ``https_compatible`` is :class:`trio.SSLStream`'s (True for HTTPS).
    """

    if ssl_context is not None:
        check_handshake_timeout(handshake_timeout)

    async def watched(raw: trio.abc.Stream) -> None:
        try:
            if ssl_context is not None:
                await serve_tls(
                    raw,
                    handler,
                    keeper=keeper,
                    ssl_context=ssl_context,
                    https_compatible=https_compatible,
                    handshake_timeout=handshake_timeout,
                    idle=idle,
                    receive=receive,
                    send=send,
                    max_age=max_age,
                    close=close,
                    on_expire=on_expire,
                )
                return
            with keeper.watch(
                raw, idle=idle, receive=receive, send=send, max_age=max_age, close=close, on_expire=on_expire
            ) as conn:
                await handler(conn.stream)
        except Exception:
            logger.exception("idlekeeper: connection handler raised")

    await trio.serve_listeners(watched, listeners, handler_nursery=handler_nursery, task_status=task_status)


async def serve_tcp(
    handler: Handler,
    port: int,
    *,
    keeper: Keeper,
    host: str | bytes | None = None,
    backlog: int | None = None,
    idle: float | None = None,
    receive: float | None = None,
    send: float | None = None,
    max_age: float | None = None,
    close: bool = True,
    on_expire: ExpireHook | None = None,
    ssl_context: ssl.SSLContext | None = None,
    https_compatible: bool = False,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Like :func:`trio.serve_tcp`, handing each handler a watched stream.

    Compatible with ``nursery.start``, which returns the listeners (port 0 picks a
    free port: read it from ``listeners[0].socket.getsockname()``). With an
    ``ssl_context``, TLS (as :func:`trio.serve_ssl_over_tcp`), the handshake under
    its own deadline: see :func:`serve_listeners`.
    """
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    await serve_listeners(
        handler,
        listeners,
        keeper=keeper,
        idle=idle,
        receive=receive,
        send=send,
        max_age=max_age,
        close=close,
        on_expire=on_expire,
        ssl_context=ssl_context,
        https_compatible=https_compatible,
        handshake_timeout=handshake_timeout,
        handler_nursery=handler_nursery,
        task_status=task_status,
    )
