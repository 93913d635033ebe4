"""Opening many WebSockets at once from one process: non-blocking sockets on one epoll,
a bounded number of handshakes in flight, the whole bounded in time.

Every socket this returns is non-blocking and past its ``101``: the phases that hold them
(idle, echo, dead peers, slow readers, devices) go on from there with epolls of their own.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .frames import accepted, upgrade_request

__all__ = ["MAX_SOCKETS", "Opened", "WsPeer", "close_all", "open_websockets", "receive"]

MAX_SOCKETS = 15_000
"""The most sockets one client process opens: 20,000 files per process here, and the
process has other files open."""


@dataclass
class WsPeer:
    """One client WebSocket after its handshake."""

    sock: socket.socket
    sent_at: float
    """When the last byte of its request went out: a peer that sends no more was last heard then."""
    opened_at: float
    """When its 101 was read."""
    rest: bytes = b""
    """Bytes read past the 101's head (the first frames, if the server sent some at once)."""

    @property
    def address(self) -> tuple[str, int]:
        """Its local address, as the server sees it as the peer's."""
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)


@dataclass
class Opened:
    """What :func:`open_websockets` got."""

    peers: list[WsPeer] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0


class _Handshake:
    __slots__ = ("sock", "head", "sent_at")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.head = b""
        self.sent_at = 0.0


def open_websockets(
    port: int,
    n: int,
    *,
    path: str = "/",
    subprotocol: str | None = None,
    rcvbuf: int | None = None,
    in_flight: int = 64,
    timeout: float = 60.0,
    on_open: Callable[[WsPeer], None] | None = None,
    between: Callable[[], None] | None = None,
) -> Opened:
    """``n`` WebSockets to ``127.0.0.1:port`` at ``path``, ``in_flight`` handshakes at a time;
    those not open within ``timeout`` count as errors (closed). ``rcvbuf`` sets a small
    receive buffer before ``connect()``, so that the window the server sees is small from
    the start (a slow reader's).

    ``on_open`` is called with each peer as it opens, and ``between`` after each look at
    the sockets: the peers open already keep to their protocol (pongs, pings) while the
    rest open, however long that takes a slow server."""
    if not 0 <= n <= MAX_SOCKETS:
        raise ValueError(f"one process opens at most {MAX_SOCKETS:,} WebSockets (asked for {n:,})")
    request = upgrade_request(port, path, subprotocol)
    out = Opened()
    ep = select.epoll()
    pending: dict[int, _Handshake] = {}
    started = time.monotonic()
    deadline = started + timeout

    def fail(h: _Handshake) -> None:
        out.errors += 1
        pending.pop(h.sock.fileno(), None)
        with contextlib.suppress(OSError):
            ep.unregister(h.sock)
        h.sock.close()

    begun = 0
    try:
        while (begun < n or pending) and time.monotonic() < deadline:
            while begun < n and len(pending) < in_flight:
                begun += 1
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                if rcvbuf is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
                code = sock.connect_ex(("127.0.0.1", port))
                h = _Handshake(sock)
                if code not in (0, errno.EINPROGRESS):
                    out.errors += 1
                    sock.close()
                    continue
                pending[sock.fileno()] = h
                ep.register(sock, select.EPOLLOUT)
            for fd, _events in ep.poll(0.2):
                h = pending[fd]
                if not h.sent_at:
                    if h.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        fail(h)
                        continue
                    try:
                        # A few hundred bytes into an empty send buffer: all of it goes.
                        if h.sock.send(request) != len(request):
                            fail(h)
                            continue
                    except OSError:
                        fail(h)
                        continue
                    h.sent_at = time.monotonic()
                    ep.modify(h.sock, select.EPOLLIN)
                    continue
                data = receive(h.sock)
                if data is None:
                    continue
                if not data:
                    fail(h)
                    continue
                h.head += data
                head, sep, rest = h.head.partition(b"\r\n\r\n")
                if not sep:
                    if len(h.head) > 16384:
                        fail(h)
                    continue
                if not accepted(head):
                    fail(h)
                    continue
                del pending[fd]
                ep.unregister(h.sock)
                peer = WsPeer(h.sock, h.sent_at, time.monotonic(), rest)
                out.peers.append(peer)
                if on_open is not None:
                    on_open(peer)
            if between is not None:
                between()
    finally:
        for h in list(pending.values()):
            fail(h)
        out.errors += n - begun
        ep.close()
    out.seconds = time.monotonic() - started
    return out


def receive(sock: socket.socket) -> bytes | None:
    """What a ready non-blocking socket has: None if nothing after all, b"" once the server
    closed it (or reset it), else the bytes."""
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def close_all(peers: list[WsPeer]) -> None:
    """Close every peer's socket (they are this process's; the server sees a FIN or a reset)."""
    for peer in peers:
        peer.sock.close()
