"""Reading what the server sends an online device: a 3.x device's PINGRESPs are read and
let go; a 5.0 device's bytes are looked at, so that each DISCONNECT's reason code is
counted (:class:`~loadtest.generator.events.Generator` calls these when a device pings
and when its connection ends)."""

from __future__ import annotations

from . import mqtt5
from .records import PINGRESP, SUPERSEDED, Conn

__all__ = ["drain", "drain_v5", "read_v5"]


def drain(conn: Conn) -> bool:
    """Read what the server sent (PINGRESPs) and let it go; False once it has closed.

    A short read means nothing more was waiting; an end behind it is reported by
    epoll, so one ``recv`` is the usual cost.
    """
    sock = conn.sock
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return False
            if len(data) < 4096:
                return True
    except BlockingIOError:
        return True
    except OSError:
        return False


def drain_v5(disconnects: dict[str, dict[str, int]], conn: Conn, data: bytes = b"") -> bool:
    """:func:`drain` for a 5.0 connection (``data``: what was already read): what the server
    sent is looked at, not let go, so that a DISCONNECT's reason code is counted in
    ``disconnects`` (see :func:`read_v5`). False once it has closed."""
    sock = conn.sock
    chunks = [conn.buf, data]
    alive = True
    try:
        while True:
            more = sock.recv(4096)
            if not more:
                alive = False
                break
            chunks.append(more)
            if len(more) < 4096:
                break
    except BlockingIOError:
        pass
    except OSError:
        alive = False
    conn.buf = read_v5(disconnects, conn, b"".join(chunks))
    return alive


def read_v5(disconnects: dict[str, dict[str, int]], conn: Conn, buf: bytes) -> bytes:
    """Count the DISCONNECTs among the whole packets in ``buf`` into ``disconnects`` (by
    reason code, then by the device's role); the unfinished rest, kept for the next read."""
    if not buf or buf == PINGRESP:
        return b""  # the usual read: nothing to look at
    reasons, used = mqtt5.disconnect_reasons(buf)
    role = conn.device.role if conn.phase != SUPERSEDED else "taken over"
    for reason in reasons:
        by_role = disconnects.setdefault(reason, {})
        by_role[role] = by_role.get(role, 0) + 1
    return buf[used:]
