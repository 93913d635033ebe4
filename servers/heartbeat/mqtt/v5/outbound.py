"""The PUBLISH a server sends an MQTT 5.0 client, written straight to bytes.

:func:`~.codec.pack` writes any packet from its value (the server's replies too); a
message delivered to many subscribers skips building the value: a PUBLISH here takes
its properties already packed (what the publisher's PUBLISH
carried that a subscriber may see), so a message fanned out to a thousand 5.0
subscribers packs them once. :func:`from_v311` turns a packet written for 3.1.1 (a
persistent session's stored message) into its 5.0 form. Pure: no I/O.
"""

from __future__ import annotations

import math
import struct

from ..encoders import encode_frame as _frame
from ..encoders import encode_held
from .properties import EMPTY, Carrier, Properties, pack_properties
from .wire import pack_varint, read_varint

__all__ = [
    "counted_down",
    "expiring",
    "forwarded",
    "from_v311",
    "message_expiry",
    "subscription_identifier",
    "publish",
]

_H = struct.Struct("!H")
_BYTE = [bytes((i,)) for i in range(0x80)]
"""A property length under 128 is one byte: these, made once."""


def publish(
    topic: str,
    payload: bytes,
    qos: int = 0,
    retain: bool = False,
    packet_id: int | None = None,
    dup: bool = False,
    properties: bytes = b"",
) -> bytes:
    """PUBLISH to a 5.0 client; ``properties`` is a packed property list without its
    length (:func:`forwarded`), empty for a message from a 3.1.1 client."""
    if qos and not packet_id:
        raise ValueError("QoS 1 and 2 need a non-zero packet id")
    # 3.1.1's layout, with the properties (behind their length) ahead of the payload.
    n = len(properties)
    body = (_BYTE[n] if n < 0x80 else pack_varint(n)) + properties + payload
    return encode_held(topic, body, qos, retain, packet_id or 0, dup)


def forwarded(props: Properties) -> bytes:
    """The properties of a client's PUBLISH (or Will) that reach its subscribers
    unchanged (§3.3.2.3): Payload Format Indicator, Message Expiry Interval, Content
    Type, Response Topic, Correlation Data, User Properties (in order); without the
    length, so that a delivery can add its own (a Subscription Identifier) behind."""
    if props is EMPTY:
        return b""
    kept = Properties(
        payload_format_indicator=props.payload_format_indicator,
        message_expiry_interval=props.message_expiry_interval,
        content_type=props.content_type,
        response_topic=props.response_topic,
        correlation_data=props.correlation_data,
        user_properties=props.user_properties,
    )
    if kept == EMPTY:
        return b""
    packed = pack_properties(kept, Carrier.PUBLISH)
    _, start = read_varint(packed, 0, len(packed))
    return packed[start:]


def _expiry_at(properties: bytes) -> int:
    # forwarded() packs in the spec's order: Payload Format Indicator (0x01, one byte),
    # then Message Expiry Interval (0x02, four bytes), then the rest.
    if properties[:1] == b"\x02":
        return 1
    if properties[:1] == b"\x01" and properties[2:3] == b"\x02":
        return 3
    return -1


def message_expiry(properties: bytes) -> int | None:
    """The Message Expiry Interval among ``properties`` (as :func:`forwarded` packs
    them), or None."""
    at = _expiry_at(properties)
    return None if at < 0 else int.from_bytes(properties[at : at + 4], "big")


def counted_down(properties: bytes, elapsed: float) -> bytes | None:
    """``properties`` with their Message Expiry Interval lowered by the whole seconds
    ``elapsed`` since the message came (§3.3.2.3.3: the lifetime left is what the
    subscriber is told); None if it has run out. Without an expiry, as they are."""
    at = _expiry_at(properties)
    if at < 0:
        return properties
    left = int.from_bytes(properties[at : at + 4], "big") - int(elapsed)
    if left <= 0:
        return None
    return _with_expiry(properties, at, left)


def expiring(properties: bytes, expires_at: float | None, now: float) -> bytes:
    """``properties`` with their Message Expiry Interval set to the whole seconds left
    until ``expires_at`` (at least 1: a message that has run out is not sent at all);
    as they are if the message never expires."""
    at = _expiry_at(properties)
    if at < 0 or expires_at is None:
        return properties
    return _with_expiry(properties, at, max(1, math.ceil(expires_at - now)))


def _with_expiry(properties: bytes, at: int, seconds: int) -> bytes:
    return properties[:at] + seconds.to_bytes(4, "big") + properties[at + 4 :]


def subscription_identifier(identifier: int) -> bytes:
    """A Subscription Identifier property (0x0B), to add behind a message's own."""
    return b"\x0b" + pack_varint(identifier)


def from_v311(data: bytes) -> bytes:
    """A packet written for 3.1.1 in its 5.0 form: a PUBLISH gains an empty property
    list; every other packet the server resends (PUBREL) is the same in both."""
    if data[0] >> 4 != 3:
        return data
    length, pos = read_varint(data, 1, len(data))
    topic_end = pos + 2 + _H.unpack_from(data, pos)[0]
    if data[0] & 0x06:
        topic_end += 2  # the packet id
    body = data[pos:topic_end] + b"\x00" + data[topic_end : pos + length]
    return _frame(data[0], body)
