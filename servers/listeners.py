"""Listening sockets for the servers: one port, shared by worker processes if asked.

One process holds at most ~19,000 sockets here (the open-file limit is 20,000 and
cannot be raised), so a server of hundreds of thousands of connections runs several
workers on one port with SO_REUSEPORT, and the kernel spreads new connections over
their listening sockets.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Sequence

import trio

__all__ = ["CannotListen", "PortInUse", "check_port_free", "open_listeners", "port_of", "reserve_port"]


class PortInUse(OSError):
    """Another process is already listening on the port a server was asked to take."""


class CannotListen(OSError):
    """A listening socket could not be opened; the message names the address and why,
    in the one line a server prints for it."""


def _bound_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


def open_listeners(host: str, port: int, *, reuse_port: bool = False, backlog: int = 4096) -> list[trio.SocketListener]:
    """A listening TCP socket on ``host:port`` as a trio listener (SO_REUSEPORT if asked).

    Raises :class:`CannotListen` (an OSError) naming the address if it cannot be bound.
    """
    try:
        sock = _bound_socket(host, port, reuse_port)
    except OSError as exc:
        if isinstance(exc, socket.gaierror):
            reason = exc.strerror or str(exc)
        else:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise CannotListen(exc.errno or 0, f"cannot listen on {where}: {reason}") from exc
    sock.listen(backlog)
    return [trio.SocketListener(trio.socket.from_stdlib_socket(sock))]


def port_of(listeners: Sequence[trio.SocketListener]) -> int:
    """The port the first listener is bound to (the one to announce when port 0 was asked)."""
    return int(listeners[0].socket.getsockname()[1])


def reserve_port(host: str) -> tuple[int, socket.socket]:
    """A free port for a group of SO_REUSEPORT workers, held by a bound, non-listening socket.

    Keep the socket until the workers listen, then close it: it receives nothing.
    """
    sock = _bound_socket(host, 0, reuse_port=True)
    return int(sock.getsockname()[1]), sock


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUse` if something is listening on ``host:port``.

    Workers bind with SO_REUSEPORT so that they can share a port, and the kernel lets
    any other process that sets it join in: a second server started on a port still
    held (by the orphaned workers of a killed supervisor, say) would silently split
    the connections with it. A socket bound *without* SO_REUSEPORT (SO_REUSEADDR
    still forgives connections in TIME_WAIT) fails while any socket listens there,
    so a server checks once, before it or its workers bind. Port 0 is always free.
    """
    if port == 0:
        return
    try:
        probe = _bound_socket(host, port, reuse_port=False)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(
                errno.EADDRINUSE,
                f"port {port} on {host} is already in use: another server is listening there, or "
                "a connection holds it as its own port (stop the server by its PID, or "
                "choose another port)",
            ) from exc
        raise
    probe.close()
