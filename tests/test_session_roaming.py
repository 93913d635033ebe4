"""A persistent session that roams between workers while messages keep coming.

Issue 27 asked whether a QoS 1 message published just as its persistent subscriber
closed and reconnected on another worker could be lost. This runs that race many
times against the server as its own process (two workers, SO_REUSEPORT spreading
the connections): a device that reconnects every few milliseconds, leaving each
time by DISCONNECT, a FIN or a reset, and a publisher whose QoS 1 and QoS 2
messages land on either worker meanwhile. Now and then the device subscribes to a
new topic and the publisher answers on it at once, from whichever worker it lands
on (the race of b168a26: a SUBACK that went out before the other worker routed by
the filter lost the answer). Every message is accounted for at the
end: delivered to the device's application (QoS 2 exactly once, QoS 1 at least
once, any repeat marked DUP), none lost, nothing left queued.

Bounded in count and time; wall clock, real sockets, the server stopped by its PID.
"""

from __future__ import annotations

import queue
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from servers.heartbeat.mqtt import encoders

from .test_heartbeat_clients import Server, start_server

__all__ = ["start_server"]  # the fixture

MESSAGES = 240
SECONDS = 40.0  # a bound, not the expected time (5 s here)
TOPIC = "cmd/roamer"


def split(buf: bytearray) -> list[tuple[int, bytes]]:
    """Take the whole packets off the front of ``buf``: (first byte, body) each."""
    out: list[tuple[int, bytes]] = []
    while len(buf) >= 2:
        length, shift, i = 0, 0, 1
        while True:
            if i >= len(buf):
                return out
            byte = buf[i]
            i += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if len(buf) < i + length:
            break
        out.append((buf[0], bytes(buf[i : i + length])))
        del buf[: i + length]
    return out


@dataclass
class Device:
    """The device's application and its MQTT client state, which lives across connections
    (a persistent session's client keeps its QoS 2 packet ids until PUBREL)."""

    port: int
    rng: random.Random
    delivered: list[tuple[bytes, int, bool]] = field(default_factory=list)
    """(payload, QoS, DUP) of each PUBLISH handed to the application."""
    repeats: list[tuple[bytes, bool]] = field(default_factory=list)
    """(payload, DUP) of QoS 2 PUBLISHes the client recognised as already received."""
    awaiting_release: set[int] = field(default_factory=set)
    cycles: int = 0
    subscribing: dict[int, str] = field(default_factory=dict)
    """SUBSCRIBE packet id -> the new topic it asks for."""
    answer_on: queue.SimpleQueue[str] = field(default_factory=queue.SimpleQueue)
    """Topics just subscribed to (their SUBACK came), for the publisher to publish on at once."""

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(encoders.encode_connect("roamer", keep_alive=30, clean_session=False))
        return sock

    def reconnect(self) -> tuple[socket.socket, bytearray]:
        """A connection whose CONNECT was accepted; one refused as server-unavailable
        (the supervisor answered too late on a busy machine) is tried again."""
        for _ in range(20):
            sock = self.connect()
            sock.settimeout(5)
            buf = bytearray()
            while len(buf) < 4:
                data = sock.recv(4 - len(buf))
                assert data, "closed before CONNACK"
                buf += data
            if buf[:3] == b"\x20\x02\x01" and buf[3] == 0:
                return sock, bytearray()
            assert bytes(buf) == encoders.encode_connack(False, 3), f"CONNACK {bytes(buf)!r}"
            sock.close()
        raise AssertionError("refused 20 times")

    def serve(self, sock: socket.socket, buf: bytearray, seconds: float) -> bool:
        """Answer what arrives for ``seconds``; False once the server closed the connection."""
        until = time.monotonic() + seconds
        while True:
            left = until - time.monotonic()
            sock.settimeout(max(left, 0.001))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                data = None
            except ConnectionError:
                return False
            if data == b"":
                return False
            if data:
                buf += data
                for first, body in split(buf):
                    self.handle(sock, first, body)
            if left <= 0:
                return True

    def handle(self, sock: socket.socket, first: int, body: bytes) -> None:
        kind = first >> 4
        if kind == 3:  # PUBLISH
            qos, dup = (first >> 1) & 3, bool(first & 8)
            n = int.from_bytes(body[:2], "big")
            packet_id = int.from_bytes(body[2 + n : 4 + n], "big")
            payload = body[4 + n :]
            if qos == 1:
                self.delivered.append((payload, 1, dup))
                sock.sendall(encoders.encode_puback(packet_id))
            elif packet_id in self.awaiting_release:  # MQTT 4.3.3, method B: not again
                self.repeats.append((payload, dup))
                sock.sendall(encoders.encode_pubrec(packet_id))
            else:
                self.awaiting_release.add(packet_id)
                self.delivered.append((payload, 2, dup))
                sock.sendall(encoders.encode_pubrec(packet_id))
        elif kind == 6:  # PUBREL
            packet_id = int.from_bytes(body[:2], "big")
            self.awaiting_release.discard(packet_id)
            sock.sendall(encoders.encode_pubcomp(packet_id))
        elif kind == 9:  # SUBACK
            topic = self.subscribing.pop(int.from_bytes(body[:2], "big"))
            assert body[2:] == b"\x02", f"SUBACK {body!r}"
            self.answer_on.put(topic)
        else:
            assert kind in (2, 13), f"unexpected packet type {kind}"  # CONNACK, PINGRESP

    def leave(self, sock: socket.socket) -> None:
        """By DISCONNECT, a plain close (FIN, no DISCONNECT) or a reset, at random."""
        way = self.rng.randrange(3)
        try:
            if way == 0:
                sock.sendall(encoders.encode_disconnect())
            elif way == 2:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        sock.close()

    def roam(self, stop: threading.Event) -> None:
        while not stop.is_set():
            sock = self.connect()
            self.cycles += 1
            if self.cycles % 4 == 0:
                packet_id = self.cycles % 60000 + 1
                self.subscribing[packet_id] = f"{TOPIC}/{self.cycles}"
                sock.sendall(encoders.encode_subscribe(packet_id, [(f"{TOPIC}/{self.cycles}", 2)]))
            self.serve(sock, bytearray(), self.rng.random() * 0.03)
            self.leave(sock)


