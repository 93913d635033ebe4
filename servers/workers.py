"""The supervisor: worker processes on one port (SO_REUSEPORT), kept up.

Shared by every server in ``servers/``. Several processes are how a server holds
more connections than one process's open-file limit allows, and how it uses every
core (see :mod:`servers.listeners`).

The supervisor is plain blocking Python (no trio): it starts the workers, restarts
any that dies (with a back-off, so a worker that crashes at start-up cannot spin; and
it gives up, stopping them all, on a worker that cannot start: at once if it exits
with :data:`CANNOT_START`, after :data:`START_TRIES` failed starts in a row otherwise),
passes SIGHUP on to every worker (each reloads its files), and SIGUSR1 (each logs its
tasks, :mod:`servers.taskdump`), and on SIGINT or SIGTERM
stops them all by PID, waits for their clean shutdown, and kills whatever is left
after the grace period. Under systemd it is the main process, and the only one that
speaks to it: it says ``READY=1`` once every worker has told it it listens
(:mod:`servers.systemd`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from .bus import Hub
from .listeners import reserve_port
from .readiness import find_ready, netloc
from .systemd import Notifier, WorkerGate, worker_environ

__all__ = [
    "CANNOT_START",
    "as_typed",
    "START_TRIES",
    "START_WINDOW",
    "SUPERVISOR_PID_ENV",
    "die_with_supervisor",
    "module_command",
    "run_supervised",
    "supervise",
    "supervisor_pid",
]

CANNOT_START = 3
"""A worker's exit code for "I cannot start, and trying again will not help" (a taken
port, an app whose start-up failed: uvicorn's code for that). The supervisor stops
every worker and exits with it."""

START_TRIES = 5
START_WINDOW = 10.0
"""Failed starts in a row (exits on their own within :data:`START_WINDOW` seconds of
starting) after which the supervisor stops trying, stops every worker, and exits 1:
systemd's default limit (``StartLimitBurst=5`` in ``StartLimitIntervalSec=10s``). A
worker killed by a signal (``kill -9``, the OOM killer) is always restarted: its next
start may well work."""

SUPERVISOR_PID_ENV = "IDLEKEEPER_SUPERVISOR_PID"
"""Set in each worker's environment: the PID of the supervisor that started it."""

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

logger = logging.getLogger("servers.workers")


