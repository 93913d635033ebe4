"""The clients that are not load: slowloris attackers, slow readers and idle keep-alive
connections, and how long the server under test holds on to each, read from its own
socket table."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from typing import Any

import psutil

from ..sampler import Sampler
from .workload import REQUEST

__all__ = [
    "IDLE_SOURCE",
    "SLOWLORIS_SOURCE",
    "SLOW_READER_SOURCE",
    "Attack",
    "held_by_server",
    "idle_memory",
    "waiting_in_kernel",
    "watch_attack",
    "watch_release",
]

SLOWLORIS_SOURCE = "127.0.0.3"
SLOW_READER_SOURCE = "127.0.0.4"
IDLE_SOURCE = "127.0.0.5"


class Attack:
    """Slowloris attackers and slow readers, driven by one thread until stopped."""

    def __init__(self, port: int, slowloris: int, slow_readers: int, pipelined: int = 2000) -> None:
        self.port = port
        self.connected_at: dict[tuple[str, int], float] = {}
        self.kinds: dict[tuple[str, int], str] = {}
        self._loris: list[socket.socket] = []
        self._readers: list[socket.socket] = []
        self._stop = threading.Event()
        self._plan = (slowloris, slow_readers, pipelined)
        self._thread = threading.Thread(target=self._run, name="attack", daemon=True)

    def _open(self, source: str, rcvbuf: int | None = None) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            # Before connect(), so the window the server sees is tiny from the start.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        try:
            sock.bind((source, 0))
            sock.settimeout(5)
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return None
        addr = sock.getsockname()
        self.connected_at[(addr[0], addr[1])] = time.monotonic()
        self.kinds[(addr[0], addr[1])] = "slowloris" if source == SLOWLORIS_SOURCE else "slow reader"
        sock.setblocking(False)
        return sock

    def start(self) -> None:
        """Connect every attacker (in this thread), then trickle from a background thread."""
        slowloris, slow_readers, pipelined = self._plan
        for _ in range(slowloris):
            sock = self._open(SLOWLORIS_SOURCE)
            if sock is not None:
                self._loris.append(sock)
                with contextlib.suppress(OSError):
                    sock.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        burst = REQUEST * pipelined
        for _ in range(slow_readers):
            sock = self._open(SLOW_READER_SOURCE, rcvbuf=4096)
            if sock is not None:
                self._readers.append(sock)
                with contextlib.suppress(OSError):
                    sock.send(burst)  # as much as fits; the rest is never sent
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(1.0) and n < 10_000:
            n += 1
            for sock in self._loris:
                with contextlib.suppress(OSError):
                    sock.send(b"X-Trickle-%d: %d\r\n" % (n, n))  # one more header line, never the blank one

    def stop(self) -> None:
        """Stop trickling and close every attacker socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for sock in self._loris + self._readers:
            sock.close()


def idle_memory(port: int, pids: list[int], n: int, source: str = IDLE_SOURCE) -> tuple[int, float]:
    """Open ``n`` keep-alive connections that each make one request, then sit idle;
    return how many did, and the server's RSS added per connection."""
    sampler = Sampler(lambda: pids)
    before = sampler.take().rss
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.settimeout(5)
            try:
                sock.bind((source, 0))
                sock.connect(("127.0.0.1", port))
                sock.sendall(REQUEST)
                sock.recv(65536)  # the small response; the connection stays open
            except OSError:
                socks.pop().close()
        time.sleep(0.5)  # every handler back to waiting for its next request
        after = sampler.take().rss
    finally:
        for sock in socks:
            sock.close()
    return len(socks), (after - before) / len(socks) if socks else math.nan


def held_by_server(pids: list[int], port: int) -> set[tuple[str, int]]:
    """The remote addresses of the connections the server's processes still have open on ``port``.

    Without ``pids`` (``--port`` with no ``--pid``), any process's sockets on ``port``
    count. Sockets no process owns (closed by the server, FIN queued behind unsent
    data) have no PID and count as released either way.
    """
    held: set[tuple[str, int]] = set()
    conns: list[Any] = []
    if not pids:
        with contextlib.suppress(psutil.Error):
            conns = [c for c in psutil.net_connections(kind="tcp") if c.pid is not None]
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            conns += psutil.Process(pid).net_connections(kind="tcp")
    for c in conns:
        if c.laddr and c.laddr[1] == port and c.raddr:
            held.add((c.raddr[0], c.raddr[1]))
    return held


def waiting_in_kernel(port: int) -> set[tuple[str, int]]:
    """Remote addresses of the ESTABLISHED IPv4 connections to local ``port``, owned or not.

    Read from ``/proc/net/tcp``: a connection the server has closed is no longer
    ESTABLISHED (FIN-WAIT or gone), while one still in the accept queue is.
    """
    found: set[tuple[str, int]] = set()
    with contextlib.suppress(OSError), open("/proc/net/tcp") as table:
        next(table, None)
        for line in table:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state != "01" or int(local.rsplit(":", 1)[1], 16) != port:
                continue
            host, rport = remote.split(":")
            quad = bytes.fromhex(host)[::-1]  # little-endian in the table
            found.add((".".join(str(b) for b in quad), int(rport, 16)))
    return found


def watch_attack(attack: Attack, pids: list[int], port: int, until: float) -> dict[tuple[str, int], float]:
    """Poll the socket tables until every attacker is released or ``until``; their hold
    times (:func:`watch_release`)."""
    return watch_release(attack.connected_at, pids, port, until)


def watch_release(
    since: dict[tuple[str, int], float], pids: list[int], port: int, until: float, every: float = 0.2
) -> dict[tuple[str, int], float]:
    """Poll the socket tables every ``every`` s until the server has released each client
    address of ``since`` or ``until``; for each released one, the time from its ``since``.

    Released means no longer in the server's processes and no longer ESTABLISHED in
    the kernel: a connection still in the accept queue is the server's to answer, so
    it counts as held, while one the server closed between two polls (before this
    watcher ever saw it owned) counts as released. A close queued behind data the
    client never reads counts as released: the server let go of it.
    """
    released: dict[tuple[str, int], float] = {}
    pending = set(since)
    while pending and time.monotonic() < until:
        held = held_by_server(pids, port) | waiting_in_kernel(port)
        now = time.monotonic()
        for addr in list(pending):
            if addr not in held:
                released[addr] = now - since[addr]
                pending.discard(addr)
        time.sleep(every)
    return released
