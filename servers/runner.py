"""What every server's ``__main__`` does: one worker, or a supervisor of several; and a
worker's life from start to signal.

A server supplies its command line and an async ``run_worker(args, worker, reuse_port)``;
:func:`main` decides whether this process is a lone server, a supervised worker, or
the supervisor, and :func:`serve_until_signal` runs a worker until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import trio

if sys.version_info < (3, 11):  # pragma: no cover - trio brings the backport there
    from exceptiongroup import BaseExceptionGroup

from .bus import Hub
from .listeners import CannotListen, PortInUse, check_port_free
from .readiness import Ready, announce_ready
from .taskdump import dump_tasks_on_signal
from .workers import CANNOT_START, die_with_supervisor, run_supervised

__all__ = ["WorkerExit", "main", "raised", "serve_until_signal"]

logger = logging.getLogger("servers.runner")

S = TypeVar("S")

WorkerMain = Callable[[argparse.Namespace, int, bool], Awaitable[None]]
"""``run_worker(args, worker_index, reuse_port)``: one worker process's whole life."""


class WorkerExit(Exception):
    """A worker cannot serve, for a reason its operator must fix (an app whose start-up
    failed, say): :func:`main` logs ``lines`` at ERROR, without a traceback, and the
    process exits with ``code``."""

    def __init__(self, code: int, *lines: str) -> None:
        super().__init__(*lines)
        self.code = code
        self.lines = lines


E = TypeVar("E", bound=BaseException)


def raised(exc: BaseException, kind: type[E]) -> E | None:
    """The exception of ``kind`` that ``exc`` is or holds (nurseries wrap what their
    tasks raise in exception groups), if any."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = raised(inner, kind)
            if found is not None:
                return found
    return None


def main(
    module: str,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    run_worker: WorkerMain,
    *,
    grace: float = 10.0,
    hub: Callable[[], Hub] | None = None,
    extra_ports: Sequence[tuple[str, str, int]] = (),
    prog: str | None = None,
) -> int:
    """Run ``args.workers`` workers of ``python -m <module>`` on one port, or be one.

    With one worker (or when started as a worker by the supervisor, which passes
    ``--worker-index``) this process serves. Otherwise it becomes the supervisor,
    which restarts workers that die and stops them all on a signal, waiting
    ``grace`` seconds for their shutdown. With ``hub`` (a factory, called in the
    supervisor only), the workers are linked to the supervisor's hub and each gets
    ``--bus <path>``. Returns 2, with one line on stderr, if another process already
    listens on the port or on one of ``extra_ports`` (``(option, host, port)``: the
    other ports the server's workers will take). A worker that cannot listen, or
    raises :class:`WorkerExit`, says why in one line and exits
    :data:`~servers.workers.CANNOT_START` (or the WorkerExit's code).
    """
    name = prog or module
    if args.worker_index is None:
        # A lone server or a supervisor: the ports must be ours alone. (Workers skip
        # this: their siblings already hold the port, by design.)
        for option, host, port in (("--port", args.host, args.port), *extra_ports):
            try:
                check_port_free(host, port)
            except PortInUse as exc:
                print(f"{name}: error: {option}: {exc.strerror}", file=sys.stderr)
                return 2
    else:
        die_with_supervisor()  # a supervised worker: never outlive the supervisor
    if args.workers <= 1 or args.worker_index is not None:
        try:
            trio.run(run_worker, args, args.worker_index or 0, args.worker_index is not None)
        except BaseException as exc:
            fatal = raised(exc, WorkerExit)
            if fatal is not None:
                for line in fatal.lines:
                    logger.error("%s", line)
                return fatal.code
            # A port taken since the check above (or a status port by another program).
            unbound = raised(exc, CannotListen)
            if unbound is None:
                raise
            print(f"{name}: error: {unbound.strerror}", file=sys.stderr)
            return CANNOT_START
        return 0
    links = hub() if hub is not None else None
    try:
        return run_supervised(
            module,
            argv if argv is not None else sys.argv[1:],
            host=args.host,
            port=args.port,
            workers=args.workers,
            grace=grace,
            worker_args=(lambda index: ("--bus", links.path)) if links is not None else (lambda index: ()),
            hub=links,
        )
    finally:
        if links is not None:
            links.close()


async def serve_until_signal(
    start: Callable[[trio.Nursery], Awaitable[S]],
    ready: Callable[[S], Ready],
    *,
    stop: Callable[[S], Awaitable[None]] | None = None,
    reload: Callable[[S], None] | None = None,
) -> S:
    """Start a worker's server, announce it, serve until SIGINT or SIGTERM, then stop.

    ``start(nursery)`` starts everything the worker runs and returns the server;
    ``ready(server)`` says what to announce (see :mod:`servers.readiness`). Meanwhile
    SIGHUP calls ``reload(server)`` (the operator's "reload your files", which the
    supervisor passes on to every worker; without ``reload`` it is logged and
    ignored), and SIGUSR1 logs the worker's tasks (:mod:`servers.taskdump`). Both
    are listened for before the worker says it listens: their default action would
    end it. On SIGINT or SIGTERM, ``stop(server)`` (if given) runs first, for a
    graceful shutdown; then everything still running is cancelled. Returns the
    server, for a last look.
    """
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        trio.open_signal_receiver(signal.SIGHUP) as hangups,
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(dump_tasks_on_signal)
            server = await start(nursery)
            nursery.start_soon(_reload_on_hangups, hangups, server, reload)
            announce_ready(ready(server))
            async for _ in signals:
                break
            if stop is not None:
                await stop(server)
            nursery.cancel_scope.cancel()
    return server


async def _reload_on_hangups(hangups: AsyncIterator[int], server: S, reload: Callable[[S], None] | None) -> None:
    """Each SIGHUP (one that came while the server started included): ``reload(server)``."""
    async for _ in hangups:
        if reload is None:
            logger.info("SIGHUP: this server has no files to reload")
        else:
            reload(server)