def supervise(
    command: Callable[[int], Sequence[str]],
    workers: int,
    *,
    grace: float = 10.0,
    restart_backoff: float = 1.0,
    on_ready: Callable[[list[int]], None] | None = None,
    hub: Hub | None = None,
    notifier: Notifier | None = None,
    describe: Callable[[list[str]], str] | None = None,
) -> int:
    """Run ``workers`` processes (``command(index)`` is each one's argv) until a signal.

    Returns 0 after a clean stop. A worker that exits is restarted, no sooner than
    ``restart_backoff`` seconds after its previous start (doubling while it keeps
    dying young, up to a minute). A worker that cannot start ends the supervisor: one
    that exits with :data:`CANNOT_START` at once (returns it), one that exits on its
    own soon after its start :data:`START_TRIES` times in a row after that
    many tries (returns 1). The worker has said why on stderr.

    With a ``notifier`` that speaks to systemd (:mod:`servers.systemd`), the workers
    get a channel to the supervisor instead of systemd's socket; systemd is told
    ``READY=1`` once every worker has said it serves (``describe(statuses)`` makes its
    ``STATUS=``, from the workers'), ``RELOADING=1`` on SIGHUP, ``STOPPING=1`` as the
    shutdown begins, and ``WATCHDOG=1`` if it asks.
    """
    stopping = False
    gave_up = 0

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    procs: dict[int, subprocess.Popen[bytes]] = {}
    told = _Told(notifier, describe)

    def pass_on(signum: int, frame: object) -> None:
        # SIGHUP is the operator's "reload your files", SIGUSR1 "show your tasks"
        # (servers.taskdump): each worker does it for itself.
        if signum == signal.SIGHUP and told.gate is not None:
            told.gate.reloading()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)  # by PID

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in (signal.SIGHUP, signal.SIGUSR1):
        previous[sig] = signal.signal(sig, pass_on)
    started: dict[int, float] = {}
    backoff = dict.fromkeys(range(workers), restart_backoff)
    restart_at: dict[int, float] = {}
    failures = dict.fromkeys(range(workers), 0)

    waiter = _Waiter(hub)
    if told.gate is not None:
        waiter.listen(told)

    def start(index: int) -> None:
        env = {**worker_environ(os.environ, told.worker_fd), SUPERVISOR_PID_ENV: str(os.getpid())}
        old = procs.get(index)
        if old is not None:
            waiter.forget(old.pid)
        kept = () if told.worker_fd is None else (told.worker_fd,)
        procs[index] = subprocess.Popen(list(command(index)), env=env, pass_fds=kept)
        waiter.watch(procs[index].pid)
        started[index] = time.monotonic()

    try:
        for index in range(workers):
            start(index)
        if on_ready is not None:
            on_ready([p.pid for p in procs.values()])
        while not stopping:
            # Sleeps until a worker exits, a worker's line needs relaying, a signal comes
            # or a restart is due: no periodic wake-up to look for any of them.
            soonest = min([*restart_at.values(), *told.due()], default=math.inf) - time.monotonic()
            due = None if hub is None else hub.wake_in()
            waiter.wait(max(0.0, min(soonest, _LONGEST_SLEEP, math.inf if due is None else due)))
            told.after_wait(procs.values(), workers)
            if due is not None and hub is not None:
                hub.tick()  # a timed commit of the hub's handler (a durable store's)
            now = time.monotonic()
            for index, proc in list(procs.items()):
                code = proc.poll()
                if code is None or stopping:
                    continue
                if index not in restart_at:
                    waiter.forget(proc.pid)  # its pidfd stays readable: it would end every sleep
                    if hub is not None:
                        hub.process_exited(proc.pid, code)  # its sessions, before a new worker's
                    # Died young: back off (doubling, up to a minute); lived long: start again soon.
                    young = now - started[index] < 60
                    backoff[index] = min(backoff[index] * 2, 60.0) if young else restart_backoff
                    restart_at[index] = started[index] + backoff[index]
                    # Killed by a signal (negative code): not the worker's own failure to start.
                    failed = code > 0 and now - started[index] < START_WINDOW
                    failures[index] = failures[index] + 1 if failed else 0
                    if code == CANNOT_START or failures[index] >= START_TRIES:
                        gave_up = code if code == CANNOT_START else 1
                        why = "cannot start" if code == CANNOT_START else f"failed {failures[index]} starts in a row"
                        print(
                            f"supervisor: worker {index} (pid {proc.pid}) {why} (exit {code}); stopping every worker",
                            file=sys.stderr,
                        )
                        stopping = True
                        break
                    print(f"supervisor: worker {index} (pid {proc.pid}) exited with {code}", file=sys.stderr)
                if now >= restart_at[index]:
                    del restart_at[index]
                    start(index)
        return gave_up
    finally:
        told.stopping()
        if hub is not None:
            hub.stopping()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # by PID, never by name
        deadline = time.monotonic() + grace
        # The hub keeps relaying while workers shut down: their last events must reach
        # the other workers' subscribers (a shutdown's two phases go through it).
        while True:
            for proc in procs.values():
                if proc.poll() is not None:
                    waiter.forget(proc.pid)
            if all(p.returncode is not None for p in procs.values()):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waiter.wait(min(left, _LONGEST_SLEEP))
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if hub is not None:
                hub.process_exited(proc.pid, proc.returncode)
        waiter.close()
        told.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Told:
    """What the supervisor tells systemd, and hears from its workers to do it: nothing
    at all without a notifier that speaks to systemd."""

    def __init__(self, notifier: Notifier | None, describe: Callable[[list[str]], str] | None) -> None:
        self.notifier = notifier
        self.gate: WorkerGate | None = None
        self.worker_fd: int | None = None
        self._ours: socket.socket | None = None
        self._theirs: socket.socket | None = None
        self._next_ping = math.inf
        if notifier is None or not notifier.enabled:
            return
        self.gate = WorkerGate(notifier, describe)
        # One pair for every worker: a datagram is never split, so their lines cannot mix.
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._ours.setblocking(False)
        self.worker_fd = self._theirs.fileno()
        if notifier.watchdog_interval is not None:
            self._next_ping = time.monotonic()

    def fileno(self) -> int:
        """The supervisor's end, which the workers write to."""
        assert self._ours is not None
        return self._ours.fileno()

    def poll(self, timeout: float) -> None:
        """Take in every datagram waiting (the waiter calls it when one is)."""
        if self._ours is None or self.gate is None:
            return
        while True:
            try:
                data = self._ours.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            self.gate.heard(data)

    def due(self) -> tuple[float, ...]:
        """When the supervisor must wake to ping systemd's watchdog (if it asked)."""
        return () if self._next_ping == math.inf else (self._next_ping,)

    def after_wait(self, procs: Collection[subprocess.Popen[bytes]], workers: int) -> None:
        """After each sleep: ``READY=1`` if every worker serves, the watchdog's ping if due."""
        if self.gate is None or self.notifier is None:
            return
        live = [p.pid for p in procs if p.poll() is None]
        self.gate.check(live, workers)
        interval = self.notifier.watchdog_interval
        if interval is not None and time.monotonic() >= self._next_ping:
            self.notifier.watchdog()
            self._next_ping = time.monotonic() + interval

    def stopping(self) -> None:
        """``STOPPING=1``: the supervisor stops its workers."""
        if self.gate is not None and self.notifier is not None:
            self.notifier.stopping()

    def close(self) -> None:
        """Close the workers' channel."""
        for sock in (self._ours, self._theirs):
            if sock is not None:
                sock.close()


