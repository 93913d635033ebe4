"""Why a connection ended, as its session and the server name it: the reasons every
offline event carries (:class:`Offline`), from a clean DISCONNECT to a dead worker."""

from __future__ import annotations

import enum

__all__ = ["Offline"]


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
    SEND_OVERFLOW = "send-overflow"
    """It fell too far behind what it is sent: past its byte bound for too long or by too much."""
    REFUSED = "refused"
    """CONNECT was refused (bad credentials, client id, connection cap)."""
    SUPERSEDED = "superseded"
    """Its CONNECT was dropped unanswered: a connection of the same client id whose
    CONNECT came later already held the session (its own took longer to vet)."""
    WORKER_LOST = "worker-lost"
    """The worker process that held it died; its supervisor declared it offline."""
    NODE_LOST = "node-lost"
    """The gateway (node) that held it stopped renewing its lease; another node declared it offline."""
    SERVER_SHUTDOWN = "server-shutdown"
    """The server was stopped (SIGTERM) while it was online; told when the server, keeping
    its state durably (``--persistence``), started again."""
    SERVER_LOST = "server-lost"
    """The server died (a crash, ``kill -9``, a power cut) while it was online; told when
    the server, keeping its state durably, started again."""

    def __str__(self) -> str:
        return self.value
