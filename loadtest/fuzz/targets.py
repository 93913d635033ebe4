"""The servers a fuzz run targets: how each is started, with which short timeouts, and
how long it may keep a connection open.

Each server runs with short timeouts (:data:`MQTT_SERVER_ARGS`, :data:`HTTP_SERVER_ARGS`)
so that a connection left open is closed by the server within seconds; its stderr goes
to a file the judge reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from servers.readiness import find_ready

from ..processes import stop
from .canary import CANARY_KEEPALIVE, HTTP_KEEPALIVE_TIMEOUT

__all__ = [
    "HTTP_SERVER_ARGS",
    "MQTT_SERVER_ARGS",
    "ROOT",
    "ServerSpec",
    "http_spec",
    "mqtt_spec",
    "start_server",
]

ROOT = Path(__file__).resolve().parents[2]
"""The repository: the servers and the canary run from here, so ``-m`` finds them."""

MQTT_SERVER_ARGS = (
    "--tick",
    "0.05",
    "--connect-timeout",
    "1",
    "--max-keepalive",
    str(CANARY_KEEPALIVE),
    "--max-idle",
    str(CANARY_KEEPALIVE),
    "--send-timeout",
    "2",
    "--session-expiry",
    "30",
    "--presence-offline-ttl",
    "30",
    "--max-retained-bytes",
    "262144",
)
"""The heartbeat server's options for a fuzz run: every connection is closed by the
server within 1.5 × 2 s of its last byte, persistent sessions and offline presence
are forgotten after 30 s, and retained messages are capped at 256 KiB, so a long run
exercises those bounds instead of filling memory up to the defaults'."""
MQTT_LONGEST = 1.5 * CANARY_KEEPALIVE
"""Seconds the server may leave a connection open with those options (1.5 × the keep-alive cap)."""

HTTP_SERVER_ARGS = (
    "--tick",
    "0.05",
    "--keep-alive-timeout",
    f"{HTTP_KEEPALIVE_TIMEOUT:g}",
    "--header-timeout",
    "1",
    "--body-timeout",
    "1",
    "--send-timeout",
    "2",
)
"""The HTTP server's options for a fuzz run: idle connections closed after 2 s, heads
and bodies that stall answered 408 after 1 s."""
HTTP_LONGEST = HTTP_KEEPALIVE_TIMEOUT
"""Seconds the server may leave a connection open with those options (its keep-alive timeout)."""

WAIT_MARGIN = 2.0
"""Seconds beyond the server's longest timeout a connection may stay open (ticks,
lingering closes, a loaded machine)."""


@dataclass
class ServerSpec:
    """How to start the server under test, and what to expect of it."""

    name: str
    """``mqtt-dense``, ``mqtt-streams``, ``http``, or a test's own."""
    protocol: str
    command: list[str]
    """argv without the port: ``--port N`` is appended."""
    ready: str
    """The name in its readiness line (:mod:`servers.readiness`)."""
    longest: float
    """Seconds the server may keep a connection open, at most."""
    presence_log: bool = False
    """Give it ``--presence-log FILE`` (MQTT): the judge matches every connection's end there."""
    env: dict[str, str] | None = None

    @property
    def wait(self) -> float:
        """Seconds a half-closed connection, or one left to the server, may stay open."""
        return self.longest + WAIT_MARGIN


def mqtt_spec(engine: str) -> ServerSpec:
    """``python -m servers.heartbeat`` on ``engine``, one worker, with a presence log."""
    cmd = [sys.executable, "-m", "servers.heartbeat", "--workers", "1", "--engine", engine, *MQTT_SERVER_ARGS]
    return ServerSpec(f"mqtt-{engine}", "mqtt", cmd, "heartbeat", MQTT_LONGEST, presence_log=True)


def http_spec() -> ServerSpec:
    """``python -m servers.http``, one worker."""
    cmd = [sys.executable, "-m", "servers.http", "--workers", "1", *HTTP_SERVER_ARGS]
    return ServerSpec("http", "http", cmd, "http", HTTP_LONGEST)


def start_server(
    spec: ServerSpec, port: int, log: Path, extra: Sequence[str] = (), timeout: float = 30.0
) -> subprocess.Popen[bytes]:
    """Start ``spec`` on ``port`` (with ``extra`` arguments) with its stderr in ``log``;
    return once it says it listens."""
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [*spec.command, *extra, "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=ROOT,
            env={**os.environ, **spec.env} if spec.env else None,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if find_ready(log.read_text(errors="replace"), spec.ready):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop(proc)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
    raise RuntimeError(f"{spec.name} did not start on port {port}:\n{tail}")