# Even with nothing to wake it, the supervisor looks around this often.
_LONGEST_SLEEP = 1.0
# Where a worker's exit cannot be waited for (no pidfd: Linux before 5.3, or not the
# main thread), the supervisor polls for it this often instead.
_POLL_INTERVAL = 0.05


class _Source(Protocol):
    """Something the supervisor's sleep also watches (the hub, the workers' notifications)."""

    def fileno(self) -> int: ...

    def poll(self, timeout: float) -> object: ...


class _Waiter:
    """The supervisor's sleep: until a worker exits (a pidfd per worker), the hub has
    lines to move (its epoll set, nested in ours), or a signal arrives (the wake-up fd).

    A supervisor of 29 workers that polled every 50 ms woke 20 times a second and
    spent 0.3% of a core doing it with nothing to do. Where pidfds or the wake-up fd
    are missing it falls back to that polling.
    """

    def __init__(self, hub: Hub | None) -> None:
        self._hub = hub
        self._sel = selectors.DefaultSelector()
        self._pidfds: dict[int, int] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._previous_wakeup: int | None = None
        # pidfds alone do not end a sleep for SIGTERM: Python retries an interrupted
        # select after running the handler, so the signal must make a descriptor readable.
        try:
            self._previous_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
            self.exact = hasattr(os, "pidfd_open")
        except ValueError:  # not the main thread
            self.exact = False
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        if hub is not None:
            self._sel.register(hub.fileno(), selectors.EVENT_READ, hub)

    def listen(self, source: _Source) -> None:
        """Wake when ``source`` has something to read, and have it read it (``source.poll(0)``)."""
        self._sel.register(source.fileno(), selectors.EVENT_READ, source)

    def watch(self, pid: int) -> None:
        """Wake when process ``pid`` exits."""
        if not self.exact:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            self.exact = False  # an old kernel: poll instead
            return
        self._pidfds[pid] = fd
        self._sel.register(fd, selectors.EVENT_READ, None)

    def forget(self, pid: int) -> None:
        """Stop watching ``pid`` (it was reaped)."""
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            self._sel.unregister(fd)
            os.close(fd)

    def wait(self, timeout: float) -> None:
        """Sleep at most ``timeout`` seconds, relaying the hub's lines if it has some."""
        if not self.exact:
            timeout = min(timeout, _POLL_INTERVAL)
        try:
            ready = self._sel.select(timeout)
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            return
        for key, _events in ready:
            if key.data is None:
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while self._wake_r.recv(4096):
                            pass
                continue
            try:
                key.data.poll(0)
            except Exception:
                # A fault in the relay must not take the supervisor (and so every worker) down.
                logger.exception("supervisor: reading %r failed; going on", key.data)

    def close(self) -> None:
        """Put the signal wake-up back and close the descriptors."""
        if self._previous_wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
        for pid in list(self._pidfds):
            self.forget(pid)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


