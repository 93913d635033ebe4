"""One heartbeat worker: its keeper, the engine serving its connections, its coordinator
and its status endpoint, started in the order they need each other."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import trio

import idlekeeper

from ..bearer import TokenFile
from ..listeners import open_listeners, port_of
from ..page import Page
from ..status import serve_status
from .config import HeartbeatConfig
from .coordination import Coordinator
from .server.lifecycle import HeartbeatServer
from .transports.dense import serve_dense
from .transports.dense_ws import serve_websockets_dense
from .transports.streams import serve_streams, serve_websockets

__all__ = ["serve_heartbeat"]


async def serve_heartbeat(
    config: HeartbeatConfig,
    *,
    listeners: list[trio.SocketListener] | None = None,
    ws_listeners: list[trio.SocketListener] | None = None,
    status_port: int | None = None,
    status_host: str = "127.0.0.1",
    status_tokens: TokenFile | None = None,
    status_siblings: Sequence[int] = (),
    coordinator: Coordinator | None = None,
    task_status: trio.TaskStatus[HeartbeatServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one heartbeat worker until cancelled; ``nursery.start`` returns the server.

    ``listeners`` default to a TCP listener on ``config.host:config.port`` (port 0
    picks a free one: read ``server.port``); ``ws_listeners``, to one on
    ``config.ws_port`` for MQTT over WebSockets if that is set (``server.ws_port``).
    ``config.engine`` says how connections are served: ``dense`` (the default; no task
    per connection) or ``streams``. ``coordinator`` defaults to a lone
    worker's (:class:`InProcessCoordinator`, with ``config.extra_sinks``). ``await
    server.shutdown()`` first for a graceful stop (subscribers hear every device go
    offline); cancelling alone ends every connection at once, each with reason
    ``shutdown`` and its TCP close.

    ``status_port`` (None: none) serves :mod:`servers.status` on this worker's keeper,
    with the operator's page (:mod:`servers.page`) at ``/``; with ``status_tokens``, all
    of it but ``/healthz`` needs a bearer token. ``status_siblings``: the status ports of
    the box's other workers (on ``status_host``), whose figures the page shows too.
    """
    keeping = idlekeeper.open_keeper(tick=config.tick, lookahead=config.lookahead)
    async with keeping as keeper, trio.open_nursery() as nursery:
        server = HeartbeatServer(config, keeper, nursery, coordinator)
        # Started before the first connection, so that no report finds it unattached.
        await nursery.start(partial(server.coordinator.run, server))
        for held in await server.coordinator.pending_wills():  # kept across a restart
            server.wills.restore(held)
        if listeners is None:
            listeners = open_listeners(config.host, config.port)
        server.port = port_of(listeners)
        await nursery.start(serve_dense if config.engine == "dense" else serve_streams, server, listeners)
        if ws_listeners is None and config.ws_port is not None:
            ws_listeners = open_listeners(config.host, config.ws_port)
        if ws_listeners is not None:
            server.ws_port = port_of(ws_listeners)
            if server.engine is not None and config.tls is None:
                serve_websockets_dense(server, server.engine, ws_listeners)
            else:
                await nursery.start(serve_websockets, server, ws_listeners)
        if status_port is not None:
            dashboard = server.dashboard
            dashboard.siblings, dashboard.host = list(status_siblings), status_host
            page = dashboard.page = Page(dashboard)
            await nursery.start(
                partial(
                    serve_status, server, status_port, keeper=keeper, host=status_host, tokens=status_tokens, page=page
                )
            )
        task_status.started(server)
