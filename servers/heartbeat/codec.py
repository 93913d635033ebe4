"""MQTT 3.1.1 packets, sans-IO: bytes in, packets out (and packets to bytes).

:class:`PacketReader` parses what clients send, incrementally: several packets per
read, a packet split across reads, and nothing buffered beyond one packet of the
configured maximum size (checked as soon as the length is known, before the body
arrives). Every violation raises :class:`ProtocolError`, whose ``connack_code`` is
the refusal the spec prescribes when there is one. The encoders build what the
server sends, and what a client sends (for tests and the load generator).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Connect",
    "Disconnect",
    "Packet",
    "PacketReader",
    "Pingreq",
    "ProtocolError",
    "Puback",
    "Pubcomp",
    "Publish",
    "Pubrec",
    "Pubrel",
    "Subscribe",
    "Unsubscribe",
    "encode_connack",
    "encode_connect",
    "encode_disconnect",
    "encode_pingreq",
    "encode_pingresp",
    "encode_puback",
    "encode_pubcomp",
    "encode_publish",
    "encode_pubrec",
    "encode_pubrel",
    "encode_remaining_length",
    "encode_suback",
    "encode_subscribe",
    "encode_unsuback",
    "encode_unsubscribe",
    "topic_matches",
]

MAX_REMAINING_LENGTH = 268_435_455


class ProtocolError(Exception):
    """A violation by the peer.

    ``reason`` is short and hyphenated (``"packet-too-large"``); ``connack_code`` is
    the CONNACK return code to send before closing when the spec has one.
    """

    def __init__(self, reason: str, connack_code: int | None = None, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.connack_code = connack_code
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Connect:
    """CONNECT."""

    protocol_name: str
    protocol_level: int
    clean_session: bool
    keep_alive: int
    client_id: str
    will_topic: str | None = None
    will_message: bytes | None = None
    will_qos: int = 0
    will_retain: bool = False
    username: str | None = None
    password: bytes | None = None


@dataclass(frozen=True, slots=True)
class Publish:
    """PUBLISH."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None


@dataclass(frozen=True, slots=True)
class Puback:
    """PUBACK."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class Pubrec:
    """PUBREC."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class Pubrel:
    """PUBREL."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class Pubcomp:
    """PUBCOMP."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class Subscribe:
    """SUBSCRIBE: ``topics`` are (filter, requested QoS) pairs."""

    packet_id: int
    topics: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """UNSUBSCRIBE."""

    packet_id: int
    topics: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Pingreq:
    """PINGREQ."""


@dataclass(frozen=True, slots=True)
class Disconnect:
    """DISCONNECT."""


Packet = Connect | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe | Unsubscribe | Pingreq | Disconnect

_PINGREQ = Pingreq()
_DISCONNECT = Disconnect()

# Packet types a client may send, and the fixed-header flags each must carry
# (PUBLISH's flags are its own and checked separately).
_CLIENT_TYPES = {1: 0, 3: None, 4: 0, 5: 0, 6: 2, 7: 0, 8: 2, 10: 2, 12: 0, 14: 0}


