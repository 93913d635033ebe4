"""A small MQTT 3.1.1 client on trio for the abuse test, healthy or hostile alike: one
connection from a chosen loopback source address, the server's packets framed as they
come (:func:`~loadtest.mqtt_frames.frames`), CONNACK, SUBACK, PUBACK and PINGRESP
noted, PUBLISHes handed to a callback. Every wait is bounded by a timeout."""

from __future__ import annotations

import collections
import contextlib
import math
import socket
import struct
import time
from collections.abc import Callable

import trio

from servers.heartbeat.mqtt import encoders

from ..mqtt_frames import frames

__all__ = ["Client", "OnPublish", "OnRoundTrip", "open_socket"]

OnPublish = Callable[[str, bytes, bool], None]
"""Called with (topic, payload, retain) for each PUBLISH the server sends."""
OnRoundTrip = Callable[[float, float], None]
"""Called with (sent, round trip) for each PINGRESP (monotonic seconds)."""

_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST
_CONNACK, _PUBLISH, _PUBACK, _SUBACK, _PINGRESP = 0x2, 0x3, 0x4, 0x9, 0xD


async def open_socket(port: int, source: str, within: float = 5.0, host: str = "127.0.0.1") -> trio.SocketStream:
    """A TCP connection to ``host:port`` from ``source`` (a loopback address of 127.0.0.0/8)."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        await sock.bind((source, 0))
        with trio.fail_after(within):
            await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    stream = trio.SocketStream(sock)
    # Small writes that must go at once: Nagle would hold a PINGREQ for the last one's ACK.
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return stream


class Client:
    """One MQTT connection: start it with :meth:`start`, which runs its reader in a nursery."""

    def __init__(
        self, stream: trio.SocketStream, on_publish: OnPublish | None = None, on_rtt: OnRoundTrip | None = None
    ) -> None:
        self.stream = stream
        self.on_publish = on_publish
        self.on_rtt = on_rtt
        self.connack = -1
        """The CONNACK return code; -1 before one came."""
        self.subacks: dict[int, bytes] = {}
        """SUBACK codes by packet id."""
        self.pubacks: set[int] = set()
        self.pingresps = 0
        self.pings: collections.deque[float] = collections.deque()
        """Send times of the PINGREQs not answered yet, oldest first (the server answers in order)."""
        self.closed = False
        """The server closed the connection (or it broke)."""
        self.closed_at = math.nan
        self._changed = trio.Event()
        self._sending = trio.StrictFIFOLock()

    @classmethod
    async def start(
        cls,
        nursery: trio.Nursery,
        port: int,
        source: str = "127.0.0.1",
        on_publish: OnPublish | None = None,
        on_rtt: OnRoundTrip | None = None,
    ) -> Client:
        """Connect from ``source`` and start reading in ``nursery``."""
        client = cls(await open_socket(port, source), on_publish, on_rtt)
        nursery.start_soon(client.read)
        return client

    async def send(self, data: bytes) -> bool:
        """Send ``data``; False if the connection is gone."""
        async with self._sending:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
        return True

    async def until(self, done: Callable[[], bool], within: float) -> bool:
        """Wait until ``done()`` (checked after each packet) or the connection closes, at most ``within`` s."""
        with trio.move_on_after(within):
            while not done() and not self.closed:
                await self._changed.wait()
        return done()

    async def connect(
        self,
        client_id: str,
        within: float = 5.0,
        keep_alive: int = 30,
        will: tuple[str, bytes, bool] | None = None,
        username: str | None = None,
    ) -> int:
        """CONNECT (with ``will``: topic, message, retain) and wait for the CONNACK; its
        return code, -1 if none came."""
        topic, message, retain = will if will is not None else (None, None, False)
        packet = encoders.encode_connect(
            client_id, keep_alive, will_topic=topic, will_message=message, will_retain=retain, username=username
        )
        if await self.send(packet):
            await self.until(lambda: self.connack >= 0, within)
        return self.connack

    async def subscribe(self, packet_id: int, filters: list[str], within: float = 5.0) -> bytes | None:
        """SUBSCRIBE at QoS 0; the SUBACK's codes, None if none came."""
        if await self.send(encoders.encode_subscribe(packet_id, [(f, 0) for f in filters])):
            await self.until(lambda: packet_id in self.subacks, within)
        return self.subacks.get(packet_id)

    async def publish(
        self, packet_id: int, topic: str, payload: bytes, retain: bool = False, within: float = 5.0
    ) -> bool:
        """A QoS 1 PUBLISH; whether its PUBACK came (the server has taken it, or dropped it as denied)."""
        packet = encoders.encode_publish(topic, payload, qos=1, retain=retain, packet_id=packet_id)
        if await self.send(packet):
            await self.until(lambda: packet_id in self.pubacks, within)
        return packet_id in self.pubacks

    async def ping(self) -> bool:
        """Send a PINGREQ (its round trip goes to ``on_rtt``)."""
        self.pings.append(time.monotonic())
        return await self.send(encoders.encode_pingreq())

    async def round_trip(self, within: float = 5.0) -> bool:
        """A PINGREQ and its PINGRESP: everything the server had for us before it has come."""
        answered = self.pingresps + len(self.pings) + 1
        if not await self.ping():
            return False
        return await self.until(lambda: self.pingresps >= answered, within)

    async def disconnect(self) -> None:
        """DISCONNECT and close."""
        await self.send(encoders.encode_disconnect())
        await self.stream.aclose()

    def close(self) -> None:
        """Close (FIN) without a DISCONNECT, if not closed yet; the reader then ends."""
        self.stream.socket.close()

    def abort(self) -> None:
        """Close with RST, no DISCONNECT: the connection is lost, as a device's that vanished."""
        sock = self.stream.socket
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
        sock.close()

    async def read(self) -> None:
        """Read until the connection ends, noting each packet."""
        buf = bytearray()
        while True:
            try:
                data = await self.stream.receive_some(256 * 1024)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                break
            buf += data
            try:
                found, used = frames(buf)
            except ValueError:
                break
            for first, start, end in found:
                self._packet(first, bytes(buf[start:end]))
            del buf[:used]
            self._wake()
        self.closed = True
        self.closed_at = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _packet(self, first: int, body: bytes) -> None:
        kind = first >> 4
        if kind == _PINGRESP:
            self.pingresps += 1
            if self.pings:
                sent = self.pings.popleft()
                if self.on_rtt is not None:
                    self.on_rtt(sent, time.monotonic() - sent)
        elif kind == _PUBLISH:
            size = int.from_bytes(body[:2], "big")
            start = 2 + size + (2 if first & 0x06 else 0)
            if self.on_publish is not None:
                self.on_publish(body[2 : 2 + size].decode("utf-8", "replace"), body[start:], bool(first & 0x01))
        elif kind == _CONNACK and len(body) == 2:
            self.connack = body[1]
        elif kind == _SUBACK and len(body) >= 2:
            self.subacks[int.from_bytes(body[:2], "big")] = body[2:]
        elif kind == _PUBACK and len(body) == 2:
            self.pubacks.add(int.from_bytes(body, "big"))
