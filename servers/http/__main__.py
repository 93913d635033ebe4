"""``python -m servers.http``: the HTTP/1.1 server with nginx/HAProxy-grade timeouts."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

import trio

from ..prometheus import MetricsWriter
from ..workers import announce, open_listeners, run_supervised
from .builtin import builtin_app
from .server import HttpConfig, HttpServer, serve_http

DESCRIPTION = """\
HTTP/1.1 server on h11 and trio. Every timeout is kept by idlekeeper's timing
wheel and one reaper task per worker: no cancel scope or timer per request.
Serves the built-in app: /, /healthz, /metrics, /echo (POST a body), /download?size=N."""


def parser() -> argparse.ArgumentParser:
    """The command line, documented in --help and the README."""
    p = argparse.ArgumentParser(prog="python -m servers.http", description=DESCRIPTION)
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    a("--port", type=int, default=8080, help="TCP port; 0 picks a free one (default: 8080)")
    a("--workers", type=int, default=1, help="worker processes sharing the port with SO_REUSEPORT (default: 1)")
    a("--tick", type=float, default=0.1, help="keeper tick in seconds (default: 0.1)")
    a("--keep-alive-timeout", type=float, default=15.0, help="idle seconds between requests, and before the first")
    a("--header-timeout", type=float, default=10.0, help="seconds from a request's first byte to its complete head")
    a("--body-timeout", type=float, default=30.0, help="seconds allowed between two reads of a request body")
    a("--send-timeout", type=float, default=30.0, help="seconds a response may go without write progress")
    a("--max-connection-age", type=float, default=None, help="seconds after which a connection is closed politely")
    a("--max-requests", type=int, default=None, help="requests per connection before it is closed politely")
    a("--max-header-size", type=int, default=16 * 1024, help="bytes of request head (431 beyond; default 16 KiB)")
    a("--max-body-size", type=int, default=16 * 1024 * 1024, help="bytes of request body (413 beyond; 16 MiB)")
    a("--max-connections", type=int, default=16_000, help="connections per worker; beyond it 503 (default 16000)")
    a("--grace", type=float, default=10.0, help="seconds requests in flight get at shutdown (default: 10)")
    a("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    return p


def config_from(args: argparse.Namespace, worker: int) -> HttpConfig:
    """A worker's configuration."""
    return HttpConfig(
        host=args.host,
        port=args.port,
        tick=args.tick,
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
        worker=worker,
    )


async def run_worker(args: argparse.Namespace, worker: int, reuse_port: bool) -> None:
    """One worker: serve until SIGINT or SIGTERM, then shut down gracefully."""
    config = config_from(args, worker)
    listeners = open_listeners(args.host, args.port, reuse_port=reuse_port)
    holder: list[HttpServer] = []

    def metrics(writer: MetricsWriter) -> None:
        server = holder[0]
        labels = {"worker": str(worker)}
        writer.gauge("http_connections", "Open connections.", len(server.connections), labels)
        writer.counter("http_requests_total", "Requests served.", server.requests_total, labels)
        writer.counter("http_refused_total", "Connections refused with 503.", server.refused_total, labels)
        writer.keeper_stats(server.keeper.stats, labels)

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda task_status: serve_http(
                    builtin_app(metrics), config, listeners=listeners, task_status=task_status
                )
            )
            holder.append(server)
            announce(f"http worker {worker}: listening on {args.host}:{server.port}")
            async for _ in signals:
                break
            await server.shutdown()
            nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: a single worker, or a supervisor of ``--workers`` workers."""
    args = parser().parse_args(argv)
    if args.workers <= 1 or args.worker_index is not None:
        trio.run(run_worker, args, args.worker_index or 0, args.worker_index is not None)
        return 0
    return run_supervised(
        "servers.http",
        argv if argv is not None else sys.argv[1:],
        host=args.host,
        port=args.port,
        workers=args.workers,
        grace=args.grace + 5,
    )


if __name__ == "__main__":
    sys.exit(main())
