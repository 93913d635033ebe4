"""An HTTP/1.1 server on h11 and trio, with nginx/HAProxy-grade timeouts kept by idlekeeper.

It serves any ASGI 3 app (:func:`serve_asgi`), and apps of its own ``Request ->
Response`` interface (:func:`serve_http`) as ASGI apps through
:func:`~servers.http.asgi.native_asgi`: one request cycle (:mod:`.exchange`) for both.
Two drivers carry the bytes:

- ``engine="dense"`` (the default, :mod:`.dense`): every connection on idlekeeper's
  dense engine, no task per connection; a task only while a request is with the app;
- ``engine="streams"`` (:mod:`.streams`): a task per connection over a watched trio
  stream.

A connection's deadlines change with the phase, the same in both:

====================  ==========================================  =====================
phase                 deadline                                    on expiry
====================  ==========================================  =====================
waiting for request   ``keep_alive_timeout`` of idleness (also    close silently
                      from accept until the first byte)
request head          absolute: ``header_timeout`` from the       408, then close
                      head's first byte; trickling does not help
request body          ``body_timeout`` between two reads, while   408, then close
                      the app waits for the body
response              ``send_timeout`` without write progress     close
====================  ==========================================  =====================

``max_connection_age`` and ``max_requests`` end a connection politely: the next
response carries ``Connection: close``.

With ``config.tls`` the server speaks HTTPS: the TLS handshake comes before all of
the above, under ``tls.handshake_timeout`` from accept (see :mod:`idlekeeper.tls` and, on the
dense engine, :mod:`idlekeeper.tls_transport`), and every phase's deadline then works
as over plain TCP.

Requests whose framing is ambiguous (RFC 9112 §6.3: ``Content-Length`` beside
``Transfer-Encoding``, differing lengths, a last coding other than chunked) get 400,
any major version but 1 gets 505, and a malformed chunked body gets 400 whether or
not the app read it; each is logged on one line at INFO and closes its connection
only. ``Expect: 100-continue`` is answered when the app first reads the body.
"""

from __future__ import annotations

import trio

import idlekeeper

from ..listeners import open_listeners
from .app import App
from .asgi import ASGIApp, native_asgi
from .core import ENGINES, TIMEOUT_LINGER, HttpConfig, HttpServer
from .dense import run_dense
from .dense_server import DenseHttpServer
from .lifespan import Lifespan
from .streams import StreamsHttpServer, run_streams

__all__ = ["ENGINES", "TIMEOUT_LINGER", "HttpConfig", "HttpServer", "serve_asgi", "serve_http"]


async def serve_http(
    app: App,
    config: HttpConfig,
    *,
    listeners: list[trio.SocketListener] | None = None,
    keeper: idlekeeper.Keeper | None = None,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an app of the native interface until cancelled; ``nursery.start`` returns
    the :class:`HttpServer`. It runs as an ASGI app (:func:`~.asgi.native_asgi`)
    through the same request cycle and timeouts as any other; see :func:`serve_asgi`."""
    await serve_asgi(native_asgi(app), config, listeners=listeners, keeper=keeper, task_status=task_status)


async def serve_asgi(
    app: ASGIApp,
    config: HttpConfig,
    *,
    listeners: list[trio.SocketListener] | None = None,
    keeper: idlekeeper.Keeper | None = None,
    lifespan: bool = True,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI app ``app`` until cancelled; ``nursery.start`` returns the
    :class:`HttpServer` once its lifespan start-up has completed (a failed start-up
    raises :class:`~.lifespan.LifespanFailed`).

    Connections are watched by ``keeper`` if one is given (a server that runs beside
    others in one worker shares that worker's keeper and reaper), otherwise by a keeper
    of its own with ``config.tick``. ``await server.shutdown()`` first for a graceful
    stop (requests in flight finish, then the app's lifespan shutdown runs); cancelling
    alone is abrupt.
    """
    if keeper is None:
        async with idlekeeper.open_keeper(tick=config.tick, lookahead=config.lookahead) as own:
            await _serve(app, config, listeners, own, lifespan, task_status)
    else:
        await _serve(app, config, listeners, keeper, lifespan, task_status)


async def _serve(
    app: ASGIApp,
    config: HttpConfig,
    listeners: list[trio.SocketListener] | None,
    keeper: idlekeeper.Keeper,
    lifespan: bool,
    task_status: trio.TaskStatus[HttpServer],
) -> None:
    if config.engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {config.engine!r}")
    if listeners is None:
        listeners = open_listeners(config.host, config.port)
    async with trio.open_nursery() as nursery:
        life: Lifespan | None = None
        if lifespan:
            life = Lifespan(app)
            await nursery.start(life.run)
            await life.startup()
        server: HttpServer
        if config.engine == "dense":
            server = DenseHttpServer(app, config, keeper, life)
            await nursery.start(run_dense, server, listeners)
        else:
            server = StreamsHttpServer(app, config, keeper, life)
            await nursery.start(run_streams, server, listeners)
        task_status.started(server)
