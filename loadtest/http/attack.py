"""The clients that are not load: slowloris attackers, slow readers and idle keep-alive
connections, and how long the server under test holds on to each, read from its own
socket table."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import struct
import threading
import time

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


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x301
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_ALL_BUT_TIME_WAIT = 0xFFF & ~(1 << 6)  # a TIME-WAIT socket is never a process's


def _rows(port: int) -> list[tuple[int, tuple[str, int], str]]:
    """``(inode, remote address, state)`` of every TCP socket on local ``port`` but those
    in TIME-WAIT (inode 0: no process owns it), asked of the kernel's sock_diag.

    Reading ``/proc/net/tcp`` instead (the fallback) makes the kernel print every
    socket of the machine, thousands of TIME-WAIT ones among them: 7 ms of the load's
    CPU a poll here, against 2 ms this way.
    """
    try:
        return _diag_rows(port)
    except OSError:
        return _proc_rows(port)


def _diag_rows(port: int) -> list[tuple[int, tuple[str, int], str]]:
    rows: list[tuple[int, tuple[str, int], str]] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        # inet_diag_req_v2: family, protocol, extensions, pad, states, and an empty socket id.
        req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, _ALL_BUT_TIME_WAIT) + bytes(48)
        header = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(5)
            nl.sendto(header + req, (0, 0))
            done = False
            while not done:
                data = nl.recv(1 << 17)
                off = 0
                while off + 16 <= len(data) and not done:
                    length, kind = struct.unpack_from("=IH", data, off)
                    if kind == _NLMSG_ERROR:
                        raise OSError("sock_diag refused the dump")
                    done = kind == _NLMSG_DONE
                    # inet_diag_msg: family, state, timer, retrans; sport, dport (network
                    # order), source and destination addresses (16 bytes each), ...; inode at 68.
                    msg = off + 16
                    if not done and struct.unpack_from("!H", data, msg + 4)[0] == port:
                        fam, state, dport = data[msg], data[msg + 1], struct.unpack_from("!H", data, msg + 6)[0]
                        remote = data[msg + 24 : msg + 24 + (4 if fam == socket.AF_INET else 16)]
                        (inode,) = struct.unpack_from("=I", data, msg + 68)
                        rows.append((inode, (socket.inet_ntop(fam, remote), dport), f"{state:02X}"))
                    off += (length + 3) & ~3
    return rows


def _proc_rows(port: int) -> list[tuple[int, tuple[str, int], str]]:
    rows: list[tuple[int, tuple[str, int], str]] = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with contextlib.suppress(OSError), open(path) as table:
            next(table, None)
            for line in table:
                fields = line.split()
                local = fields[1]
                if int(local[local.rindex(":") + 1 :], 16) != port or fields[3] == "06":
                    continue
                host, rport = fields[2].split(":")
                raw = bytes.fromhex(host)
                # The table prints each 32-bit word little-endian.
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                rows.append((int(fields[9]), (socket.inet_ntop(family, packed), int(rport, 16)), fields[3]))
    return rows


def _socket_inodes(pids: list[int]) -> set[int]:
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            fds = f"/proc/{pid}/fd"
            for fd in os.listdir(fds):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"{fds}/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(int(link[8:-1]))
    return inodes


def _held(pids: list[int], rows: list[tuple[int, tuple[str, int], str]]) -> set[tuple[str, int]]:
    if not pids:  # any process's: a socket with an inode is one's
        return {remote for inode, remote, _ in rows if inode and remote[1]}
    inodes = _socket_inodes(pids)
    return {remote for inode, remote, _ in rows if inode in inodes and remote[1]}


def held_by_server(pids: list[int], port: int) -> set[tuple[str, int]]:
    """The remote addresses of the connections the server's processes still have open on ``port``.

    Without ``pids`` (``--port`` with no ``--pid``), any process's sockets on ``port``
    count. Sockets no process owns (closed by the server, FIN queued behind unsent
    data) have no PID and count as released either way.
    """
    # Not psutil's walk of the same tables: with 550 attackers it cost the load's CPU
    # 16 ms a poll, every 0.2 s, enough to slow the load it shares a core with.
    return _held(pids, _rows(port))


def waiting_in_kernel(port: int) -> set[tuple[str, int]]:
    """Remote addresses of the ESTABLISHED connections to local ``port``, owned or not.

    A connection the server has closed is no longer ESTABLISHED (FIN-WAIT or gone),
    while one still in the accept queue is.
    """
    return _established(_rows(port))


def _established(rows: list[tuple[int, tuple[str, int], str]]) -> set[tuple[str, int]]:
    return {remote for _, remote, state in rows if state == "01"}


def _held_or_waiting(pids: list[int], port: int) -> set[tuple[str, int]]:
    """:func:`held_by_server` | :func:`waiting_in_kernel`, from one read of the tables."""
    rows = _rows(port)
    return _held(pids, rows) | _established(rows)


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
        held = _held_or_waiting(pids, port)
        now = time.monotonic()
        for addr in list(pending):
            if addr not in held:
                released[addr] = now - since[addr]
                pending.discard(addr)
        time.sleep(every)
    return released
