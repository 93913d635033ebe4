"""What every server's ``__main__`` does: one worker, or a supervisor of several; and a
worker's life from start to signal.

A server supplies its command line and an async ``run_worker(args, worker, reuse_port)``;
:func:`main` decides whether this process is a lone server, a supervised worker, or
the supervisor, and :func:`serve_until_signal` runs a worker until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
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
from .systemd import Notifier
from .taskdump import dump_tasks_on_signal
from .workers import CANNOT_START, die_with_supervisor, run_supervised

__all__ = ["WorkerExit", "main", "raised", "serve_until_signal"]

logger = logging.getLogger("servers.runner")

S = TypeVar("S")

# This process's channel to systemd (a lone server), or to its supervisor (a worker):
# set by main() before the worker runs, read by serve_until_signal. Does nothing until then.
_notifier = Notifier()

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

    The process systemd started (a lone server, or the supervisor) tells it when the
    server serves, reloads and stops (:mod:`servers.systemd`), and writes its PID to
    ``args.pid_file`` (if set) at the start, removing it at the end; a PID file that
    cannot be written is refused like a taken port.
    """
    global _notifier
    name = prog or module
    # Taken out of the environment: whatever this process starts must not speak for it.
    _notifier = Notifier.from_environ(worker=args.worker_index is not None, unset=True)
    pid_file = None
    if args.worker_index is None:
        # A lone server or a supervisor: the ports must be ours alone. (Workers skip
        # this: their siblings already hold the port, by design.)
        for option, host, port in (("--port", args.host, args.port), *extra_ports):
            try:
                check_port_free(host, port)
            except PortInUse as exc:
                print(f"{name}: error: {option}: {exc.strerror}", file=sys.stderr)
                return 2
        # After the port check, as Mosquitto writes it at start: a second server refused
        # for a taken port leaves the running one's file alone.
        pid_file = getattr(args, "pid_file", None)
        if pid_file:
            try:
                _write_pid_file(pid_file)
            except OSError as exc:
                print(f"{name}: error: --pid-file: cannot write {pid_file}: {exc.strerror or exc}", file=sys.stderr)
                return 2
    else:
        die_with_supervisor()  # a supervised worker: never outlive the supervisor
    try:
        return _serve(module, args, argv, run_worker, grace, hub, name)
    finally:
        _notifier.close()
        if pid_file:
            _remove_pid_file(pid_file)


def _write_pid_file(path: str) -> None:
    with open(path, "w") as f:
        f.write(f"{os.getpid()}\n")


def _remove_pid_file(path: str) -> None:
    """Remove the PID file if it is still ours (another server may have written its own since)."""
    try:
        with open(path) as f:
            if f.read().strip() != str(os.getpid()):
                return
        os.unlink(path)
    except FileNotFoundError:
        return  # removed already (by the operator): nothing to do
    except OSError as exc:
        logger.warning("cannot remove the PID file %s: %s", path, exc.strerror or exc)


def _serve(
    module: str,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    run_worker: WorkerMain,
    grace: float,
    hub: Callable[[], Hub] | None,
    name: str,
) -> int:
    """The rest of :func:`main`: serve, as a lone server, a worker or the supervisor."""
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
            notifier=_notifier,
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

    Whoever started the process under systemd hears of each step (``READY=1`` once
    it listens, ``RELOADING=1`` and ``READY=1`` around a reload, ``STOPPING=1``, the
    watchdog's pings): systemd itself, or the supervisor, which tells systemd once
    every worker has (see :func:`main`).
    """
    notifier = _notifier
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        trio.open_signal_receiver(signal.SIGHUP) as hangups,
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(dump_tasks_on_signal)
            if notifier.watchdog_interval is not None:
                # From the start: loading a large store must not look like a hang.
                nursery.start_soon(_ping_watchdog, notifier, notifier.watchdog_interval)
            server = await start(nursery)
            said = ready(server)
            nursery.start_soon(_reload_on_hangups, hangups, server, reload, notifier, said.line())
            announce_ready(said)
            notifier.ready(said.line())
            async for _ in signals:
                break
            notifier.stopping()
            if stop is not None:
                await stop(server)
            nursery.cancel_scope.cancel()
    return server


async def _reload_on_hangups(
    hangups: AsyncIterator[int], server: S, reload: Callable[[S], None] | None, notifier: Notifier, status: str
) -> None:
    """Each SIGHUP (one that came while the server started included): ``reload(server)``."""
    async for _ in hangups:
        # Said even with nothing to reload: systemd's Type=notify-reload waits for both.
        notifier.reloading()
        if reload is None:
            logger.info("SIGHUP: this server has no files to reload")
        else:
            reload(server)
        notifier.ready(status)


async def _ping_watchdog(notifier: Notifier, interval: float) -> None:
    """``WATCHDOG=1`` every ``interval`` seconds: a stuck event loop misses them, and
    systemd restarts the service."""
    while True:
        notifier.watchdog()
        await trio.sleep(interval)
