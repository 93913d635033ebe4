"""Binding a device's socket to its generator's loopback source address, so that
generators (and benchmarks that open many client sockets) are not held to one
address's ephemeral ports."""

from __future__ import annotations

import socket

__all__ = ["bind_source"]

_IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


def bind_source(sock: socket.socket, address: str) -> None:
    """Bind ``sock`` to the loopback source ``address``, its port picked at connect():
    a port is then needed only per 4-tuple, not per source address (so a source holds
    more than the ephemeral range, and an earlier run's TIME_WAIT sockets are no obstacle)."""
    sock.setsockopt(socket.IPPROTO_IP, _IP_BIND_ADDRESS_NO_PORT, 1)
    sock.bind((address, 0))
