"""Echo throughput: C clients, each sending a small binary message and waiting for its
echo before the next, for a fixed time; messages per second and their round trips.

One process, one epoll, every frame built once and masked once: per message the client
does a ``recv``, a comparison of bytes and a ``send``, so it keeps ahead of a server that
does the parsing, the ASGI round trip and the framing. Its own CPU is reported beside
the rate; near one core, the rate would be the client's.
"""

from __future__ import annotations

import math
import select
import time
from dataclasses import dataclass

import psutil

from ..http.workload import LoadFigures
from ..stats import percentile
from .connect import close_all, open_websockets, receive
from .frames import BINARY, CLOSE, PING, PONG, FrameReader, client_frame, server_frame

__all__ = ["EchoFigures", "run_echo"]


@dataclass
class EchoFigures(LoadFigures):
    """One echo round: ``requests`` are messages echoed and ``rps`` messages per second."""

    client_cpu: float = math.nan
    """The client's CPU over the round, in cores."""


def run_echo(port: int, clients: int, duration: float, size: int = 16) -> EchoFigures:
    """``clients`` WebSockets echoing ``size``-byte messages one at a time for ``duration`` s."""
    opened = open_websockets(port, clients)
    payload = bytes(i % 251 for i in range(size))
    message, echo = client_frame(BINARY, payload), server_frame(BINARY, payload)
    ep = select.epoll()
    peers = {p.sock.fileno(): p for p in opened.peers}
    readers = {fd: FrameReader(p.rest) for fd, p in peers.items()}
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    errors = opened.errors
    me = psutil.Process()
    cpu_before = sum(me.cpu_times()[:2])
    start = time.monotonic()
    end = start + duration
    try:
        for fd, peer in peers.items():
            ep.register(fd, select.EPOLLIN)
            peer.sock.send(message)
            sent_at[fd] = time.perf_counter()
        while time.monotonic() < end:
            for fd, _ in ep.poll(0.1):
                sock = peers[fd].sock
                data = receive(sock)
                if data is None:
                    continue
                if not data:
                    errors += 1
                    ep.unregister(fd)
                    continue
                reader = readers[fd]
                if data == echo and not reader.pending():
                    echoed = 1  # the common case: one whole echo, nothing else
                else:
                    echoed = 0
                    for frame in reader.feed(data):
                        if frame.opcode == BINARY and frame.payload == payload:
                            echoed += 1
                        elif frame.opcode == PING:
                            sock.send(client_frame(PONG, frame.payload))
                        elif frame.opcode == CLOSE:
                            errors += 1
                        elif frame.opcode != PONG:
                            errors += 1  # not the echo of what was sent
                if echoed:
                    now = time.perf_counter()
                    latencies.append(now - sent_at[fd])
                    sock.send(message)
                    sent_at[fd] = now
        elapsed = time.monotonic() - start
        cpu = (sum(me.cpu_times()[:2]) - cpu_before) / elapsed
    finally:
        ep.close()
        close_all(opened.peers)
    ms = [v * 1000 for v in latencies]
    return EchoFigures(
        "raw-socket echo",
        len(ms),
        len(ms) / elapsed,
        percentile(ms, 50),
        percentile(ms, 99),
        errors,
        client_cpu=cpu,
    )
