"""One heartbeat worker: its keeper, the engine serving its connections, its coordinator
and its status endpoint, started in the order they need each other."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import trio

import idlekeeper

from ..bearer import TokenFile
from ..listeners import CannotListen, open_listeners, port_of
from ..page import Page
from ..status import serve_status
from .bridging import start_bridges
from .config import HeartbeatConfig
from .coordination import Coordinator
from .server.doors import Door
from .server.lifecycle import HeartbeatServer
from .server.sys_tree import publish_sys_tree
from .transports.dense import serve_dense
from .transports.dense_ws import serve_websockets_dense
from .transports.streams import serve_streams, serve_websockets

__all__ = ["serve_heartbeat"]

logger = logging.getLogger("servers.heartbeat")


async def serve_heartbeat(
    config: HeartbeatConfig,
    *,
    listeners: list[trio.SocketListener] | None = None,
    ws_listeners: list[trio.SocketListener] | None = None,
    reuse_port: bool = False,
    status_port: int | None = None,
    status_host: str = "127.0.0.1",
    status_tokens: TokenFile | None = None,
    status_siblings: Sequence[int] = (),
    coordinator: Coordinator | None = None,
    task_status: trio.TaskStatus[HeartbeatServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one heartbeat worker until cancelled; ``nursery.start`` returns the server.

    It serves ``config.listeners`` (see :func:`.server.doors.listeners_of`: by default a
    TCP listener on ``config.host:config.port``, and one for MQTT over WebSockets on
    ``config.ws_port`` if that is set), each opened here (SO_REUSEPORT with
    ``reuse_port``, for a worker among several) unless ``listeners`` (the first MQTT
    one's sockets) or ``ws_listeners`` (the first WebSocket one's) are given. Port 0
    picks a free one: read ``server.port``, ``server.ws_port`` or each of
    ``server.doors``. ``config.engine`` says how connections are served: ``dense`` (the
    default; no task per connection) or ``streams``. ``coordinator`` defaults to a lone
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
        if ws_listeners is not None and config.listeners is None and config.ws_port is None:
            config.ws_port = port_of(ws_listeners)  # sockets given are a listener to serve
        server = HeartbeatServer(config, keeper, nursery, coordinator)
        # Started before the first connection, so that no report finds it unattached.
        await nursery.start(partial(server.coordinator.run, server))
        for held in await server.coordinator.pending_wills():  # kept across a restart
            server.wills.restore(held)
        if config.sys_interval:  # $SYS/broker, its first values before the first client
            await nursery.start(publish_sys_tree, server, config.sys_interval)
        given = {False: listeners, True: ws_listeners}
        for door in server.doors:
            sockets = given.get(door.websockets)
            if sockets is not None:
                given[door.websockets] = None  # the first of each kind only
            else:
                sockets = _open(door, reuse_port)
            door.sockets, door.port = sockets, port_of(sockets)
            logger.info("listener %s open on port %d", door.name, door.port)
        mqtt = [door for door in server.doors if not door.websockets]
        server.port = mqtt[0].port if mqtt else 0
        if config.engine == "dense":
            await nursery.start(serve_dense, server, mqtt)
        else:
            for door in mqtt:
                await nursery.start(serve_streams, server, door)
        for door in server.doors:
            if not door.websockets:
                continue
            server.ws_port = server.ws_port or door.port
            if server.engine is not None and door.listener.tls is None:
                serve_websockets_dense(server, server.engine, door)
            else:
                await nursery.start(serve_websockets, server, door)
        if config.bridges and config.worker == 0:
            # One bridge per box: worker 0's. The others' clients reach it through the
            # broker the workers share, as any subscriber on another worker does.
            start_bridges(config.bridges, server, keeper, nursery)
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


def _open(door: Door, reuse_port: bool) -> list[trio.SocketListener]:
    """``door``'s listening sockets; :class:`CannotListen` naming the listener if not."""
    spec = door.spec
    try:
        return open_listeners(
            spec.address, spec.port, reuse_port=reuse_port, domain=spec.socket_domain, interface=spec.bind_interface
        )
    except CannotListen as exc:
        also = f" (bind_interface {spec.bind_interface})" if spec.bind_interface else ""
        raise CannotListen(exc.errno, f"listener {door.name}{also}: {exc.strerror}") from exc
