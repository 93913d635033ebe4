"""MQTT 3.1.1 encoders: packets to bytes, what the server sends and what a client sends.

The server's replies (CONNACK, PINGRESP, SUBACK, ...) and the PUBLISHes it delivers,
plus every client packet, for tests and the load generator. Pure functions, no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from .packets import MAX_REMAINING_LENGTH, PINGREQ_WIRE

__all__ = [
    "PUBLISH_HEAD",
    "U16",
    "encode_connack",
    "encode_connect",
    "encode_disconnect",
    "encode_frame",
    "encode_held",
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
]


def encode_remaining_length(n: int) -> bytes:
    """MQTT's variable-length integer: 7 bits a byte, least significant first, 1 to 4 bytes.

    Raises ValueError outside 0..268,435,455.
    """
    if not 0 <= n <= MAX_REMAINING_LENGTH:
        raise ValueError(f"remaining length {n} is outside 0..{MAX_REMAINING_LENGTH}")
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


U16 = struct.Struct("!H")
"""A big-endian two-byte integer: a packet id, a string's length, a keep-alive."""


def encode_frame(first: int, body: bytes) -> bytes:
    """A packet from its first byte and its body (what follows the remaining length):
    the same in MQTT 3.1.1 and 5.0."""
    return bytes((first,)) + encode_remaining_length(len(body)) + body


def _bin(raw: bytes) -> bytes:
    if len(raw) > 0xFFFF:
        raise ValueError(f"field of {len(raw)} bytes; MQTT allows at most 65535")
    return U16.pack(len(raw)) + raw


def _str(text: str) -> bytes:
    return _bin(text.encode("utf-8"))


def _ack(first: int, packet_id: int) -> bytes:
    return bytes((first, 0x02)) + U16.pack(packet_id)


def encode_connack(session_present: bool, return_code: int) -> bytes:
    """CONNACK: ``20 02 <session present> <return code>``."""
    return bytes((0x20, 0x02, 1 if session_present else 0, return_code))


PUBLISH_HEAD = struct.Struct("!BBH")
"""A PUBLISH's first byte, a one-byte remaining length and its topic's length (what
:func:`encode_held` packs, and a stored queue's refill with it)."""


def encode_publish(
    topic: str, payload: bytes, qos: int = 0, retain: bool = False, packet_id: int | None = None, dup: bool = False
) -> bytes:
    """PUBLISH; QoS 1 and 2 need a non-zero ``packet_id``, QoS 0 ignores it."""
    if qos not in (0, 1, 2):
        raise ValueError(f"QoS {qos}")
    if qos and not packet_id:
        raise ValueError("QoS 1 and 2 need a non-zero packet id")
    return encode_held(topic, payload, qos, retain, packet_id or 0, dup)


def encode_held(topic: str, payload: bytes, qos: int, retain: bool, packet_id: int, dup: bool) -> bytes:
    """A PUBLISH whose QoS and packet id are known to be valid (:func:`encode_publish`
    checks them first), as :class:`~..broker.outbox.Message` sends it; QoS 0 ignores
    ``packet_id``. A stored queue's drain encodes each message here, with positional
    arguments and no checks but the topic's length."""
    first = 0x30 | (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
    name = topic.encode("utf-8")
    size = len(name)
    if size > 0xFFFF:
        raise ValueError(f"field of {size} bytes; MQTT allows at most 65535")
    ident = U16.pack(packet_id) if qos else b""
    # Every message a subscriber is sent is encoded here: one join of the parts, the
    # header packed at once when the remaining length fits a byte (most do).
    length = 2 + size + len(ident) + len(payload)
    if length < 0x80:
        return b"".join((PUBLISH_HEAD.pack(first, length, size), name, ident, payload))
    return b"".join((bytes((first,)), encode_remaining_length(length), U16.pack(size), name, ident, payload))


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
    """SUBACK: ``90 <RL> <id> <code>...``, one code per filter: the granted QoS or 0x80 (failure)."""
    return encode_frame(0x90, U16.pack(packet_id) + bytes(granted))


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
    """CONNECT, as a client sends it; the will is sent when ``will_topic`` is given."""
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
    head = _str(protocol_name) + bytes((protocol_level, flags)) + U16.pack(keep_alive)
    return encode_frame(0x10, head + payload)


def encode_subscribe(packet_id: int, topics: Sequence[tuple[str, int]]) -> bytes:
    """SUBSCRIBE (fixed header ``82``): (filter, requested QoS) pairs."""
    body = U16.pack(packet_id) + b"".join(_str(topic_filter) + bytes((qos,)) for topic_filter, qos in topics)
    return encode_frame(0x82, body)


def encode_unsubscribe(packet_id: int, topics: Sequence[str]) -> bytes:
    """UNSUBSCRIBE (fixed header ``a2``)."""
    return encode_frame(0xA2, U16.pack(packet_id) + b"".join(_str(topic_filter) for topic_filter in topics))


def encode_pingreq() -> bytes:
    """PINGREQ: ``c0 00``."""
    return PINGREQ_WIRE


def encode_disconnect() -> bytes:
    """DISCONNECT: ``e0 00``."""
    return b"\xe0\x00"
