"""The servers a fuzz run targets: how each is started, with which short timeouts, and
how long it may keep a connection open.

Each server runs with short timeouts (:data:`MQTT_SERVER_ARGS`, :data:`HTTP_SERVER_ARGS`)
so that a connection left open is closed by the server within seconds; its stderr goes
to a file the judge reads.

Mosquitto (:func:`mosquitto_spec`) runs as its peer, from a config file
(:data:`MOSQUITTO_CONFIG`), with no presence log and a canary without a presence
subscriber; it keeps a connection that never sends its CONNECT about 90 s (and a 3.1.1
one with keep-alive 0 for ever), which is counted rather than failed.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from servers.readiness import find_ready
from servers.workers import module_command

from ..mqtt_targets import mosquitto_binary
from ..processes import stop, wait_listening
from .canary_http import HTTP_KEEPALIVE_TIMEOUT
from .canary_mqtt import CANARY_KEEPALIVE
from .canary_ws import WS_PING_INTERVAL, WS_PING_TIMEOUT
from .mutators_ws_framing import MAX_SIZE
from .mutators_ws_handshake import ALLOWED_ORIGIN

__all__ = [
    "HTTP_SERVER_ARGS",
    "MOSQUITTO_CONFIG",
    "MQTT_SERVER_ARGS",
    "ROOT",
    "WS_SERVER_ARGS",
    "ServerSpec",
    "http_spec",
    "mosquitto_spec",
    "mqtt_spec",
    "mqtt_ws_spec",
    "start_server",
    "ws_spec",
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

WS_CLOSE_TIMEOUT = 1.0
WS_SERVER_ARGS = (
    *HTTP_SERVER_ARGS,
    "--ws-max-size",
    str(MAX_SIZE),
    "--ws-ping-interval",
    f"{WS_PING_INTERVAL:g}",
    "--ws-ping-timeout",
    f"{WS_PING_TIMEOUT:g}",
    "--ws-close-timeout",
    f"{WS_CLOSE_TIMEOUT:g}",
)
"""The HTTP server's options for a WebSocket fuzz run: those of an HTTP one, messages
bounded at 64 KiB (so 1009 is cheap to reach), a silent WebSocket closed 2 s after its
last byte (1011), and 1 s for the client's answer to a close."""
WS_APP = "loadtest.asgi_app:app"
"""The ASGI app the WebSocket inputs go to: an echo at any path."""
WS_LONGEST = max(HTTP_KEEPALIVE_TIMEOUT, WS_PING_INTERVAL + WS_PING_TIMEOUT) + WS_CLOSE_TIMEOUT
"""Seconds the server may leave a WebSocket open with those options: the ping window,
then the close's."""

MOSQUITTO_CONFIG = """\
listener {port} 127.0.0.1
allow_anonymous true
persistence false
log_dest stderr
log_type error
log_type warning
max_keepalive 10
max_packet_size 262144
"""
"""Mosquitto's config for a fuzz run: anonymous, no persistence, a 5.0 client's keep-alive
capped at 10 s (its Server Keep Alive; the least Mosquitto takes), packets capped at 256 KiB
as ours are."""
MOSQUITTO_LONGEST = 8.0
"""Seconds Mosquitto takes to close a connection of keep-alive 1 or 2 s: 1.5 x that, plus
its keep-alive sweep every 5-6 s."""
MOSQUITTO_HOLDS = (
    "Mosquitto keeps a connection that has not sent a whole CONNECT about 90 s, "
    "a 3.1.1 one with keep-alive 0 for ever, and others 1.5 x their keep-alive (10 s at most for 5.0)"
)

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
    """Give it ``--presence-log FILE`` (MQTT): the judge matches every connection's end there,
    and the canary subscribes to its devices' presence."""
    env: dict[str, str] | None = None
    ws_port: bool = False
    """Give it ``--ws-port`` on a second free port (MQTT over WebSockets), where the inputs
    and the canary go."""
    config: str | None = None
    """A config file to start it with (``-c FILE``; ``{port}`` in it is the port), instead of
    ``--port N``; it is ready once it accepts connections (Mosquitto)."""
    holds: str = ""
    """Why it may keep connections open past :attr:`wait` by design (a peer): counted, not failed."""

    @property
    def wait(self) -> float:
        """Seconds a half-closed connection, or one left to the server, may stay open."""
        return self.longest + WAIT_MARGIN


def mqtt_spec(engine: str) -> ServerSpec:
    """``python -m servers.heartbeat`` on ``engine``, one worker, with a presence log."""
    cmd = [*module_command("servers.heartbeat"), "--workers", "1", "--engine", engine, *MQTT_SERVER_ARGS]
    return ServerSpec(f"mqtt-{engine}", "mqtt", cmd, "heartbeat", MQTT_LONGEST, presence_log=True)


def mosquitto_spec() -> ServerSpec:
    """Mosquitto (the Debian package's broker), as the peer our MQTT server is fuzzed beside."""
    binary = mosquitto_binary()
    if binary is None:
        raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
    return ServerSpec(
        "mosquitto",
        "mqtt",
        [binary],
        "mosquitto",
        MOSQUITTO_LONGEST,
        config=MOSQUITTO_CONFIG,
        holds=MOSQUITTO_HOLDS,
    )


def http_spec() -> ServerSpec:
    """``python -m servers.http``, one worker."""
    cmd = [*module_command("servers.http"), "--workers", "1", *HTTP_SERVER_ARGS]
    return ServerSpec("http", "http", cmd, "http", HTTP_LONGEST)


def ws_spec(engine: str) -> ServerSpec:
    """``python -m servers.http`` on ``engine``, one worker, serving the echo app's WebSockets."""
    cmd = [*module_command("servers.http"), "--workers", "1", "--engine", engine, *WS_SERVER_ARGS, WS_APP]
    return ServerSpec(f"ws-{engine}", "ws", cmd, "http", WS_LONGEST)


def mqtt_ws_spec(engine: str) -> ServerSpec:
    """``python -m servers.heartbeat`` on ``engine``, MQTT over WebSockets on a second port
    with one browser origin allowed, and a presence log."""
    spec = mqtt_spec(engine)
    spec.command += ["--ws-allowed-origins", ALLOWED_ORIGIN.decode()]
    return ServerSpec(f"mqtt-ws-{engine}", "mqtt-ws", spec.command, "heartbeat", MQTT_LONGEST, True, ws_port=True)


def start_server(
    spec: ServerSpec, port: int, log: Path, extra: Sequence[str] = (), timeout: float = 30.0
) -> subprocess.Popen[bytes]:
    """Start ``spec`` on ``port`` (with ``extra`` arguments) with its stderr in ``log``;
    return once it says it listens (or, started from a config file, once it accepts)."""
    if spec.config is not None:
        config = log.with_name(f"{spec.name}.conf")
        config.write_text(spec.config.replace("{port}", str(port)))
        with log.open("wb") as err:
            proc = subprocess.Popen([*spec.command, *extra, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_listening(port, proc, timeout=timeout)
        except RuntimeError as exc:
            stop(proc)
            raise RuntimeError(f"{spec.name} did not start on port {port}: {exc}") from None
        return proc
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
