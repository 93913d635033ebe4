"""``python -m servers.http``: the HTTP/1.1 server with nginx/HAProxy-grade timeouts."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import trio

from .. import runner
from ..config import HelpFormatter, add_log_level, add_worker_arguments, configure_logging
from ..listeners import open_listeners
from ..prometheus import render, worker_registry
from ..readiness import Ready
from ..tls import add_tls_arguments, check_tls_arguments
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


def parser() -> argparse.ArgumentParser:
    """The command line, documented in --help and docs/reference/cli.md."""
    p = argparse.ArgumentParser(prog="python -m servers.http", description=DESCRIPTION, formatter_class=HelpFormatter)
    a = p.add_argument
    a("app", nargs="?", default=None, metavar="MODULE:APP", help="the ASGI app to serve, e.g. myproject.web:app")
    add_worker_arguments(p, port=8080)
    a(
        "--engine",
        choices=ENGINES,
        default="dense",
        help="dense: no task per connection (default); streams: a task each",
    )
    a(
        "--lifespan",
        choices=("auto", "off"),
        default="auto",
        help="run the app's lifespan protocol (auto: if it has one)",
    )
    a("--keep-alive-timeout", type=float, default=15.0, help="idle seconds between requests, and before the first")
    a("--header-timeout", type=float, default=10.0, help="seconds from a request's first byte to its complete head")
    a("--body-timeout", type=float, default=30.0, help="seconds allowed between two reads of a request body")
    a("--send-timeout", type=float, default=30.0, help="seconds a response may go without write progress")
    a("--max-connection-age", type=float, default=None, help="seconds after which a connection is closed politely")
    a("--max-requests", type=int, default=None, help="requests per connection before it is closed politely")
    a("--max-header-size", type=int, default=16 * 1024, help="bytes of request head (431 beyond; default 16 KiB)")
    a("--max-body-size", type=int, default=16 * 1024 * 1024, help="bytes of request body (413 beyond; 16 MiB)")
    a("--max-connections", type=int, default=16_000, help="connections per worker; beyond it 503 (default 16000)")
    a(
        "--grace",
        type=float,
        default=10.0,
        help="seconds requests in flight (and background work) get at shutdown, and an app whose client left"
        " mid-request before it is cancelled (default: 10)",
    )
    a(
        "--max-background",
        type=_count,
        default=1000,
        help="app calls per worker that run on after their response (background tasks) while their connections"
        " take the next request; past it a connection waits for its app (default: 1000)",
    )
    ws = p.add_argument_group("WebSockets (uvicorn's names and defaults)")
    w = ws.add_argument
    w("--ws", choices=("wsproto", "none"), default="wsproto", help="serve WebSocket upgrades (none: 404)")
    w("--ws-max-size", type=int, default=16 * 1024 * 1024, help="bytes of one message, inflated (1009 beyond)")
    w("--ws-ping-interval", type=_seconds_or_none, default=20.0, help="seconds between pings (0: none)")
    w("--ws-ping-timeout", type=_seconds_or_none, default=20.0, help="seconds a pong may take (1011 beyond)")
    w(
        "--ws-per-message-deflate",
        type=_on_off,
        default=True,
        metavar="{true,false}",
        help="take permessage-deflate offers (default: true)",
    )
    w("--ws-close-timeout", type=float, default=10.0, help="seconds for the client's answer to a close")
    add_tls_arguments(p, client_certificates=False)
    add_log_level(p)
    return p


def _count(value: str) -> int:
    count = int(value)
    if count < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return count


def _seconds_or_none(value: str) -> float | None:
    seconds = float(value)
    if seconds < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return seconds or None


def _on_off(value: str) -> bool:
    if value.lower() in ("true", "1", "on", "yes"):
        return True
    if value.lower() in ("false", "0", "off", "no"):
        return False
    raise argparse.ArgumentTypeError("true or false")


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
        ws_ping_interval=args.ws_ping_interval,
        ws_ping_timeout=args.ws_ping_timeout,
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
    return runner.main("servers.http", args, argv, run_worker, grace=args.grace + 5)


if __name__ == "__main__":
    sys.exit(main())
