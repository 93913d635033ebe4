"""Raw-socket MQTT 3.1.1 clients for the durability benchmark, driven by one selector
loop: publishers that pipeline QoS 1 or 2 messages within a window, and persistent
subscribers that count what they are given.

Each message's payload starts with its number (``seq``), so a subscriber knows which
message it got, and the counts are exact. A subscriber keeps its QoS 2 state across
reconnects (the packet ids whose PUBREL has not come, MQTT 3.1.1 §4.3.3's method B),
as a persistent client must: a PUBLISH resent with an id it still holds is the same
message, not a second delivery.
"""

from __future__ import annotations

import collections
import selectors
import socket
import struct
import time
from collections.abc import Callable, Iterable

from loadtest.mqtt_frames import frames
from servers.heartbeat.mqtt.encoders import (
    encode_connect,
    encode_disconnect,
    encode_puback,
    encode_pubcomp,
    encode_publish,
    encode_pubrec,
    encode_pubrel,
    encode_subscribe,
)

__all__ = ["Client", "Publisher", "Subscriber", "connect_many", "drive", "payload", "seq_of"]

_U16 = struct.Struct("!H")
PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK = 3, 4, 5, 6, 7, 9


def payload(seq: int, size: int) -> bytes:
    """Message ``seq``'s payload: its number, padded to ``size`` bytes."""
    head = b"%010d" % seq
    return head + b"." * max(0, size - len(head))


def seq_of(data: bytes) -> int:
    """The number a payload made by :func:`payload` starts with."""
    return int(data[:10])