class _Body:
    """A cursor over one packet's variable header and payload."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def u8(self) -> int:
        if self.pos >= len(self.data):
            raise ProtocolError("truncated-packet")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def u16(self) -> int:
        if self.pos + 2 > len(self.data):
            raise ProtocolError("truncated-packet")
        value: int = struct.unpack_from("!H", self.data, self.pos)[0]
        self.pos += 2
        return value

    def binary(self) -> bytes:
        size = self.u16()
        if self.pos + size > len(self.data):
            raise ProtocolError("truncated-packet")
        value = self.data[self.pos : self.pos + size]
        self.pos += size
        return value

    def string(self) -> str:
        raw = self.binary()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("invalid-utf8") from None
        if "\x00" in text:
            raise ProtocolError("invalid-utf8", detail="U+0000 in a string")
        return text

    def rest(self) -> bytes:
        value = self.data[self.pos :]
        self.pos = len(self.data)
        return value

    def done(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError("trailing-bytes", detail=f"{len(self.data) - self.pos} bytes after the last field")


def _check_topic(topic: str) -> None:
    if not topic or "+" in topic or "#" in topic:
        raise ProtocolError("bad-topic", detail=repr(topic[:64]))


def _check_filter(topic_filter: str) -> None:
    if not topic_filter:
        raise ProtocolError("bad-topic-filter", detail="empty")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ProtocolError("bad-topic-filter", detail=repr(topic_filter[:64]))
        if "+" in level and level != "+":
            raise ProtocolError("bad-topic-filter", detail=repr(topic_filter[:64]))


def _packet_id(body: _Body) -> int:
    packet_id = body.u16()
    if packet_id == 0:
        raise ProtocolError("bad-packet-id", detail="packet id 0")
    return packet_id


def _parse_connect(body: _Body) -> Connect:
    name = body.string()
    level = body.u8()
    if name == "MQTT":
        if level != 4:
            raise ProtocolError("bad-protocol-level", connack_code=1, detail=f"MQTT level {level}")
    elif name == "MQIsdp":
        raise ProtocolError("bad-protocol-level", connack_code=1, detail="MQTT 3.1 (MQIsdp)")
    else:
        raise ProtocolError("unknown-protocol", detail=repr(name[:32]))
    flags = body.u8()
    if flags & 0x01:
        raise ProtocolError("connect-reserved-flag")
    clean = bool(flags & 0x02)
    will_flag = bool(flags & 0x04)
    will_qos = (flags >> 3) & 0x03
    will_retain = bool(flags & 0x20)
    has_password = bool(flags & 0x40)
    has_username = bool(flags & 0x80)
    if will_qos == 3 or (not will_flag and (will_qos or will_retain)):
        raise ProtocolError("bad-will-flags")
    if has_password and not has_username:
        raise ProtocolError("password-without-username")
    keep_alive = body.u16()
    client_id = body.string()
    will_topic = will_message = None
    if will_flag:
        will_topic = body.string()
        _check_topic(will_topic)
        will_message = body.binary()
    username = body.string() if has_username else None
    password = body.binary() if has_password else None
    body.done()
    return Connect(
        protocol_name=name,
        protocol_level=level,
        clean_session=clean,
        keep_alive=keep_alive,
        client_id=client_id,
        will_topic=will_topic,
        will_message=will_message,
        will_qos=will_qos,
        will_retain=will_retain,
        username=username,
        password=password,
    )


def _parse(kind: int, flags: int, data: bytes) -> Packet:
    body = _Body(data)
    if kind == 3:
        qos = (flags >> 1) & 0x03
        if qos == 3:
            raise ProtocolError("bad-qos", detail="PUBLISH with QoS 3")
        dup = bool(flags & 0x08)
        if dup and qos == 0:
            raise ProtocolError("reserved-flags", detail="DUP on a QoS 0 PUBLISH")
        topic = body.string()
        _check_topic(topic)
        packet_id = _packet_id(body) if qos else None
        return Publish(topic, body.rest(), qos, bool(flags & 0x01), dup, packet_id)
    if kind == 12 or kind == 14:
        if data:
            raise ProtocolError("bad-length", detail="PINGREQ/DISCONNECT with a body")
        return _PINGREQ if kind == 12 else _DISCONNECT
    if kind in (4, 5, 6, 7):
        if len(data) != 2:
            raise ProtocolError("bad-length", detail=f"acknowledgement of {len(data)} bytes")
        packet_id = _packet_id(body)
        return (Puback, Pubrec, Pubrel, Pubcomp)[kind - 4](packet_id)
    if kind == 8:
        packet_id = _packet_id(body)
        topics: list[tuple[str, int]] = []
        while body.left():
            topic_filter = body.string()
            _check_filter(topic_filter)
            qos = body.u8()
            if qos > 2:
                raise ProtocolError("bad-qos", detail=f"requested QoS byte {qos:#x}")
            topics.append((topic_filter, qos))
        if not topics:
            raise ProtocolError("empty-subscribe")
        return Subscribe(packet_id, tuple(topics))
    if kind == 10:
        packet_id = _packet_id(body)
        filters: list[str] = []
        while body.left():
            topic_filter = body.string()
            _check_filter(topic_filter)
            filters.append(topic_filter)
        if not filters:
            raise ProtocolError("empty-unsubscribe")
        return Unsubscribe(packet_id, tuple(filters))
    return _parse_connect(body)  # kind == 1


class PacketReader:
    """Incremental parser of client-to-server packets."""

    __slots__ = ("_buf", "_max")

    def __init__(self, max_packet_size: int = 256 * 1024) -> None:
        self._buf = bytearray()
        self._max = max_packet_size

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a packet."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Packet]:
        """Add received bytes; return every packet they complete, in order."""
        buf = self._buf
        buf += data
        out: list[Packet] = []
        pos = 0
        end = len(buf)
        try:
            while pos < end:
                first = buf[pos]
                kind, flags = first >> 4, first & 0x0F
                expected = _CLIENT_TYPES.get(kind, -1)
                if expected == -1:
                    raise ProtocolError("bad-packet-type", detail=f"type {kind}")
                if expected is not None and flags != expected:
                    raise ProtocolError("reserved-flags", detail=f"type {kind} with flags {flags:#x}")
                # Remaining length: 7 bits per byte, least significant first, at most 4 bytes.
                length = 0
                shift = 0
                i = pos + 1
                while True:
                    if i >= end:
                        if i - pos - 1 >= 4:
                            raise ProtocolError("malformed-remaining-length")
                        return out  # the length itself is still arriving
                    byte = buf[i]
                    length |= (byte & 0x7F) << shift
                    i += 1
                    if not byte & 0x80:
                        break
                    shift += 7
                    if shift >= 28:
                        raise ProtocolError("malformed-remaining-length", detail="more than 4 bytes")
                total = i - pos + length
                if total > self._max:
                    raise ProtocolError("packet-too-large", detail=f"{total} bytes > {self._max}")
                if pos + total > end:
                    return out  # the body is still arriving
                out.append(_parse(kind, flags, bytes(buf[i : pos + total])))
                pos += total
            return out
        finally:
            if pos:
                del buf[:pos]


# -- encoders ---------------------------------------------------------------------


def encode_remaining_length(n: int) -> bytes:
    """MQTT's variable-length integer (1 to 4 bytes)."""
    if not 0 <= n <= MAX_REMAINING_LENGTH:
        raise ValueError(f"remaining length {n} out of range")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def _packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + encode_remaining_length(len(body)) + body


