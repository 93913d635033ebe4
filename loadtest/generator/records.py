"""A simulated device and its connections, as a generator keeps them, and the few MQTT
packets a device sends and expects."""

from __future__ import annotations

import math
import socket
from collections.abc import Callable

from idlekeeper.timers import TimerHandle

__all__ = [
    "CONNACK_OK",
    "CONNECTING",
    "HANDSHAKE",
    "ONLINE",
    "PINGREQ",
    "PINGRESP",
    "SUPERSEDED",
    "Conn",
    "Device",
    "encode_connect",
]

CONNACK_OK = b"\x20\x02\x00\x00"
"""The CONNACK that accepts a device (no session present)."""
PINGREQ = b"\xc0\x00"
"""A device's heartbeat."""
PINGRESP = b"\xd0\x00"
"""The server's answer to it."""

# Connection phases.
CONNECTING, HANDSHAKE, ONLINE, SUPERSEDED = range(4)


class Conn:
    """One TCP connection of a device (a device that reconnects has two for a while)."""

    __slots__ = ("device", "sock", "phase", "buf", "port")

    def __init__(self, device: Device, sock: socket.socket, port: int) -> None:
        self.device = device
        self.sock = sock
        self.phase = CONNECTING
        self.buf = b""
        self.port = port


class Device:
    """One simulated device and what happened to it."""

    __slots__ = (
        "index",
        "client_id",
        "role",
        "conn",
        "timer",
        "last_sent",
        "max_gap",
        "connect_started",
        "connack_at",
        "closed_at",
        "acted_at",
        "takeover_s",
        "old",
        "old_closed_at",
        "attempts",
        "version",
        "keepalive",
        "pinger",
    )

    def __init__(
        self,
        index: int,
        client_id: str,
        keepalive: float = 0.0,
        version: int = 4,
        pinger: Callable[[Device], None] | None = None,
    ) -> None:
        self.index = index
        self.client_id = client_id
        self.version = version
        """The protocol level of its CONNECT: 3 (MQTT 3.1), 4 (3.1.1) or 5 (5.0)."""
        self.keepalive = keepalive
        """The keep-alive it pings at: its own, or the server's (a 5.0 CONNACK's Server
        Keep Alive); 0 before it is known."""
        self.pinger: Callable[[Device], None] = pinger or _no_heartbeat
        """The generator's heartbeat for its version (one shared bound method, no lookup per ping)."""
        self.role = "healthy"
        self.conn: Conn | None = None
        self.timer: TimerHandle | None = None
        self.last_sent = math.nan
        self.max_gap = 0.0
        self.connect_started = math.nan
        self.connack_at = math.nan
        self.closed_at = math.nan
        self.acted_at = math.nan  # when its scenario (silence, vanish, reconnect) happened
        self.takeover_s = math.nan
        self.old: Conn | None = None  # the superseded connection of a reconnect, until it closes
        self.old_closed_at = math.nan  # it closed before the new CONNACK came
        self.attempts = 0  # connects in a row to gateways that refused (a fleet's dead node)


def _no_heartbeat(device: Device) -> None:
    """The heartbeat of a device no generator runs."""


_PROTOCOL = {3: b"\x00\x06MQIsdp\x03\x02", 4: b"\x00\x04MQTT\x04\x02"}


def encode_connect(client_id: str, keepalive: int, version: int = 4) -> bytes:
    """A device's CONNECT: MQTT 3.1.1 (or 3.1 with ``version`` 3), a clean session, no
    credentials. (A 5.0 device's is :func:`loadtest.generator.mqtt5.encode_connect`.)"""
    # Built here rather than imported from the server's encoders: a generator should speak
    # the wire format independently of the code it is testing.
    cid = client_id.encode()
    body = _PROTOCOL[version] + keepalive.to_bytes(2, "big") + len(cid).to_bytes(2, "big") + cid
    return b"\x10" + bytes([len(body)]) + body
