"""``idlekeeper-http`` (``python -m servers.http``): the HTTP/1.1 server with nginx/HAProxy-grade timeouts."""

from __future__ import annotations

from ..extras import require

require("idlekeeper-http", "servers")  # before the imports that need it

import argparse
import logging
import sys
from collections.abc import Sequence

import trio

from .. import runner
from ..config import LOG_LEVEL, configure_logging, worker_settings
from ..listeners import open_listeners
from ..prometheus import render, worker_registry
from ..readiness import Ready
from ..settings import Choice, CommandLine, Flag, Setting, Text, count, program, seconds
from ..tls import check_tls_arguments, tls_settings
from .asgi import ASGIApp, load_app, native_asgi
from .builtin import builtin_app
from .lifespan import LifespanFailed
from .server import ENGINES, HttpConfig, HttpServer, serve_asgi

logger = logging.getLogger("servers.http")

DESCRIPTION = """\
HTTP/1.1 server on h11 and trio for ASGI 3 apps. Every timeout is kept by
idlekeeper's timing wheel and one reaper task per worker: no cancel scope or timer
per request. Without an app it serves the built-in one: /, /healthz, /metrics,
/echo (POST a body), /download?size=N. With --tls-cert and --tls-key it serves HTTPS."""


_WS = "WebSockets (uvicorn's names and defaults)"

SETTINGS: tuple[Setting, ...] = (
    *worker_settings(port=8080),
    Setting(
        "--engine",
        Choice(ENGINES),
        "dense",
        "dense: no task per connection (default); streams: a task each",
    ),
    Setting(
        "--lifespan",
        Choice(("auto", "off")),
        "auto",
        "run the app's lifespan protocol (auto: if it has one)",
    ),
    Setting(
        "--keep-alive-timeout",
        seconds(),
        15.0,
        "idle seconds between requests, and before the first (default: 15; to close after each response, "
        "--max-requests 1)",
    ),
    Setting(
        "--header-timeout",
        seconds(),
        10.0,
        "seconds from a request's first byte to its complete head (default: 10)",
    ),
    Setting("--body-timeout", seconds(), 30.0, "seconds allowed between two reads of a request body (default: 30)"),
    Setting("--send-timeout", seconds(), 30.0, "seconds a response may go without write progress (default: 30)"),
    Setting(
        "--max-connection-age",
        seconds(),
        None,
        "seconds after which a connection is closed politely (default: none)",
    ),
    Setting(
        "--max-requests",
        count("requests"),
        None,
        "requests per connection before it is closed politely (default: none)",
    ),
    Setting(
        "--max-header-size",
        count("bytes", least=256),
        16 * 1024,
        "bytes of request head (431 beyond; default 16 KiB)",
    ),
    Setting(
        "--max-body-size",
        count("bytes", least=0),
        16 * 1024 * 1024,
        "bytes of request body (413 beyond; 16 MiB)",
    ),
    Setting(
        "--max-connections",
        count("connections"),
        16_000,
        "connections per worker; beyond it 503 (default 16000)",
    ),
    Setting(
        "--grace",
        seconds(least=0),
        10.0,
        "seconds requests in flight (and background work) get at shutdown, and an app whose client left"
        " mid-request before it is cancelled (default: 10)",
    ),
    Setting(
        "--max-background",
        count("app calls", least=0),
        1000,
        "app calls per worker that run on after their response (background tasks) while their connections"
        " take the next request; past it a connection waits for its app (default: 1000)",
    ),
    Setting("--ws", Choice(("wsproto", "none")), "wsproto", "serve WebSocket upgrades (none: 404)", group=_WS),
    Setting(
        "--ws-max-size",
        count("bytes"),
        16 * 1024 * 1024,
        "bytes of one message, inflated (1009 beyond)",
        group=_WS,
    ),
    Setting(
        "--ws-ping-interval",
        seconds(least=0),
        20.0,
        "seconds between pings (0: none)",
        group=_WS,
    ),
    Setting(
        "--ws-ping-timeout",
        seconds(least=0),
        20.0,
        "seconds a pong may take (1011 beyond; 0: no limit)",
        group=_WS,
    ),
    Setting(
        "--ws-per-message-deflate",
        Text(Flag().parse),
        True,
        "take permessage-deflate offers (default: true)",
        group=_WS,
        metavar="{true,false}",
    ),
    Setting("--ws-close-timeout", seconds(), 10.0, "seconds for the client's answer to a close", group=_WS),
    *tls_settings(client_certificates=False),
    LOG_LEVEL,
)
"""The HTTP server's options, in the order --help lists them."""


