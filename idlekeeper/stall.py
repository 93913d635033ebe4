"""Is the peer really silent, or is it us? Kernel checks made before an inactivity expiry.

A server stalled by load, a long garbage collection or SIGSTOP stops reading, and
its peers' bytes pile up in the kernel. Their activity stamps then look old though
the peers were on time. These checks ask the kernel, in one non-blocking system
call, whether that is what happened. Standard library only.
"""

from __future__ import annotations

import array
import select
import socket as _stdlib_socket
from typing import Protocol

__all__ = ["SocketLike", "send_would_progress", "unacknowledged_bytes", "unread_bytes"]

try:
    import fcntl
    import termios

    _FIONREAD: int | None = termios.FIONREAD
    _TIOCOUTQ: int | None = termios.TIOCOUTQ  # SIOCOUTQ for a socket
except ImportError:  # pragma: no cover - Windows
    _FIONREAD = _TIOCOUTQ = None


class SocketLike(Protocol):
    """What the checks need: a file descriptor (trio and stdlib sockets both have it)."""

    def fileno(self) -> int: ...


def unread_bytes(sock: SocketLike) -> int:
    """Bytes received by the kernel and not yet read by us (0 if unknown or closed).

    Uses ``FIONREAD`` where there is one, else a non-blocking ``MSG_PEEK`` of one
    byte (which can only say 0 or 1).
    """
    fd = sock.fileno()
    if fd < 0:
        return 0
    if _FIONREAD is not None:
        return _queue_size(fd, _FIONREAD)
    probe = _stdlib_socket.socket(fileno=fd)  # pragma: no cover - no FIONREAD
    try:  # pragma: no cover
        return len(probe.recv(1, _stdlib_socket.MSG_PEEK | getattr(_stdlib_socket, "MSG_DONTWAIT", 0)))
    except OSError:  # pragma: no cover - nothing to read, or the socket is gone
        return 0
    finally:  # pragma: no cover
        probe.detach()


def unacknowledged_bytes(sock: SocketLike) -> int:
    """Bytes we wrote that the peer has not acknowledged yet (0 if unknown or closed).

    ``SIOCOUTQ``: what the kernel still holds to send or resend. A peer that stops
    reading leaves up to its whole (autotuned, megabytes) send buffer here, out of
    sight of any queue of ours.
    """
    fd = sock.fileno()
    if fd < 0 or _TIOCOUTQ is None:
        return 0
    return _queue_size(fd, _TIOCOUTQ)


def _queue_size(fd: int, request: int) -> int:
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, request, buf, True)
    except OSError:
        return 0
    return buf[0]


def send_would_progress(sock: SocketLike) -> bool:
    """Whether the kernel would accept more data now, i.e. the peer has been reading.

    A pending send that would progress but has not means our side is the one that
    stalled, not the peer.
    """
    fd = sock.fileno()
    if fd < 0:
        return False
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        try:
            events = poller.poll(0)
        except OSError:
            return False
        return any(ev & select.POLLOUT and not ev & select.POLLERR for _, ev in events)
    try:  # pragma: no cover - no poll(): select() is limited to small fds
        _, writable, _ = select.select([], [fd], [], 0)
    except (OSError, ValueError):  # pragma: no cover
        return False
    return bool(writable)  # pragma: no cover
