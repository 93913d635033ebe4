"""A throwaway ``redis-server`` on a loopback port, for the fleet load test, the fleet
benchmark and the tests that need a real Redis.

No persistence (``--save ''``, ``--appendonly no``): :meth:`RedisServer.restart`
brings back an *empty* server on the same port, as a Redis restarted without
persistence comes back in production. Stopped by its PID, never by name.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .processes import free_port, stop

__all__ = ["RedisServer", "ask", "redis_server_binary", "running_redis"]


def redis_server_binary() -> str | None:
    """``redis-server``'s path, or None if it is not installed."""
    found = shutil.which("redis-server")
    if found:
        return found
    # Debian installs it in /usr/bin, but a PATH trimmed by a test runner may miss it.
    return "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None


def _ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def ask(port: int, *words: str, timeout: float = 1.0) -> list[str]:
    """One command to a Redis or Sentinel on ``port``, its reply's lines (RESP, loosely)."""
    request = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request.encode())
        data = s.recv(65536)
        s.settimeout(0.05)  # the rest of a reply follows at once on loopback
        with contextlib.suppress(TimeoutError):
            while chunk := s.recv(65536):
                data += chunk
    return [line for line in data.decode(errors="replace").split("\r\n") if line and line[0] not in "*$"]


class RedisServer:
    """``redis-server`` on ``127.0.0.1:port`` (a free one by default), without persistence."""

    def __init__(self, port: int | None = None, binary: str | None = None, extra: Sequence[str] = ()) -> None:
        found = binary or redis_server_binary()
        if found is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = found
        self.port = port if port is not None else free_port()
        self.extra = list(extra)
        """More options (``--replicaof 127.0.0.1 PORT`` for a replica)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``: what the gateways are given (``--cluster``)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The running server's PID (a new one after each restart)."""
        return None if self.proc is None or self.proc.poll() is not None else self.proc.pid

    def start(self, timeout: float = 10.0) -> None:
        """Start it and return once it answers PING."""
        assert self.proc is None, "already running"
        cmd = [self.binary, "--save", "", "--appendonly", "no", "--bind", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--daemonize", "no", "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                raise RuntimeError(f"redis-server exited with {code} at start (port {self.port} taken?)")
            if _ping(self.port):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout} s")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM it by its PID (SIGKILL after ``timeout``) and reap it."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop(proc, timeout)

    def kill(self) -> None:
        """SIGKILL it by its PID (a machine lost: no shutdown, no last write) and reap it."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        """Stop it (if running), then start an empty server on the same port."""
        self.stop()
        self.restarts += 1
        self.start()


@contextlib.contextmanager
def running_redis(binary: str | None = None) -> Iterator[RedisServer]:
    """A started :class:`RedisServer`, stopped on exit."""
    server = RedisServer(binary=binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()
