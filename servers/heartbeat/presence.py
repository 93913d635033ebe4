"""Presence events: who came online, who went offline, why, and how long they were silent.

Pure data and sinks; the server decides when events happen. Each event reaches
MQTT subscribers (``presence/<client-id>``), a JSON-lines log and any Python
callbacks registered by an embedding program.
"""

from __future__ import annotations

import enum
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["Offline", "PresenceEvent", "PresenceLog", "PresenceSink"]


class Offline(str, enum.Enum):
    """Why a device went offline (or never came online)."""

    DISCONNECT = "disconnect"
    """It sent DISCONNECT: a clean goodbye, no Will."""
    KEEPALIVE_TIMEOUT = "keepalive-timeout"
    """Silent for 1.5 × its keep-alive (or the server's idle cap): presumed dead."""
    CONNECT_TIMEOUT = "connect-timeout"
    """The socket never completed CONNECT in time."""
    TAKEOVER = "takeover"
    """A new connection with the same client id replaced it."""
    PROTOCOL_ERROR = "protocol-error"
    """It broke the protocol; only its own connection was closed."""
    SHUTDOWN = "shutdown"
    """The server is shutting down."""
    CONNECTION_LOST = "connection-lost"
    """Its TCP connection ended (EOF or reset) without DISCONNECT."""
    SEND_TIMEOUT = "send-timeout"
    """It stopped reading what the server sends it (a stalled subscriber)."""
    REFUSED = "refused"
    """CONNECT was refused (bad credentials, client id, connection cap)."""
    WORKER_LOST = "worker-lost"
    """The worker process that held it died; its supervisor declared it offline."""
    NODE_LOST = "node-lost"
    """The gateway (node) that held it stopped renewing its lease; another node declared it offline."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class PresenceEvent:
    """One device coming online or going offline."""

    status: str
    """``"online"`` or ``"offline"``."""
    client_id: str | None
    """None for a socket that never identified itself."""
    peer: str
    """``host:port`` of the device."""
    reason: Offline | None
    """Why it went offline; None for online."""
    silent_for: float
    """Seconds since the device's last packet, when the event happened."""
    time: float
    """Wall-clock time of the event (Unix seconds), for logs only."""
    worker: int = 0
    """The worker process that held the connection."""
    detail: str = ""
    """More about the reason (a protocol error's name, say)."""
    epoch: str = ""
    """The session: unique per accepted connection, fleet-wide. An online event and
    the one offline event that ends it carry the same epoch."""
    node: str = ""
    """The gateway that held the connection (empty on a lone machine)."""
    keep_alive: int = 0
    """The keep-alive the device asked for (after the server's cap), in seconds."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out: dict[str, Any] = {
            "status": self.status,
            "client_id": self.client_id,
            "peer": self.peer,
            "reason": None if self.reason is None else self.reason.value,
            "silent_for": round(self.silent_for, 3),
            "time": round(self.time, 3),
            "worker": self.worker,
        }
        if self.detail:
            out["detail"] = self.detail
        if self.epoch:
            out["epoch"] = self.epoch
        if self.node:
            out["node"] = self.node
        if self.status == "online":
            out["keep_alive"] = self.keep_alive
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PresenceEvent:
        """The inverse of :meth:`to_dict` (for events that crossed a process boundary)."""
        reason = data.get("reason")
        return cls(
            status=str(data["status"]),
            client_id=None if data.get("client_id") is None else str(data["client_id"]),
            peer=str(data.get("peer", "?")),
            reason=None if reason is None else Offline(reason),
            silent_for=float(data.get("silent_for", 0.0)),
            time=float(data.get("time", 0.0)),
            worker=int(data.get("worker", 0)),
            detail=str(data.get("detail", "")),
            epoch=str(data.get("epoch", "")),
            node=str(data.get("node", "")),
            keep_alive=int(data.get("keep_alive", 0)),
        )

    def payload(self) -> bytes:
        """The MQTT message body published on ``presence/<client-id>``."""
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()


PresenceSink = Callable[[PresenceEvent], None]
"""A callback that receives every presence event (it must not block)."""


class PresenceLog:
    """Writes presence events as JSON lines to a file or to stdout (``"-"``)."""

    def __init__(self, target: str) -> None:
        self._stream: IO[str] = sys.stdout if target == "-" else open(target, "a", buffering=1)  # noqa: SIM115
        self._owned = target != "-"

    def __call__(self, event: PresenceEvent) -> None:
        self._stream.write(json.dumps(event.to_dict()) + "\n")
        self._stream.flush()

    def close(self) -> None:
        """Close the file (not stdout)."""
        if self._owned:
            self._stream.close()