class Client:
    """One connection: a socket, what it has read and not parsed, whether it is open."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.sock: socket.socket | None = None
        self.buf = bytearray()
        self.session_present = False

    def open(self, port: int, clean: bool, keep_alive: int = 60, timeout: float = 30.0) -> None:
        """Connect and wait for CONNACK 0 (raises otherwise)."""
        self.start(port, clean, keep_alive)
        self.finish(timeout)

    def start(self, port: int, clean: bool, keep_alive: int = 60) -> None:
        """Connect and send CONNECT; :meth:`finish` reads the CONNACK."""
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(encode_connect(self.client_id, keep_alive, clean))
        self.sock, self.buf = sock, bytearray()

    def finish(self, timeout: float = 30.0) -> None:
        """Read the CONNACK :meth:`start` asked for."""
        sock = self.sock
        assert sock is not None
        sock.settimeout(timeout)
        while len(self.buf) < 4:
            chunk = sock.recv(4 - len(self.buf))
            if not chunk:
                raise ConnectionError(f"{self.client_id}: closed before CONNACK")
            self.buf += chunk
        if self.buf[0] != 0x20 or self.buf[3] != 0:
            raise ConnectionError(f"{self.client_id}: CONNACK {bytes(self.buf[:4]).hex()}")
        self.session_present = bool(self.buf[2] & 1)
        self.buf = bytearray()
        sock.settimeout(10)

    @property
    def closed(self) -> bool:
        """Whether the connection is gone."""
        return self.sock is None

    def send(self, data: bytes) -> None:
        """Write ``data`` (a reset server closes the connection quietly)."""
        if self.sock is None or not data:
            return
        try:
            self.sock.sendall(data)
        except OSError:
            self.close()

    def read(self) -> bool:
        """Read what is there (the selector said so) and handle whole packets; False at EOF."""
        if self.sock is None:
            return False
        try:
            chunk = self.sock.recv(1 << 20)
        except (BlockingIOError, TimeoutError):
            return True
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return False
        self.buf += chunk
        found, used = frames(self.buf)
        out: list[bytes] = []
        for first, start, end in found:
            self.handle(first, bytes(self.buf[start:end]), out)
        del self.buf[:used]
        if out:
            self.send(b"".join(out))
        return True

    def handle(self, first: int, body: bytes, out: list[bytes]) -> None:
        """One packet from the server; replies go to ``out``."""

    def pump(self) -> None:
        """Send what is due (publishers)."""

    def leave(self) -> None:
        """DISCONNECT, then close."""
        self.send(encode_disconnect())
        self.close()

    def close(self) -> None:
        """Close without a word (the server may be dead)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Publisher(Client):
    """Publishes ``count`` messages (None: until stopped) at ``qos``, at most ``window``
    unacknowledged, on ``topic`` (or, with ``distinct``, on ``topic/<seq>``, with RETAIN).

    ``acked``: the messages the server took responsibility for (PUBACK; PUBREC at QoS 2).
    ``rate``: messages a second at most (0: as fast as the window allows).
    """

    def __init__(
        self,
        client_id: str,
        topic: str,
        qos: int,
        *,
        count: int | None = None,
        window: int = 32,
        size: int = 32,
        retain: bool = False,
        rate: float = 0.0,
    ) -> None:
        super().__init__(client_id)
        self.topic, self.qos, self.count, self.window, self.size = topic, qos, count, window, size
        self.retain, self.rate = retain, rate
        self.next_seq = 0
        self.inflight: dict[int, int] = {}
        """Packet id -> seq, sent and not yet acknowledged (at QoS 2: not yet PUBREC'd)."""
        self.releasing: dict[int, int] = {}
        """QoS 2: packet id -> seq, PUBREL sent, PUBCOMP not yet come."""
        self.acked: set[int] = set()
        self.first_sent = 0.0
        self.last_acked = 0.0
        self.started = 0.0
        self.stopped = False
        self._next_id = 0

    def _packet_id(self) -> int:
        while True:
            self._next_id = self._next_id % 65535 + 1
            if self._next_id not in self.inflight and self._next_id not in self.releasing:
                return self._next_id

    @property
    def settled(self) -> bool:
        """Nothing sent waits for an acknowledgement."""
        return not self.inflight and not self.releasing

    @property
    def done(self) -> bool:
        """Every message sent and acknowledged (never, without a count)."""
        return self.count is not None and self.next_seq >= self.count and self.settled

    def pump(self) -> None:
        if self.closed or self.stopped:
            return
        now = time.monotonic()
        if not self.started:
            self.started = now
        allowed = self.window - len(self.inflight)
        if self.count is not None:
            allowed = min(allowed, self.count - self.next_seq)
        if self.rate:
            allowed = min(allowed, int((now - self.started) * self.rate) - self.next_seq)
        if allowed <= 0:
            return
        out = []
        for _ in range(allowed):
            seq = self.next_seq
            self.next_seq += 1
            packet_id = self._packet_id()
            self.inflight[packet_id] = seq
            topic = f"{self.topic}/{seq}" if self.retain else self.topic
            out.append(encode_publish(topic, payload(seq, self.size), self.qos, self.retain, packet_id))
        if not self.first_sent:
            self.first_sent = time.perf_counter()
        self.send(b"".join(out))

    def handle(self, first: int, body: bytes, out: list[bytes]) -> None:
        kind = first >> 4
        (packet_id,) = _U16.unpack_from(body)
        if kind == PUBACK and self.qos == 1:
            seq = self.inflight.pop(packet_id, None)
            if seq is not None:
                self.acked.add(seq)
                self.last_acked = time.perf_counter()
        elif kind == PUBREC:
            seq = self.inflight.pop(packet_id, None)
            if seq is not None:
                self.acked.add(seq)
                self.releasing[packet_id] = seq
                self.last_acked = time.perf_counter()
            out.append(encode_pubrel(packet_id))
        elif kind == PUBCOMP:
            self.releasing.pop(packet_id, None)

    def resume(self) -> None:
        """After a reconnect to its persistent session: resend what the server never
        acknowledged (DUP), and PUBREL for what it did but never completed."""
        out = []
        for packet_id, seq in self.inflight.items():
            topic = f"{self.topic}/{seq}" if self.retain else self.topic
            out.append(encode_publish(topic, payload(seq, self.size), self.qos, self.retain, packet_id, dup=True))
        out += [encode_pubrel(packet_id) for packet_id in self.releasing]
        self.send(b"".join(out))


