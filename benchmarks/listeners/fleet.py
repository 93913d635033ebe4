"""The devices of ``python -m benchmarks.listeners``: plain, TLS and WebSocket MQTT
clients, all on one epoll in one process, opened without blocking, beating on their
keep-alive, timing each PINGRESP."""

from __future__ import annotations

import collections
import contextlib
import errno
import heapq
import math
import random
import select
import socket
import ssl
import time

from loadtest.generator.records import CONNACK_OK, PINGREQ, encode_connect
from loadtest.mqtt_frames import frames
from loadtest.tls_load import CertFiles
from loadtest.ws.frames import BINARY, CLOSE, PING, PONG, FrameReader, accepted, client_frame, upgrade_request

from .model import KINDS, Load

__all__ = ["IN_FLIGHT", "OPEN_TIMEOUT", "PATH", "SUBPROTOCOL", "Device", "Fleet", "client_context", "connect_all"]

PATH = "/mqtt"
SUBPROTOCOL = "mqtt"
OPEN_TIMEOUT = 10.0
"""Seconds one device may take to open (TCP, TLS, the WebSocket's 101, the CONNACK)."""
IN_FLIGHT = 64
"""Devices opening at once: a handshake that waits on the server holds up no other."""
PINGRESP_TYPE = 13
CONNACK_TYPE = 2
_WS_PINGREQ = client_frame(BINARY, PINGREQ)


class Device:
    """One device's connection: how far it has opened, what it has read, its PINGREQs in flight."""

    __slots__ = (
        "kind",
        "port",
        "client_id",
        "sock",
        "phase",
        "head",
        "buf",
        "reader",
        "started_at",
        "connack_at",
        "sent",
        "closed_at",
    )

    def __init__(self, kind: str, port: int, client_id: str, sock: socket.socket) -> None:
        self.kind = kind
        self.port = port
        self.client_id = client_id
        self.sock = sock
        self.phase = TCP
        self.head = b""
        """The WebSocket's 101, as it comes."""
        self.buf = bytearray()
        """MQTT bytes not yet a whole packet."""
        self.reader = FrameReader() if kind == "ws" else None
        self.started_at = time.monotonic()
        self.connack_at = math.nan
        self.sent: collections.deque[float] = collections.deque()
        self.closed_at = math.nan


# How far a device has opened: connecting, in its TLS handshake, waiting for the
# WebSocket's 101, waiting for its CONNACK, online.
TCP, TLS, UPGRADE, CONNACK, ONLINE = range(5)


