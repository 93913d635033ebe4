"""A throwaway ``redis-server`` on a free loopback port, for tests that need a real Redis.

No persistence (``--save ''``, ``--appendonly no``): :meth:`RedisServer.restart`
brings back an *empty* server on the same port, as a Redis restarted without
persistence would come back in production.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RedisServer", "redis_binary", "running_redis"]


def redis_binary() -> str | None:
    """The ``redis-server`` executable, or None if it is not installed."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    # Debian installs it in /usr/bin, but a PATH trimmed by a test runner may miss it.
    return "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process; :meth:`start`, :meth:`stop` and :meth:`restart` it."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port if port is not None else _free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return None if self._process is None else self._process.pid

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        assert self._process is None, "already running"
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--daemonize", "no", "--loglevel", "warning"]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                self._process = None
                raise RuntimeError(f"redis-server exited at start: {err.strip()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {timeout} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGTERM to its PID, SIGKILL if it lingers) and reap it."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()

    def restart(self) -> None:
        """Stop, then start an empty server on the same port."""
        self.stop()
        self.start()


@contextlib.contextmanager
def running_redis(binary: str | None = None) -> Iterator[RedisServer]:
    """A started :class:`RedisServer`, stopped on exit."""
    found = binary or redis_binary()
    if found is None:
        raise RuntimeError("redis-server is not installed")
    server = RedisServer(found)
    server.start()
    try:
        yield server
    finally:
        server.stop()
