"""Mutators for an MQTT fuzz input, where one segment is one packet: lies in the
remaining length or a string's length prefix, varint overflow, huge lengths, and wrong
types or fixed-header flags. Pure.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from servers.heartbeat.mqtt.encoders import encode_remaining_length
from servers.heartbeat.mqtt.packets import MAX_REMAINING_LENGTH

from .segments import Segments, replace_segment

__all__ = [
    "mqtt_huge_length",
    "mqtt_length_lie",
    "mqtt_string_length_lie",
    "mqtt_type_flags",
    "mqtt_varint_overflow",
    "split_mqtt",
]


def split_mqtt(packet: bytes) -> tuple[int, int, bytes] | None:
    """``(first byte, remaining length, body)`` of a well-framed packet, or None."""
    if len(packet) < 2:
        return None
    length, shift, i = 0, 0, 1
    while True:
        if i >= len(packet) or i > 4:
            return None
        byte = packet[i]
        length |= (byte & 0x7F) << shift
        shift += 7
        i += 1
        if not byte & 0x80:
            break
    body = packet[i:]
    return (packet[0], length, body) if len(body) == length else None


def _framed(rng: random.Random, segments: Sequence[bytes]) -> tuple[int, tuple[int, int, bytes]] | None:
    candidates = [(i, f) for i, s in enumerate(segments) if (f := split_mqtt(s)) is not None]
    return rng.choice(candidates) if candidates else None


def mqtt_length_lie(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Give one packet a remaining length other than its body's: a little off, zero, or far
    off (the reader then waits for bytes that never come, or takes the next packet as body)."""
    found = _framed(rng, segments)
    if found is None:
        return list(segments)
    i, (first, length, body) = found
    lie = length
    while lie == length:
        lie = rng.choice(
            (
                length + rng.randint(1, 3),
                max(0, length - rng.randint(1, 3)),
                0,
                rng.randint(0, 2 * length + 16),
                127,
                128,
                16_383,
                16_384,
            )
        )
    return replace_segment(segments, i, bytes((first,)) + encode_remaining_length(lie) + body)


def mqtt_varint_overflow(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A remaining length with the continuation bit on its fourth byte (five or more bytes)."""
    found = _framed(rng, segments)
    if found is None:
        return list(segments)
    i, (first, _length, body) = found
    varint = b"\xff\xff\xff\xff\x7f" if rng.random() < 0.5 else b"\x80" * rng.randint(4, 12) + b"\x01"
    return replace_segment(segments, i, bytes((first,)) + varint + body)


def mqtt_huge_length(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Claim a body far larger than the server's packet limit (up to the 256 MiB the
    varint allows), and send only the first few bytes of it."""
    found = _framed(rng, segments)
    if found is None:
        return list(segments)
    i, (first, _length, body) = found
    huge = rng.choice((MAX_REMAINING_LENGTH, 256 * 1024 + 1, 1 << 21, rng.randint(1 << 18, MAX_REMAINING_LENGTH)))
    return replace_segment(segments, i, bytes((first,)) + encode_remaining_length(huge) + body)


def mqtt_type_flags(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Rewrite one packet's first byte: a server-only type (CONNACK, SUBACK...), a reserved
    type, wrong fixed-header flags, or QoS 3."""
    found = _framed(rng, segments)
    if found is None:
        return list(segments)
    i, (first, length, body) = found
    new = first
    while new == first:
        new = rng.choice(
            (
                rng.randrange(256),
                (first & 0xF0) | rng.randrange(16),  # the same type, other flags
                rng.choice((0x00, 0x20, 0x90, 0xB0, 0xD0, 0xF0)),  # reserved, or what only a server sends
                0x36,  # PUBLISH QoS 3
                0x38,  # DUP on QoS 0
            )
        )
    return replace_segment(segments, i, bytes((new,)) + encode_remaining_length(length) + body)


# Where the first length-prefixed field of each packet type starts, in its body.
_FIRST_STRING = {0x1: (0, 10), 0x3: (0,), 0x8: (2,), 0xA: (2,)}


def mqtt_string_length_lie(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Lie in a length prefix inside a packet (CONNECT's protocol name or client id, a
    topic, a filter): the field then runs past the packet's end or leaves bytes over."""
    candidates = []
    for i, s in enumerate(segments):
        f = split_mqtt(s)
        if f is not None and f[0] >> 4 in _FIRST_STRING:
            for at in _FIRST_STRING[f[0] >> 4]:
                if at + 2 <= len(f[2]):
                    candidates.append((i, f, at))
    if not candidates:
        return list(segments)
    i, (first, length, body), at = rng.choice(candidates)
    old = int.from_bytes(body[at : at + 2], "big")
    lie = old
    while lie == old:
        lie = rng.choice(((old + 1) & 0xFFFF, max(0, old - 1), 0, 0xFFFF, rng.randrange(0x10000)))
    body = body[:at] + lie.to_bytes(2, "big") + body[at + 2 :]
    return replace_segment(segments, i, bytes((first,)) + encode_remaining_length(length) + body)
