"""Dead-peer detection: K peers that complete the handshake and then never read a byte
(a phone that lost its network), beside K healthy peers that answer every ping.

A dead peer is watched without reading: its socket is on an epoll for ``EPOLLRDHUP``
only, which the kernel reports when the server's FIN arrives whatever unread pings
are queued before it. Its time to the close runs from the last byte it sent (its
upgrade request). A healthy peer reads everything and answers each ping with a pong;
any close of one is a false one.
"""

from __future__ import annotations

import contextlib
import select
import time
from dataclasses import dataclass, field

from ..stats import percentile
from .connect import WsPeer, close_all, open_websockets, receive
from .frames import CLOSE, PING, PONG, FrameReader, client_frame

__all__ = ["DeadFigures", "dead_peers"]


@dataclass
class DeadFigures:
    """What :func:`dead_peers` saw."""

    dead: int = 0
    healthy: int = 0
    open_errors: int = 0
    window_s: float = 0.0
    dead_closed: int = 0
    healthy_closed: int = 0
    close_after_s: list[float] = field(default_factory=list)
    """For each dead peer closed: from its last byte to the server's FIN."""
    close_after_101_s: list[float] = field(default_factory=list)
    """The same from its ``101`` read: the server's ping timer starts near there, so this
    leaves out how long the server took over the handshake."""
    pings_answered: int = 0

    @property
    def close_p50_s(self) -> float:
        """The median time from a dead peer's last byte to its close."""
        return percentile(self.close_after_s, 50)

    @property
    def close_max_s(self) -> float:
        """The longest one."""
        return max(self.close_after_s, default=float("nan"))


class _Watch:
    """The epoll of one run: dead peers for their FIN, healthy ones for their pings."""

    def __init__(self, figures: DeadFigures) -> None:
        self.ep = select.epoll()
        self.figures = figures
        self.dead: dict[int, WsPeer] = {}
        self.healthy: dict[int, tuple[WsPeer, FrameReader]] = {}

    def add(self, peer: WsPeer, dead: bool) -> None:
        fd = peer.sock.fileno()
        if dead:
            self.dead[fd] = peer
            self.ep.register(fd, select.EPOLLRDHUP)
        else:
            self.healthy[fd] = (peer, FrameReader())
            self.ep.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
            self.answer(fd, peer.rest)

    def serve(self, timeout: float) -> None:
        for fd, _events in self.ep.poll(timeout):
            now = time.monotonic()
            if fd in self.dead:
                peer = self.dead.pop(fd)
                self.ep.unregister(fd)
                self.figures.dead_closed += 1
                self.figures.close_after_s.append(now - peer.sent_at)
                self.figures.close_after_101_s.append(now - peer.opened_at)
                continue
            peer, _ = self.healthy[fd]
            data = receive(peer.sock)
            if data is None:
                continue
            if not data:
                self.lost(fd)
                continue
            self.answer(fd, data)

    def answer(self, fd: int, data: bytes) -> None:
        """Pong every ping in ``data``; a close from the server is a false close."""
        peer, reader = self.healthy[fd]
        for frame in reader.feed(data):
            if frame.opcode == PING:
                try:
                    peer.sock.send(client_frame(PONG, frame.payload))
                except OSError:
                    self.lost(fd)
                    return
                self.figures.pings_answered += 1
            elif frame.opcode == CLOSE:
                self.lost(fd)
                return

    def lost(self, fd: int) -> None:
        if self.healthy.pop(fd, None) is not None:
            self.figures.healthy_closed += 1
            with contextlib.suppress(OSError):
                self.ep.unregister(fd)


def dead_peers(port: int, dead: int, healthy: int, window: float) -> DeadFigures:
    """Open ``dead`` and ``healthy`` peers (alternately, as far as they go; the healthy ones
    answer their pings while the rest open) and watch them for ``window`` s after the last
    opened: how many of each the server closed, and when."""
    figures = DeadFigures(window_s=window)
    watch = _Watch(figures)
    pairs = min(dead, healthy)
    plan = iter([True, False] * pairs + [True] * (dead - pairs) + [False] * (healthy - pairs))

    peers: list[WsPeer] = []

    def opened(peer: WsPeer) -> None:
        peers.append(peer)
        is_dead = next(plan)
        watch.add(peer, is_dead)
        figures.dead += is_dead
        figures.healthy += not is_dead

    try:
        result = open_websockets(port, dead + healthy, on_open=opened, between=lambda: watch.serve(0))
        figures.open_errors = result.errors
        end = time.monotonic() + window
        while time.monotonic() < end:
            watch.serve(min(0.05, max(0.0, end - time.monotonic())))
    finally:
        watch.ep.close()
        close_all(peers)
    return figures