class Fleet:
    """Every device of one target's run on one epoll, opened without blocking (a slow
    handshake holds up no other device's beat), their pings on a heap."""

    def __init__(self, load: Load, ctx: ssl.SSLContext) -> None:
        self.load = load
        self.ctx = ctx
        self.rng = random.Random(load.seed)
        self.ep = select.epoll()
        self.by_fd: dict[int, Device] = {}
        self.opening: dict[int, Device] = {}
        self.devices: list[Device] = []
        self.open_errors: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.pings: list[tuple[float, int]] = []  # (due, fd)
        self.pinging = True
        self.recording = False
        self.latencies: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.connect_times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.heartbeats: dict[str, int] = dict.fromkeys(KINDS, 0)

    def begin(self, kind: str, port: int, client_id: str) -> None:
        """Start opening a device of ``kind`` on ``port``: its TCP connect is under way."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        # A PINGREQ goes as soon as it is written, as the servers' answers do.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            sock.close()
            self.open_errors[kind] += 1
            return
        device = Device(kind, port, client_id, sock)
        fd = sock.fileno()
        self.devices.append(device)
        self.by_fd[fd] = device
        self.opening[fd] = device
        self.ep.register(fd, select.EPOLLOUT)

    def expire_opening(self, older_than: float) -> None:
        """Give up on the devices still opening that began before ``older_than``."""
        for fd, device in list(self.opening.items()):
            if device.started_at < older_than:
                self._closed(fd, device)

    def serve(self, timeout: float) -> None:
        """Advance the devices opening, read what came, then send the PINGREQs that are due."""
        for fd, _events in self.ep.poll(timeout):
            device = self.by_fd.get(fd)
            if device is None:
                continue
            if device.phase < CONNACK:
                self._advance(fd, device)
                continue
            data = _receive(device.sock)
            if data is None:
                continue
            if not data:
                self._closed(fd, device)
                continue
            self._feed(fd, device, data)
        if self.pinging:
            self._beat()

    def _beat(self) -> None:
        now = time.monotonic()
        while self.pings and self.pings[0][0] <= now:
            due, fd = heapq.heappop(self.pings)
            device = self.by_fd.get(fd)
            if device is None:
                continue
            stamp = time.monotonic()  # before send(): the answer cannot come earlier
            try:
                device.sock.send(_WS_PINGREQ if device.kind == "ws" else PINGREQ)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                pass  # a full buffer two bytes can't fit: this beat is skipped, the next one goes
            except OSError:
                self._closed(fd, device)
                continue
            else:
                device.sent.append(stamp)
            # On the device's own schedule, not from now: the load stays even if this loop lags.
            heapq.heappush(self.pings, (due + self.load.keepalive, fd))

    def _advance(self, fd: int, device: Device) -> None:
        """The next step of opening ``device``, now that its socket is ready."""
        sock = device.sock
        try:
            if device.phase == TCP:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    raise ConnectionError("connect failed")
                if device.kind == "mqtts":
                    device.sock = self.ctx.wrap_socket(sock, server_hostname="localhost", do_handshake_on_connect=False)
                    device.phase = TLS
                elif device.kind == "ws":
                    _send_whole(sock, upgrade_request(device.port, PATH, SUBPROTOCOL))
                    device.phase = UPGRADE
                    self.ep.modify(fd, select.EPOLLIN)
                    return
                else:
                    self._send_connect(fd, device)
                    return
            if device.phase == TLS:
                tls = device.sock
                assert isinstance(tls, ssl.SSLSocket)
                try:
                    tls.do_handshake()
                except ssl.SSLWantReadError:
                    self.ep.modify(fd, select.EPOLLIN)
                    return
                except ssl.SSLWantWriteError:
                    self.ep.modify(fd, select.EPOLLOUT)
                    return
                self._send_connect(fd, device)
                return
            # UPGRADE: the 101's head, then whatever came after it.
            data = _receive(sock)
            if data is None:
                return
            if not data:
                raise ConnectionError("closed before the 101")
            device.head += data
            head, sep, rest = device.head.partition(b"\r\n\r\n")
            if not sep:
                if len(device.head) > 16384:
                    raise ConnectionError("no end to the 101's head")
                return
            if not accepted(head):
                raise ConnectionError("the WebSocket was refused")
            self._send_connect(fd, device)
            if rest:
                self._feed(fd, device, rest)
        except (OSError, ConnectionError):
            self._closed(fd, device)

    def _send_connect(self, fd: int, device: Device) -> None:
        connect = encode_connect(device.client_id, self.load.keepalive)
        _send_whole(device.sock, client_frame(BINARY, connect) if device.kind == "ws" else connect)
        device.phase = CONNACK
        self.ep.modify(fd, select.EPOLLIN | select.EPOLLRDHUP)

    def _feed(self, fd: int, device: Device, data: bytes) -> None:
        if device.reader is not None:
            for frame in device.reader.feed(data):
                if frame.opcode == BINARY:
                    device.buf += frame.payload  # MQTT packets may span frames
                elif frame.opcode == PING:
                    with contextlib.suppress(OSError):
                        device.sock.send(client_frame(PONG, frame.payload))
                elif frame.opcode == CLOSE:
                    self._closed(fd, device)
                    return
        else:
            device.buf += data
        found, used = frames(device.buf)
        now = time.monotonic()
        for first, start, end in found:
            kind = first >> 4
            if kind == PINGRESP_TYPE and device.sent:
                if self.recording:
                    self.latencies[device.kind].append(now - device.sent[0])
                    self.heartbeats[device.kind] += 1
                device.sent.popleft()
            elif kind == CONNACK_TYPE and device.phase == CONNACK:
                if bytes(device.buf[start - 2 : end]) != CONNACK_OK:
                    self._closed(fd, device)
                    return
                device.phase = ONLINE
                device.connack_at = now
                del self.opening[fd]
                self.connect_times[device.kind].append(now - device.started_at)
                # The first beat at a random point of the first keep-alive: the phases spread.
                heapq.heappush(self.pings, (now + self.load.keepalive * self.rng.uniform(0.05, 1.0), fd))
        del device.buf[:used]

    def _closed(self, fd: int, device: Device) -> None:
        if self.by_fd.pop(fd, None) is None:
            return
        if self.opening.pop(fd, None) is not None:
            self.open_errors[device.kind] += 1
        device.closed_at = time.monotonic()
        with contextlib.suppress(OSError, ValueError):
            self.ep.unregister(fd)

    def online(self, kind: str | None = None) -> int:
        """Devices (of ``kind``) with a CONNACK and an open connection."""
        return sum(1 for d in self.by_fd.values() if d.phase == ONLINE and kind in (None, d.kind))

    def close(self) -> None:
        """Close every device's socket and the epoll."""
        for device in self.devices:
            device.sock.close()
        self.ep.close()


def _send_whole(sock: socket.socket, data: bytes) -> None:
    # A request or a CONNECT of a few hundred bytes into a fresh socket's empty buffer
    # goes whole; anything else is a connection not worth measuring.
    if sock.send(data) != len(data):
        raise ConnectionError("a short send on a fresh socket")


def _receive(sock: socket.socket) -> bytes | None:
    """What a ready non-blocking socket has: None if nothing whole yet, b"" once closed."""
    try:
        data = sock.recv(65536)
    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return None
    except OSError:
        return b""
    if isinstance(sock, ssl.SSLSocket):
        # Decrypted bytes epoll cannot see: read them now, or they wait for the next record.
        while data and sock.pending():
            data += sock.recv(sock.pending())
    return data


def client_context(certs: CertFiles) -> ssl.SSLContext:
    """The devices' TLS context: trusts ``certs``' CA, checks the name, resumes no session."""
    ctx = certs.client_context()
    # The devices of one target each do a full handshake, as a fleet of fresh devices would.
    ctx.options |= ssl.OP_NO_TICKET
    return ctx


def connect_all(fleet: Fleet, ports: dict[str, int], count: int, prefix: str) -> None:
    """``count`` devices on each listener, one of each kind in turn, ``IN_FLIGHT`` opening
    at a time, all within the load's open timeout (those not online by then are open
    errors). The devices online already keep beating throughout."""
    order = [(kind, i) for i in range(count) for kind in KINDS]
    deadline = time.monotonic() + fleet.load.open_timeout
    begun = 0
    while (begun < len(order) or fleet.opening) and time.monotonic() < deadline:
        while begun < len(order) and len(fleet.opening) < IN_FLIGHT:
            kind, i = order[begun]
            begun += 1
            fleet.begin(kind, ports[kind], f"{prefix}-{kind}-{i}")
        fleet.serve(0.01)
        fleet.expire_opening(time.monotonic() - OPEN_TIMEOUT)
    fleet.expire_opening(math.inf)
    for kind, _ in order[begun:]:
        fleet.open_errors[kind] += 1
