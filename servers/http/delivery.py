"""Responses a client leaves unread in the kernel: holding its connection until it
reads them, or cutting it.

The transport's send timeout sees only the transport's own queue. A client that
pipelines requests and never reads would otherwise be answered request after request
into the kernel's autotuned send buffer (megabytes, out of the transport's sight), at
the server's expense. So after each response the dense connection asks how much of
what it wrote the client has not acknowledged; past :data:`KERNEL_BACKLOG` it stops
taking requests, and a :class:`DeliveryWatch` looks again every tick until the
client catches up, or cuts the connection once it has acknowledged nothing for the
send timeout.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from typing import Protocol

import trio

import idlekeeper
from idlekeeper.stall import unacknowledged_bytes

from .core import HttpServer

__all__ = ["KERNEL_BACKLOG", "DeliveryWatch", "Held", "kernel_backlog"]

logger = logging.getLogger("servers.http")

KERNEL_BACKLOG = 16 * 1024
"""Bytes of finished responses the kernel may still hold for a client before the next
request waits for them to be delivered, under the send timeout. Loopback and LAN
clients stay far below it."""


def kernel_backlog(t: idlekeeper.Transport) -> int:
    """Bytes written to ``t``'s socket that its client has not acknowledged."""
    sock = t.socket
    return 0 if sock is None else unacknowledged_bytes(sock)


class Held(Protocol):
    """The connection a :class:`DeliveryWatch` holds, as the watch sees it."""

    delivery: DeliveryWatch | None
    """The watch holding the connection, or None: requests are taken."""
    gone: bool
    lingered: int
    written: int
    """Bytes of responses given to the transport."""

    @property
    def t(self) -> idlekeeper.Transport: ...

    @property
    def server(self) -> HttpServer: ...

    def caught_up(self, acknowledged: int) -> None:
        """The kernel holds little again (``acknowledged`` bytes delivered): take requests."""
        ...


class DeliveryWatch:
    """Holds ``conn`` while its kernel holds more than :data:`KERNEL_BACKLOG` of its
    responses (``backlog`` bytes now): each tick it releases the connection if the
    client caught up, cuts it if the client has acknowledged nothing for the send
    timeout, and otherwise looks again."""

    __slots__ = ("conn", "delivered", "progressed", "timer")

    def __init__(self, conn: Held, backlog: int) -> None:
        self.conn = conn
        self.delivered = self._acknowledged(backlog)
        """Bytes the client had acknowledged at the last look."""
        self.progressed = trio.current_time()
        """When that figure last grew."""
        server = conn.server
        self.timer: idlekeeper.TimerHandle | None = server.keeper.call_later(server.config.tick, self._check)

    def cancel(self) -> None:
        """Stop watching: the connection is gone."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _acknowledged(self, backlog: int) -> int:
        """Bytes of responses the client has acknowledged, given the kernel's ``backlog``."""
        t = self.conn.t
        return self.conn.written - t.get_write_buffer_size() - backlog

    def _check(self) -> None:
        """A tick into a hold: release it if the client caught up, cut it if it has
        acknowledged nothing for the send timeout, else look again a tick later."""
        self.timer = None
        conn = self.conn
        conn.delivery = None
        if conn.gone or conn.lingered >= 0:
            return
        server = conn.server
        now = trio.current_time()
        backlog = kernel_backlog(conn.t)
        acknowledged = self._acknowledged(backlog)
        if acknowledged > self.delivered:
            self.delivered = acknowledged
            self.progressed = now
        if backlog <= KERNEL_BACKLOG:
            conn.caught_up(acknowledged)
            return
        if now - self.progressed < server.config.send_timeout:
            conn.delivery = self
            self.timer = server.keeper.call_later(server.config.tick, self._check)
            return
        server.unread_cut_total += 1
        logger.info("http: send timeout, %d bytes of responses unread by the client", backlog)
        # A reset, not a FIN queued behind the unread bytes: that would leave an orphan
        # socket holding them in the kernel for minutes of zero-window probes.
        sock = conn.t.socket
        if isinstance(sock, socket.SocketType):  # the engine's are C sockets, socket.socket's base
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.t.abort()