def _str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("!H", len(raw)) + raw


def _bin(raw: bytes) -> bytes:
    return struct.pack("!H", len(raw)) + raw


def encode_connack(session_present: bool, return_code: int) -> bytes:
    """CONNACK: ``20 02 <session-present> <return code>``."""
    return bytes([0x20, 0x02, 1 if session_present else 0, return_code])


def encode_publish(
    topic: str, payload: bytes, qos: int = 0, retain: bool = False, packet_id: int | None = None, dup: bool = False
) -> bytes:
    """PUBLISH (a packet id is required for QoS 1 and 2)."""
    if qos and not packet_id:
        raise ValueError("QoS 1 and 2 need a non-zero packet id")
    first = 0x30 | (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
    head = _str(topic) + (struct.pack("!H", packet_id) if qos and packet_id else b"")
    return _packet(first, head + payload)


def _ack(first: int, packet_id: int) -> bytes:
    return bytes([first, 0x02]) + struct.pack("!H", packet_id)


def encode_puback(packet_id: int) -> bytes:
    """PUBACK: ``40 02 <id>``."""
    return _ack(0x40, packet_id)


def encode_pubrec(packet_id: int) -> bytes:
    """PUBREC: ``50 02 <id>``."""
    return _ack(0x50, packet_id)


def encode_pubrel(packet_id: int) -> bytes:
    """PUBREL: ``62 02 <id>``."""
    return _ack(0x62, packet_id)


def encode_pubcomp(packet_id: int) -> bytes:
    """PUBCOMP: ``70 02 <id>``."""
    return _ack(0x70, packet_id)


def encode_suback(packet_id: int, granted: Sequence[int]) -> bytes:
    """SUBACK: ``90 RL <id> <granted QoS or 0x80>*``."""
    return _packet(0x90, struct.pack("!H", packet_id) + bytes(granted))


def encode_unsuback(packet_id: int) -> bytes:
    """UNSUBACK: ``b0 02 <id>``."""
    return _ack(0xB0, packet_id)


def encode_pingresp() -> bytes:
    """PINGRESP: ``d0 00``."""
    return b"\xd0\x00"


def encode_connect(
    client_id: str,
    keep_alive: int = 60,
    clean_session: bool = True,
    will_topic: str | None = None,
    will_message: bytes | None = None,
    will_qos: int = 0,
    will_retain: bool = False,
    username: str | None = None,
    password: bytes | None = None,
    protocol_level: int = 4,
    protocol_name: str = "MQTT",
) -> bytes:
    """CONNECT, as a client sends it."""
    flags = 0x02 if clean_session else 0
    payload = _str(client_id)
    if will_topic is not None:
        flags |= 0x04 | (will_qos << 3) | (0x20 if will_retain else 0)
        payload += _str(will_topic) + _bin(will_message or b"")
    if username is not None:
        flags |= 0x80
        payload += _str(username)
    if password is not None:
        flags |= 0x40
        payload += _bin(password)
    head = _str(protocol_name) + bytes([protocol_level, flags]) + struct.pack("!H", keep_alive)
    return _packet(0x10, head + payload)


def encode_subscribe(packet_id: int, topics: Sequence[tuple[str, int]]) -> bytes:
    """SUBSCRIBE (fixed header ``82``)."""
    body = struct.pack("!H", packet_id) + b"".join(_str(t) + bytes([q]) for t, q in topics)
    return _packet(0x82, body)


def encode_unsubscribe(packet_id: int, topics: Sequence[str]) -> bytes:
    """UNSUBSCRIBE (fixed header ``a2``)."""
    return _packet(0xA2, struct.pack("!H", packet_id) + b"".join(_str(t) for t in topics))


def encode_pingreq() -> bytes:
    """PINGREQ: ``c0 00``."""
    return b"\xc0\x00"


def encode_disconnect() -> bytes:
    """DISCONNECT: ``e0 00``."""
    return b"\xe0\x00"


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches ``topic_filter`` (``+`` one level, ``#`` the rest).

    Topics starting with ``$`` are not matched by a filter starting with a wildcard.
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    parts = topic.split("/")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if level == "#":
            return True  # "a/#" matches "a" too
        if i >= len(parts):
            return False
        if level != "+" and level != parts[i]:
            return False
    return len(parts) == len(levels)