def next_packet(sock: socket.socket, buf: bytearray) -> tuple[int, bytes]:
    """The publisher's next packet from the server (it expects one at a time)."""
    while True:
        packets = split(buf)
        if packets:
            assert len(packets) == 1
            return packets[0]
        data = sock.recv(4096)
        assert data, "the publisher's connection was closed"
        buf.extend(data)


def publish_all(
    port: int,
    rng: random.Random,
    sent: list[tuple[bytes, int]],
    answer_on: queue.SimpleQueue[str],
    stop: threading.Event,
) -> None:
    """QoS 1 and 2 messages, a few per connection, each complete before the next; on a
    topic the device has just subscribed to, when there is one."""
    deadline = time.monotonic() + SECONDS
    k = 0
    try:
        while k < MESSAGES and time.monotonic() < deadline:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.settimeout(5)
            sock.sendall(encoders.encode_connect("", keep_alive=30))
            buf = bytearray()
            assert next_packet(sock, buf)[0] == 0x20
            for _ in range(min(rng.randint(1, 4), MESSAGES - k)):
                qos = 1 + k % 2
                payload = b"m-%d" % k
                topic = TOPIC if answer_on.empty() else answer_on.get()
                sock.sendall(encoders.encode_publish(topic, payload, qos=qos, packet_id=1))
                if qos == 1:
                    assert next_packet(sock, buf) == (0x40, b"\x00\x01")
                else:
                    assert next_packet(sock, buf) == (0x50, b"\x00\x01")
                    sock.sendall(encoders.encode_pubrel(1))
                    assert next_packet(sock, buf) == (0x70, b"\x00\x01")
                sent.append((payload, qos))  # acknowledged: the server owns it now
                k += 1
                time.sleep(rng.random() * 0.004)
            sock.sendall(encoders.encode_disconnect())
            sock.close()
    finally:
        stop.set()


def test_a_roaming_persistent_session_loses_no_message(start_server: object) -> None:
    server: Server = start_server(workers=2)  # type: ignore[operator]
    rng = random.Random(27)
    device = Device(server.port, random.Random(28))
    first = device.connect()
    first.settimeout(5)
    first.sendall(encoders.encode_subscribe(1, [(TOPIC, 2)]))
    buf, kinds = bytearray(), list[int]()
    while kinds != [0x20, 0x90]:  # CONNACK, SUBACK
        buf += first.recv(64)
        kinds += [kind for kind, _ in split(buf)]
    first.sendall(encoders.encode_disconnect())
    first.close()

    sent: list[tuple[bytes, int]] = []
    stop = threading.Event()
    roamer = threading.Thread(target=device.roam, args=(stop,))
    roamer.start()
    publish_all(server.port, rng, sent, device.answer_on, stop)
    roamer.join(10)
    assert not roamer.is_alive()

    last, tail = device.reconnect()  # what is still queued in the session comes now
    give_up = time.monotonic() + 10
    while len({p for p, _, _ in device.delivered}) < len(sent) and time.monotonic() < give_up:
        assert device.serve(last, tail, 0.5), f"the server closed the last connection: {server.events()[-6:]}"
    device.serve(last, tail, 0.5)  # and nothing more than that
    last.sendall(encoders.encode_disconnect())
    last.close()

    # Every session of the device was on one of both workers at some point.
    epochs = {e["epoch"] for e in server.events() if e["client_id"] == "roamer" and e["status"] == "online"}
    assert {str(epoch).split(".")[0] for epoch in epochs} == {"0", "1"}
    assert device.cycles >= 20 and len(sent) == MESSAGES, (device.cycles, len(sent))

    got: dict[bytes, list[tuple[int, bool]]] = {}
    for payload, qos, dup in device.delivered:
        got.setdefault(payload, []).append((qos, dup))
    missing = [payload for payload, _ in sent if payload not in got]
    assert missing == [], f"{len(missing)} of {len(sent)} acknowledged messages never delivered"
    assert set(got) == {payload for payload, _ in sent}
    for payload, qos in sent:
        copies = got[payload]
        assert all(q == qos for q, _ in copies)
        if qos == 2:
            assert len(copies) == 1, f"QoS 2 {payload!r} delivered {len(copies)} times"
        else:
            assert all(dup for _, dup in copies[1:]), f"QoS 1 {payload!r} repeated without DUP: {copies}"
    assert all(dup for _, dup in device.repeats)  # a QoS 2 resend always says so
    assert device.awaiting_release == set()  # every QoS 2 exchange completed
