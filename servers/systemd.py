"""Telling systemd how the server is doing: the ``sd_notify`` protocol, without libsystemd.

A service of ``Type=notify`` is started with ``NOTIFY_SOCKET`` in its environment: a
datagram socket (a path, or ``@name`` for one in the abstract namespace) to which it
sends lines such as ``READY=1`` once it serves, ``RELOADING=1`` while it reloads its
files, ``STOPPING=1`` as its shutdown begins, and ``WATCHDOG=1`` every so often when
``WATCHDOG_USEC`` asks for it. Without ``NOTIFY_SOCKET`` a :class:`Notifier` does
nothing, so the servers call it unconditionally.

Only the process systemd started may speak to it. A supervisor's workers are given
their own channel instead (:data:`WORKER_NOTIFY_FD_ENV`, one end of a socket pair)
over which they send the same lines to the supervisor, which tells systemd it is
ready once every worker has said so (:class:`WorkerGate`).

Nothing here raises on a socket error: a server that cannot reach systemd serves all
the same, and says so once in its log.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Mapping, MutableMapping

__all__ = [
    "WATCHDOG_ENV",
    "WORKER_NOTIFY_FD_ENV",
    "Notifier",
    "WorkerGate",
    "parse_message",
    "worker_environ",
]

logger = logging.getLogger("servers.systemd")

WORKER_NOTIFY_FD_ENV = "IDLEKEEPER_NOTIFY_FD"
"""In a supervised worker's environment: the descriptor on which it tells its
supervisor what it would otherwise tell systemd."""

WATCHDOG_ENV = ("WATCHDOG_USEC", "WATCHDOG_PID")
"""What systemd sets for ``WatchdogSec=``: the interval, and which process it watches."""

_SYSTEMD_ENV = ("NOTIFY_SOCKET", *WATCHDOG_ENV)

# A datagram to a full queue blocks; the server must not stall on systemd for long.
_SEND_TIMEOUT = 1.0


def _address(value: str) -> str | bytes | None:
    """``NOTIFY_SOCKET`` as a socket address: a path, or ``@name`` in the abstract
    namespace (a leading NUL byte). None for what we cannot reach (``vsock:``...)."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    return None


