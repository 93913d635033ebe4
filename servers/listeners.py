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


def _bound_socket(
    host: str, port: int, reuse_port: bool, family: int = socket.AF_UNSPEC, interface: str | None = None
) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, family=family, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if interface is not None:
            # Mosquitto's bind_interface: only packets through this interface reach it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


DOMAINS = {None: socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}
"""Mosquitto's ``socket_domain`` values, as address families."""


def open_listeners(
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    backlog: int = 4096,
    domain: str | None = None,
    interface: str | None = None,
) -> list[trio.SocketListener]:
    """Listening TCP sockets on ``host:port`` as trio listeners (SO_REUSEPORT if asked).

    An empty ``host`` is every interface: ``0.0.0.0`` and ``::`` (as Mosquitto's
    listener without an address), or one of them with ``domain`` (``ipv4``, ``ipv6``).
    ``interface`` binds to a network interface by name (SO_BINDTODEVICE). Raises
    :class:`CannotListen` (an OSError) naming the address if it cannot be bound.
    """
    family = DOMAINS[domain]
    hosts = (
        [host] if host else [h for h, f in (("0.0.0.0", socket.AF_INET), ("::", socket.AF_INET6)) if family in (f, 0)]
    )
    socks: list[socket.socket] = []
    try:
        for one in hosts:
            # A port-0 listener on every interface takes one port for both families.
            at = port or (int(socks[0].getsockname()[1]) if socks else 0)
            try:
                socks.append(_bound_socket(one, at, reuse_port, family, interface))
            except OSError as exc:
                if not host and one == "::" and exc.errno == errno.EAFNOSUPPORT:
                    continue  # a machine without IPv6 still listens on IPv4
                raise CannotListen(exc.errno or 0, f"cannot listen on {_where(one, at)}: {_reason(exc)}") from exc
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    for sock in socks:
        sock.listen(backlog)
    return [trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in socks]


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return exc.strerror or str(exc)
    return os.strerror(exc.errno) if exc.errno else str(exc)


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
        probe = _bound_socket(host or "0.0.0.0", port, reuse_port=False)
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