def parser() -> CommandLine:
    """The command line (:data:`SETTINGS`), documented in --help and docs/reference/cli.md."""
    cli = CommandLine(prog=program("idlekeeper-http", "servers.http"), description=DESCRIPTION)
    cli.add_argument(
        "app", nargs="?", default=None, metavar="MODULE:APP", help="the ASGI app to serve, e.g. myproject.web:app"
    )
    cli.add_settings(SETTINGS)
    return cli


def config_from(args: argparse.Namespace, worker: int) -> HttpConfig:
    """A worker's configuration."""
    return HttpConfig.from_args(
        args,
        worker,
        keep_alive_timeout=args.keep_alive_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        send_timeout=args.send_timeout,
        max_connection_age=args.max_connection_age,
        max_requests=args.max_requests,
        max_header_size=args.max_header_size,
        max_body_size=args.max_body_size,
        max_connections=args.max_connections,
        grace=args.grace,
        max_background=args.max_background,
        engine=args.engine,
        websockets=args.ws != "none",
        ws_max_size=args.ws_max_size,
        ws_ping_interval=args.ws_ping_interval or None,
        ws_ping_timeout=args.ws_ping_timeout or None,
        ws_per_message_deflate=args.ws_per_message_deflate,
        ws_close_timeout=args.ws_close_timeout,
    )


async def run_worker(args: argparse.Namespace, worker: int, reuse_port: bool) -> None:
    """One worker: serve until SIGINT or SIGTERM, then shut down gracefully."""
    config = config_from(args, worker)
    listeners = open_listeners(args.host, args.port, reuse_port=reuse_port)

    async def start(nursery: trio.Nursery) -> HttpServer:
        # The built-in app's /metrics renders the registry, which is made once the
        # server (and its keeper) exist: the closure reads it at request time.
        app: ASGIApp = load_app(args.app) if args.app else native_asgi(builtin_app(lambda: render(registry)))
        try:
            server: HttpServer = await nursery.start(
                lambda task_status: serve_asgi(
                    app, config, listeners=listeners, lifespan=args.lifespan == "auto", task_status=task_status
                )
            )
        except BaseException as exc:
            failed = runner.raised(exc, LifespanFailed)
            if failed is None:
                raise
            # As uvicorn says it, and exits: code 3.
            raise runner.WorkerExit(3, str(failed), "Application startup failed. Exiting.") from None
        registry = worker_registry(server.keeper.stats, {"worker": str(worker)}, server.figures)
        return server

    def reload(server: HttpServer) -> None:
        logger.info("SIGHUP: the HTTP server has no files to reload")

    await runner.serve_until_signal(
        start, lambda server: Ready("http", worker, args.host, server.port), stop=HttpServer.shutdown, reload=reload
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: a single worker, or a supervisor of ``--workers`` workers."""
    cli = parser()
    args = cli.parse_args(argv)
    check_tls_arguments(cli, args)
    configure_logging(args.log_level)
    if args.app:
        try:
            load_app(args.app)  # a wrong name is told here, once, not by every worker
        except ValueError as exc:
            cli.error(str(exc))
    try:
        config_from(args, 0)
    except ValueError as exc:
        cli.error(str(exc))
    return runner.main("servers.http", args, argv, run_worker, grace=args.grace + 5, prog=cli.prog)


if __name__ == "__main__":
    sys.exit(main())