def run_supervised(
    module: str,
    argv: Sequence[str],
    *,
    host: str,
    port: int,
    workers: int,
    grace: float = 10.0,
    worker_args: Callable[[int], Sequence[str]] = lambda index: (),
    hub: Hub | None = None,
    notifier: Notifier | None = None,
) -> int:
    """Run ``python -m <module> <argv>`` as ``workers`` processes on one port, supervised
    (each imports the module from where this process did, whatever its working directory holds).

    Each worker gets ``--port`` (a reserved one if ``port`` is 0), ``--worker-index``
    and ``worker_args(index)`` appended to the parent's own arguments. ``notifier``
    is systemd's (see :func:`supervise`).
    """
    holder = None
    if port == 0:
        port, holder = reserve_port(host)
    base = [*module_command(module), *argv]

    def command(index: int) -> list[str]:
        return [*base, "--port", str(port), "--worker-index", str(index), *worker_args(index)]

    name = module.rsplit(".", 1)[-1]

    def ready(pids: list[int]) -> None:
        print(f"{name}: supervisor pid {os.getpid()}, workers {pids}, port {port}", file=sys.stderr, flush=True)

    def describe(statuses: list[str]) -> str:
        # systemctl status shows it: where the service listens, not each worker's line.
        text = f"{name}: {workers} workers listening on {netloc(host, port)}"
        found = [r for status in statuses for r in find_ready(status)]
        ports = sorted(r.status_port for r in found if r.status_port is not None)
        if ports:
            where = netloc(found[0].status_host or host, ports[0])
            text += f", status on {where}" + (f"-{ports[-1]}" if ports[-1] != ports[0] else "")
        return text

    try:
        return supervise(command, workers, grace=grace, on_ready=ready, hub=hub, notifier=notifier, describe=describe)
    finally:
        if holder is not None:
            holder.close()


# ``python -m`` puts the working directory first on sys.path, so an operator's own
# ``servers/`` folder there would stand in for ours. A worker is started with the
# directory our package was imported from in its place, then runs the module as -m would.
_WORKER_BOOT = (
    "import runpy, sys; sys.path[0] = sys.argv[1]; module = sys.argv[2]; del sys.argv[1:3]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def module_command(module: str) -> list[str]:
    """``python -m module`` as a child process's argv, with ``module`` imported from where
    our packages were (the directory ``servers`` came from), not from the working directory."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-c", _WORKER_BOOT, root, module]


def as_typed(argv: Sequence[str]) -> list[str]:
    """A child's argv as an operator would type it: ``python -m module ...`` for one made
    with :func:`module_command` (for reports and reproducers)."""
    if len(argv) >= 5 and argv[1:3] == ["-c", _WORKER_BOOT]:
        return ["python", "-m", *argv[4:]]
    return ["python", *argv[1:]]


def supervisor_pid() -> int | None:
    """In a supervised worker, the supervisor's PID; None otherwise."""
    value = os.environ.get(SUPERVISOR_PID_ENV)
    return int(value) if value else None


def die_with_supervisor(sig: int = signal.SIGTERM) -> None:
    """In a worker: have the kernel send ``sig`` when the supervisor dies.

    A supervisor killed with SIGKILL cannot stop its workers; left alone they would
    go on holding the port as orphans, with nobody to restart them or relay between
    them. With the parent-death signal (``PR_SET_PDEATHSIG``, Linux) the worker gets
    SIGTERM and shuts down as if asked: its devices end with ``shutdown`` events and
    the port is freed. If the supervisor is already gone by the time this runs (it
    died while the worker started), the signal is sent to ourselves at once.
    Elsewhere than Linux, or outside a supervisor, it does nothing.
    """
    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if supervisor is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("workers: prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return
    if os.getppid() != int(supervisor):
        os.kill(os.getpid(), sig)
