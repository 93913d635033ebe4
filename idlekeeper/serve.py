"""``serve_tcp`` / ``serve_listeners``: trio's serving helpers, with every connection watched."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

import trio

from .keeper import Keeper
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
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Like :func:`trio.serve_listeners`, handing each handler a watched stream.

    The deadlines given here are where every connection starts; the handler can
    change them through ``stream.watch``. With ``close=False`` an expiry only
    cancels the handler, which may then say goodbye (an HTTP 408, say) from a
    shielded, time-bounded scope before the connection is closed. An exception from
    one handler is logged and ends only that connection, never the server.
    """

    async def watched(raw: trio.abc.Stream) -> None:
        try:
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
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Like :func:`trio.serve_tcp`, handing each handler a watched stream.

    Compatible with ``nursery.start``, which returns the listeners (port 0 picks a
    free port: read it from ``listeners[0].socket.getsockname()``).
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
        handler_nursery=handler_nursery,
        task_status=task_status,
    )