class Notifier:
    """A client of systemd's notification socket (or a supervisor's, in a worker).

    ``address`` is where datagrams go (None: nowhere, every call does nothing);
    ``sock``, a connected socket to send on instead (a worker's end of the pair its
    supervisor made). ``watchdog_usec`` is systemd's ``WATCHDOG_USEC``, for this
    process.
    """

    def __init__(
        self,
        address: str | bytes | None = None,
        *,
        sock: socket.socket | None = None,
        watchdog_usec: int | None = None,
    ) -> None:
        self._address = address
        self._sock = sock
        self._failed = False
        self.watchdog_interval: float | None = None
        """Seconds between ``WATCHDOG=1`` pings (half systemd's timeout), or None: no watchdog."""
        if watchdog_usec is not None and watchdog_usec > 0 and self.enabled:
            self.watchdog_interval = watchdog_usec / 2e6

    @classmethod
    def from_environ(
        cls, environ: MutableMapping[str, str] | None = None, *, worker: bool = False, unset: bool = False
    ) -> Notifier:
        """The notifier the environment asks for: systemd's (``NOTIFY_SOCKET``), or in a
        ``worker``, its supervisor's (:data:`WORKER_NOTIFY_FD_ENV`); else one that does nothing.

        With ``unset``, both are taken out of ``environ`` (``os.environ`` by default):
        the processes this one starts (a supervisor's workers, an app's helpers) must
        not speak for it.
        """
        env = os.environ if environ is None else environ
        fd = env.get(WORKER_NOTIFY_FD_ENV)
        notify = env.get("NOTIFY_SOCKET")
        watchdog = _watchdog_usec(env)
        if unset:
            for name in (*_SYSTEMD_ENV, WORKER_NOTIFY_FD_ENV):
                env.pop(name, None)
        if worker:
            # Never systemd's socket: only the process systemd started may use it.
            if fd is None:
                return cls()
            try:
                sock = socket.socket(fileno=int(fd))
                sock.settimeout(_SEND_TIMEOUT)
            except (ValueError, OSError) as exc:
                logger.warning("cannot use the supervisor's notification descriptor %s: %s", fd, exc)
                return cls()
            return cls(sock=sock)
        if not notify:
            return cls()
        address = _address(notify)
        if address is None:
            logger.warning("NOTIFY_SOCKET=%s is not a Unix socket this server can reach; not notifying", notify)
            return cls()
        return cls(address, watchdog_usec=watchdog)

    @property
    def enabled(self) -> bool:
        """Whether anybody listens."""
        return self._address is not None or self._sock is not None

    def send(self, *fields: str) -> bool:
        """Send ``fields`` (``"READY=1"``...) as one datagram; whether it went.

        A failure is logged once, not raised: the server serves regardless.
        """
        if not self.enabled or not fields:
            return False
        data = ("\n".join(fields) + "\n").encode()
        try:
            if self._sock is None:
                assert self._address is not None  # enabled
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.settimeout(_SEND_TIMEOUT)
                self._sock.connect(self._address)
            self._sock.send(data)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                where = self._address if self._address is not None else "the supervisor"
                logger.warning("cannot notify %r (%s); going on without", where, exc.strerror or exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: the service serves (the first time, or again after a reload)."""
        fields = ["READY=1", f"MAINPID={os.getpid()}"]
        if status is not None:
            fields.append(f"STATUS={_one_line(status)}")
        return self.send(*fields)

    def reloading(self) -> bool:
        """``RELOADING=1``, with the ``MONOTONIC_USEC`` that ``Type=notify-reload`` wants."""
        return self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: the shutdown has begun."""
        fields = ["STOPPING=1"]
        if status is not None:
            fields.append(f"STATUS={_one_line(status)}")
        return self.send(*fields)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: still alive."""
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        """Close the socket (sending again reopens it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(text: str) -> str:
    # A newline would end the field: the rest would read as another assignment.
    return " ".join(text.split("\n"))


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    """``WATCHDOG_USEC`` if it is meant for this process (``WATCHDOG_PID`` is ours or absent)."""
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    try:
        if pid is not None and int(pid) != os.getpid():
            return None
        return int(usec) if usec is not None else None
    except ValueError:
        return None


def parse_message(data: bytes) -> dict[str, str]:
    """A notification datagram's fields (``{"READY": "1", "MAINPID": "12"}``); lines
    that are no assignment are skipped."""
    fields = {}
    for line in data.decode(errors="replace").split("\n"):
        name, eq, value = line.partition("=")
        if eq and name:
            fields[name] = value
    return fields


def worker_environ(environ: Mapping[str, str], fd: int | None) -> dict[str, str]:
    """A supervised worker's environment: systemd's variables out (it is not the
    process systemd watches), the supervisor's channel ``fd`` in (if any)."""
    env = {k: v for k, v in environ.items() if k not in _SYSTEMD_ENV and k != WORKER_NOTIFY_FD_ENV}
    if fd is not None:
        env[WORKER_NOTIFY_FD_ENV] = str(fd)
    return env


class WorkerGate:
    """A supervisor's side of its workers' notifications: tells systemd (``notifier``)
    ``READY=1`` once every worker has said it serves, and again after a reload once
    every worker has reloaded.

    Sans-I/O: the supervisor feeds it each datagram (:meth:`heard`) and asks it to look
    (:meth:`check`) with the PIDs of its workers and whether each still runs.
    ``describe(statuses)`` makes the ``STATUS=`` line from the workers' own.
    """

    def __init__(self, notifier: Notifier, describe: Callable[[list[str]], str] | None = None) -> None:
        self.notifier = notifier
        self._describe = describe
        self._ready: set[int] = set()
        self._statuses: dict[int, str] = {}
        self.announced = False
        """Whether systemd was told ``READY=1`` (since the last reload)."""

    def heard(self, data: bytes) -> None:
        """A worker's datagram: ``READY=1`` with its ``MAINPID`` counts it in."""
        fields = parse_message(data)
        pid = fields.get("MAINPID", "")
        if fields.get("READY") == "1" and pid.isdigit():
            self._ready.add(int(pid))
            if "STATUS" in fields:
                self._statuses[int(pid)] = fields["STATUS"]

    def check(self, workers: Collection[int], expected: int) -> bool:
        """Tell systemd ``READY=1`` if ``expected`` workers run (``workers``: their PIDs)
        and each has said it serves; whether it was told (now or before)."""
        if self.announced:
            return True
        if len(workers) < expected or not set(workers) <= self._ready:
            return False
        statuses = [self._statuses[pid] for pid in workers if pid in self._statuses]
        self.notifier.ready(self._describe(statuses) if self._describe is not None else None)
        self.announced = True
        return True

    def reloading(self) -> None:
        """The supervisor was told to reload (and passes it on): ``RELOADING=1``, and
        ``READY=1`` again only once every worker has reloaded."""
        if not self.announced:
            return  # still starting: the workers' first READY=1 stands for the reload too
        self.announced = False
        self._ready.clear()
        self._statuses.clear()
        self.notifier.reloading()