class Subscriber(Client):
    """A persistent subscriber: counts each message (by topic and seq) it is given."""

    def __init__(self, client_id: str) -> None:
        super().__init__(client_id)
        self.got: collections.Counter[tuple[str, int]] = collections.Counter()
        self.held: dict[int, tuple[str, int]] = {}
        """QoS 2: packet id -> message, PUBREC sent and PUBREL not yet come."""
        self.reused = 0
        """QoS 2 PUBLISHes with a held packet id but another message (a server that forgot it)."""
        self.last_message = 0.0
        self.subacked = False

    def subscribe(self, filters: Iterable[tuple[str, int]]) -> None:
        """SUBSCRIBE and wait for the SUBACK (blocking)."""
        assert self.sock is not None
        self.subacked = False
        self.send(encode_subscribe(1, list(filters)))
        deadline = time.monotonic() + 30
        while not self.subacked:
            if time.monotonic() > deadline or not self.read():
                raise ConnectionError(f"{self.client_id}: no SUBACK")

    def handle(self, first: int, body: bytes, out: list[bytes]) -> None:
        kind = first >> 4
        if kind == PUBLISH:
            qos = (first >> 1) & 3
            (length,) = _U16.unpack_from(body)
            topic = body[2 : 2 + length].decode()
            pos = 2 + length
            packet_id = _U16.unpack_from(body, pos)[0] if qos else 0
            key = (topic, seq_of(body[pos + (2 if qos else 0) :]))
            self.last_message = time.monotonic()
            if qos == 2:
                held = self.held.get(packet_id)
                if held is None or held != key:
                    self.reused += held is not None
                    self.held[packet_id] = key
                    self.got[key] += 1
                out.append(encode_pubrec(packet_id))
                return
            self.got[key] += 1
            if qos == 1:
                out.append(encode_puback(packet_id))
        elif kind == PUBREL:
            (packet_id,) = _U16.unpack_from(body)
            self.held.pop(packet_id, None)
            out.append(encode_pubcomp(packet_id))
        elif kind == SUBACK:
            if any(code == 0x80 for code in body[2:]):
                raise ConnectionError(f"{self.client_id}: subscription refused")
            self.subacked = True

    def seqs(self, topic: str) -> set[int]:
        """The message numbers it got on ``topic``."""
        return {seq for (t, seq) in self.got if t == topic}

    def copies(self, topic: str) -> int:
        """Deliveries beyond the first on ``topic`` (a QoS 2 subscription must have none)."""
        return sum(n - 1 for (t, _), n in self.got.items() if t == topic)


def drive(clients: Iterable[Client], until: Callable[[], bool], seconds: float, quiet: float = 0.0) -> bool:
    """Run the clients (publishers send, everyone reads) until ``until()`` says so, or
    ``seconds`` pass; with ``quiet``, also stop once nothing has been read for that
    long. Returns whether ``until()`` was met."""
    sel = selectors.DefaultSelector()
    live = [c for c in clients if c.sock is not None]
    for c in live:
        assert c.sock is not None
        sel.register(c.sock, selectors.EVENT_READ, c)
    deadline = time.monotonic() + seconds
    heard = time.monotonic()
    try:
        while True:
            if until():
                return True
            now = time.monotonic()
            if now > deadline or (quiet and now - heard > quiet):
                return False
            for c in live:
                c.pump()
            for key, _ in sel.select(timeout=0.02):
                client: Client = key.data
                sock = client.sock
                heard = time.monotonic()
                if not client.read() and sock is not None:
                    sel.unregister(sock)
    finally:
        sel.close()


def connect_many(clients: list[Client], port: int, clean: bool, keep_alive: int = 60, batch: int = 200) -> None:
    """Connect ``clients`` (devices), ``batch`` CONNECTs in flight at a time."""
    for i in range(0, len(clients), batch):
        group = clients[i : i + batch]
        for c in group:
            c.start(port, clean, keep_alive)
        for c in group:
            c.finish()
