"""Accepting for the dense engine: a listening socket drained a batch at a time.

Each accepted connection is made non-blocking (a blocking send would stall the
engine's one task), given ``TCP_NODELAY`` and a protocol from the listener's
factory, and started with the listener's deadlines. Running out of descriptors or
memory pauses the listener for a while instead of failing the server.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .protocol import Protocol as ConnectionProtocol

if TYPE_CHECKING:
    from .keeper import Keeper
    from .tls_transport import TLSSettings
    from .transport import Transport
    from .watch import ExpireHook

__all__ = ["Listener", "ProtocolFactory"]

logger = logging.getLogger("idlekeeper.engine")

ProtocolFactory = Callable[[], ConnectionProtocol]
"""Makes the protocol object of each accepted connection."""

# Running out of descriptors or kernel memory is a state that passes; trio's
# serve_listeners waits 100 ms and tries again, and so does the engine.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_ACCEPT_PAUSE = 0.1
# The connection died between the kernel's accept queue and our accept: try the next.
_HARMLESS_ACCEPT_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})


class _Host(Protocol):
    """What a listener needs from its engine (abstract, to keep imports one way)."""

    keeper: Keeper
    accept_batch: int
    accepted: int
    accept_errors: int
    callback_errors: int
    _urgent: select.epoll

    def _start(
        self,
        sock: socket.SocketType,
        protocol: ConnectionProtocol,
        idle: float | None,
        receive: float | None,
        send: float | None,
        max_age: float | None,
        on_expire: ExpireHook | None,
        peer: object = None,
        tls: TLSSettings | None = None,
    ) -> Transport: ...


class Listener:
    """A listening socket of an engine's and how to serve what it accepts.

    The engine registers it in its urgent set (see :mod:`idlekeeper.dispatch`); it
    takes itself out while paused.
    """

    __slots__ = ("_host", "sock", "factory", "idle", "receive", "send", "max_age", "on_expire", "tls", "paused")

    def __init__(
        self,
        host: _Host,
        sock: socket.socket,
        factory: ProtocolFactory,
        idle: float | None,
        receive: float | None,
        send: float | None,
        max_age: float | None,
        on_expire: ExpireHook | None,
        tls: TLSSettings | None = None,
    ) -> None:
        self._host = host
        self.sock = sock
        self.factory = factory
        self.idle = idle
        self.receive = receive
        self.send = send
        self.max_age = max_age
        self.on_expire = on_expire
        self.tls = tls
        """TLS for what this listener accepts (its handshake first), or None."""
        self.paused = False

    def accept(self) -> bool:
        """Accept up to a batch; True if the batch ran out before the backlog did."""
        host = self._host
        sock = self.sock
        family, kind = sock.family, sock.type
        for _ in range(host.accept_batch):
            try:
                fd, addr = sock._accept()  # type: ignore[attr-defined]  # what accept() wraps
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                if exc.errno in _HARMLESS_ACCEPT_ERRNOS:
                    continue
                host.accept_errors += 1
                if exc.errno not in _RESOURCE_ERRNOS:
                    logger.error("idlekeeper: accept failed: %s; pausing accepts", exc)
                else:
                    logger.warning("idlekeeper: accept failed: %s; pausing accepts for %ss", exc, _ACCEPT_PAUSE)
                self._pause()
                return False
            host.accepted += 1
            # The C socket, not socket.socket's Python wrapper around it (what accept()
            # returns): 48 bytes and no garbage collector tracking, against 88 tracked,
            # for each of a million connections that never need the wrapper's extras.
            conn = socket.SocketType(family, kind, 0, fd)
            conn.setblocking(False)
            if family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                protocol = self.factory()
            except Exception:
                host.callback_errors += 1
                logger.exception("idlekeeper: protocol factory %r raised", self.factory)
                conn.close()
                continue
            host._start(
                conn, protocol, self.idle, self.receive, self.send, self.max_age, self.on_expire, addr, self.tls
            )
        return True

    def close(self) -> None:
        """Stop accepting and close the socket (connections accepted go on)."""
        fd = self.sock.fileno()
        if fd >= 0:
            if not self.paused:
                self._host._urgent.unregister(fd)
            self.sock.close()

    def _pause(self) -> None:
        if self.paused:
            return
        self.paused = True
        self._host._urgent.unregister(self.sock.fileno())
        self._host.keeper.call_later(_ACCEPT_PAUSE, self._resume)

    def _resume(self) -> None:
        if self.paused and self.sock.fileno() >= 0:
            self.paused = False
            self._host._urgent.register(self.sock.fileno(), select.EPOLLIN)
