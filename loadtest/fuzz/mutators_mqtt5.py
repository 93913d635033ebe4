"""Mutators for MQTT 5.0's properties, where one segment is one packet: a property the
packet may not carry, a single-use property twice, a property length that lies, a
string property that is not UTF-8, a variable byte integer longer than its value needs.
Pure.

Each finds a packet's property block where the spec puts it (after CONNECT's keep-alive,
a PUBLISH's topic and packet id, an acknowledgement's reason code, a SUBSCRIBE's
packet id...). In a 5.0 session it changes that block; in a 3.1.1 or 3.1 session,
whose packets have none, it puts a block there first, with the mutation in it: a
client mixing the versions up, which the server must refuse just as clearly. The
remaining length is kept true (but for an overlong one), so that the reader gets as
far as the properties.

Which property a packet may carry is the server's own table, asked through its reader
(:func:`servers.heartbeat.mqtt.v5.properties.read_properties`) once, at import.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from servers.heartbeat.mqtt.encoders import encode_remaining_length
from servers.heartbeat.mqtt.v5.properties import Carrier, read_properties
from servers.heartbeat.mqtt.v5.reason_codes import PacketError
from servers.heartbeat.mqtt.v5.wire import pack_varint, read_varint

from .mutators_mqtt import split_mqtt
from .segments import Segments, replace_segment

__all__ = [
    "ALLOWED",
    "KINDS",
    "is_v5_session",
    "mqtt5_bad_utf8",
    "mqtt5_duplicate_property",
    "mqtt5_property_length_lie",
    "mqtt5_varint_overlong",
    "mqtt5_wrong_property",
    "property_block",
    "split_properties",
]

_BYTE, _U16, _U32, _VARINT, _STRING, _BINARY, _PAIR = range(7)
KINDS = {
    0x01: _BYTE,
    0x02: _U32,
    0x03: _STRING,
    0x08: _STRING,
    0x09: _BINARY,
    0x0B: _VARINT,
    0x11: _U32,
    0x12: _STRING,
    0x13: _U16,
    0x15: _STRING,
    0x16: _BINARY,
    0x17: _BYTE,
    0x18: _U32,
    0x19: _BYTE,
    0x1A: _STRING,
    0x1C: _STRING,
    0x1F: _STRING,
    0x21: _U16,
    0x22: _U16,
    0x23: _U16,
    0x24: _BYTE,
    0x25: _BYTE,
    0x26: _PAIR,
    0x27: _U32,
    0x28: _BYTE,
    0x29: _BYTE,
    0x2A: _BYTE,
}
"""Every property MQTT 5.0 defines: its identifier and the type of its value."""
UNKNOWN_IDS = (0x00, 0x04, 0x0A, 0x14, 0x2B, 0x7F)
"""Identifiers MQTT 5.0 does not define."""
USER_PROPERTY = 0x26
_STRING_IDS = tuple(i for i, k in KINDS.items() if k == _STRING)

# Client packets by type, and what carries their properties.
_CARRIERS = {
    0x1: Carrier.CONNECT,
    0x3: Carrier.PUBLISH,
    0x4: Carrier.PUBACK,
    0x5: Carrier.PUBREC,
    0x6: Carrier.PUBREL,
    0x7: Carrier.PUBCOMP,
    0x8: Carrier.SUBSCRIBE,
    0xA: Carrier.UNSUBSCRIBE,
    0xE: Carrier.DISCONNECT,
    0xF: Carrier.AUTH,
}


def _value(kind: int) -> bytes:
    """A valid value of ``kind`` (1: within every byte property's 0-or-1 range, and not 0)."""
    return {
        _BYTE: b"\x01",
        _U16: b"\x00\x0a",
        _U32: b"\x00\x00\x00\x0a",
        _VARINT: b"\x01",
        _STRING: b"\x00\x01x",
        _BINARY: b"\x00\x01x",
        _PAIR: b"\x00\x01k\x00\x01v",
    }[kind]


def _item(ident: int) -> bytes:
    return pack_varint(ident) + _value(KINDS[ident])


def _allowed(carrier: Carrier) -> frozenset[int]:
    """The properties ``carrier`` may carry, by the server's reader."""
    out = set()
    for ident in KINDS:
        item = _item(ident)
        block = pack_varint(len(item)) + item
        try:
            read_properties(block, 0, len(block), carrier)
        except PacketError:
            continue
        out.add(ident)
    return frozenset(out)


ALLOWED = {carrier: _allowed(carrier) for carrier in set(_CARRIERS.values())}
"""The properties each client packet may carry."""


def _single_use(carrier: Carrier) -> tuple[int, ...]:
    many = {USER_PROPERTY} | ({0x0B} if carrier is Carrier.PUBLISH else set())
    return tuple(sorted(ALLOWED[carrier] - many))


# -- finding a packet's properties ---------------------------------------------------------


def is_v5_session(segments: Sequence[bytes]) -> bool:
    """Whether the session's CONNECT says MQTT 5.0."""
    for s in segments:
        f = split_mqtt(s)
        if f is not None and f[0] >> 4 == 0x1:
            return f[2][:7] == b"\x00\x04MQTT\x05"
    return False


def _slot(first: int, body: bytes, v5: bool) -> tuple[bytes, int] | None:
    """``body`` with a property block at the place the spec gives it (an empty one put
    there if it had none), and the block's offset; None if the packet has no such place."""
    kind = first >> 4
    if kind not in _CARRIERS:
        return None
    if kind == 0x1:
        if len(body) < 2:
            return None
        pos = 2 + int.from_bytes(body[:2], "big") + 4  # protocol name, level, flags, keep-alive
    elif kind == 0x3:
        if len(body) < 2:
            return None
        pos = 2 + int.from_bytes(body[:2], "big") + (2 if (first >> 1) & 0x03 else 0)
    elif kind in (0x8, 0xA):
        pos = 2
    elif kind in (0x4, 0x5, 0x6, 0x7):
        if len(body) < 2:
            return None
        if len(body) < 4 or not v5:  # no reason code, or no properties after it
            return body[:2] + (body[2:3] or b"\x00") + b"\x00" + body[3:], 3
        pos = 3
    else:  # DISCONNECT, AUTH
        if len(body) < 2 or not v5:
            return (body[:1] or b"\x00") + b"\x00" + body[1:], 1
        pos = 1
    if pos > len(body):
        return None
    if not v5:
        return body[:pos] + b"\x00" + body[pos:], pos
    return body, pos


def property_block(first: int, body: bytes, v5: bool) -> tuple[bytes, int, int, int] | None:
    """``(body, offset of the property length, start of the properties, their end)``, the
    body with a block where it had none (see :func:`_slot`); None if there is none to find
    (no place for one, or a length that does not parse)."""
    slot = _slot(first, body, v5)
    if slot is None:
        return None
    body, pos = slot
    try:
        length, start = read_varint(body, pos, len(body))
    except PacketError:
        return None
    if start + length > len(body):
        return None
    return body, pos, start, start + length


def split_properties(block: bytes) -> list[tuple[int, bytes]] | None:
    """A property block's content as ``(identifier, the property's bytes)`` in order; None if
    an identifier is unknown or a value runs past the end."""
    out: list[tuple[int, bytes]] = []
    pos, end = 0, len(block)
    try:
        while pos < end:
            start = pos
            ident, pos = read_varint(block, pos, end)
            kind = KINDS.get(ident)
            if kind is None:
                return None
            if kind in (_BYTE, _U16, _U32):
                pos += {_BYTE: 1, _U16: 2, _U32: 4}[kind]
            elif kind == _VARINT:
                _, pos = read_varint(block, pos, end)
            else:
                for _ in range(2 if kind == _PAIR else 1):
                    if pos + 2 > end:
                        return None
                    pos += 2 + int.from_bytes(block[pos : pos + 2], "big")
            if pos > end:
                return None
            out.append((ident, block[start:pos]))
    except PacketError:
        return None
    return out


# -- the mutators ----------------------------------------------------------------------------

_Found = tuple[int, int, bytes, int, int, int, Carrier]
"""(segment, first byte, body, property length offset, properties start, end, carrier)."""


def _find(
    rng: random.Random, segments: Sequence[bytes], fits: Callable[[Carrier], bool] = lambda carrier: True
) -> _Found | None:
    """A packet of the session with a property block (made for it in a 3.x session), of a
    type that ``fits``."""
    v5 = is_v5_session(segments)
    candidates: list[_Found] = []
    for i, s in enumerate(segments):
        f = split_mqtt(s)
        if f is None:
            continue
        first, _length, body = f
        if first >> 4 not in _CARRIERS or not fits(_CARRIERS[first >> 4]):
            continue
        found = property_block(first, body, v5)
        if found is not None:
            candidates.append((i, first, *found, _CARRIERS[first >> 4]))
    return rng.choice(candidates) if candidates else None


def _rebuilt(first: int, body: bytes, pos: int, length: bytes, props: bytes, end: int) -> bytes:
    """The packet with its property block now ``length`` + ``props``, and a true remaining length."""
    new = body[:pos] + length + props + body[end:]
    return bytes((first,)) + encode_remaining_length(len(new)) + new


def _with(
    rng: random.Random,
    segments: Sequence[bytes],
    change: Callable[[Carrier, bytes], bytes],
    fits: Callable[[Carrier], bool] = lambda carrier: True,
) -> Segments:
    found = _find(rng, segments, fits)
    if found is None:
        return list(segments)
    i, first, body, pos, start, end, carrier = found
    props = change(carrier, body[start:end])
    return replace_segment(segments, i, _rebuilt(first, body, pos, pack_varint(len(props)), props, end))


def mqtt5_wrong_property(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Add a property the packet may not carry (a CONNACK's Server Keep Alive in a CONNECT,
    a Topic Alias in a SUBSCRIBE...) or one MQTT 5.0 does not define, well formed
    otherwise: a Malformed Packet (0x81)."""

    def change(carrier: Carrier, props: bytes) -> bytes:
        foreign = sorted(set(KINDS) - ALLOWED[carrier])
        if rng.random() < 0.75 and foreign:
            item = _item(rng.choice(foreign))
        else:
            item = pack_varint(rng.choice(UNKNOWN_IDS)) + rng.randbytes(rng.randint(0, 4))
        return item + props if rng.random() < 0.5 else props + item

    return _with(rng, segments, change)


def mqtt5_duplicate_property(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Give a property that may appear once a second time (one the packet has, or one it
    may carry, added twice): a Protocol Error (0x82)."""

    def change(carrier: Carrier, props: bytes) -> bytes:
        items = split_properties(props) or []
        single = _single_use(carrier)
        present = [(ident, raw) for ident, raw in items if ident in single]
        if present:
            _ident, raw = rng.choice(present)
            return props + raw
        raw = _item(rng.choice(single))
        return props + raw + raw

    # Not an UNSUBSCRIBE: it may carry User Properties alone, as many as it likes.
    return _with(rng, segments, change, lambda carrier: bool(_single_use(carrier)))


def mqtt5_property_length_lie(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Make the property length say other than the properties' size: a little more or less,
    0 with properties there, or far past the packet's end (the remaining length stays true)."""
    found = _find(rng, segments)
    if found is None:
        return list(segments)
    i, first, body, pos, start, end, _carrier = found
    props = body[start:end]
    if not props:
        props = _item(USER_PROPERTY)  # something for the length to lie about
    size = len(props)
    lie = size
    while lie == size:
        lie = rng.choice((size + rng.randint(1, 3), max(0, size - rng.randint(1, 3)), 0, 127, 128, 16_383, 1 << 20))
    return replace_segment(segments, i, _rebuilt(first, body, pos, pack_varint(lie), props, end))


_BAD_UTF8 = (
    b"\xff\xfe",  # never UTF-8
    b"\xc0\x80",  # an overlong NUL
    b"\xed\xa0\x80",  # a surrogate (U+D800)
    b"\xe2\x82",  # a sequence cut short
    b"ok\x00",  # U+0000, which MQTT forbids in a string
    b"\xf4\x90\x80\x80",  # past U+10FFFF
)


def mqtt5_bad_utf8(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Put a string property whose bytes are not well-formed UTF-8 (or hold U+0000) in the
    packet: a Content Type, a Reason String, a User Property's name or value... whichever
    the packet may carry. A Malformed Packet (0x81)."""

    def change(carrier: Carrier, props: bytes) -> bytes:
        bad = rng.choice(_BAD_UTF8)
        text = len(bad).to_bytes(2, "big") + bad
        strings = [i for i in _STRING_IDS if i in ALLOWED[carrier]]
        if strings and rng.random() < 0.6:
            item = pack_varint(rng.choice(strings)) + text
        elif rng.random() < 0.5:
            item = pack_varint(USER_PROPERTY) + text + b"\x00\x01v"
        else:
            item = pack_varint(USER_PROPERTY) + b"\x00\x01k" + text
        # Replace a property of the same identifier if the packet has one (a single-use one
        # must not turn into a duplicate), else add it.
        items = split_properties(props) or []
        ident = read_varint(item, 0, len(item))[0]
        kept = b"".join(raw for i, raw in items if i != ident or ident == USER_PROPERTY) if items else props
        return kept + item

    return _with(rng, segments, change)


def _overlong(value: int, extra: int) -> bytes:
    """``value`` as a variable byte integer ``extra`` bytes longer than it needs (at most 4 bytes in all)."""
    out = bytearray(pack_varint(value))
    for _ in range(extra):
        if len(out) >= 4:
            break
        out[-1] |= 0x80
        out.append(0x00)
    return bytes(out)


def mqtt5_varint_overlong(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Write a variable byte integer in more bytes than its value needs (``0x85 0x00`` for
    5), which MQTT 5.0 forbids: the property length, a Subscription Identifier's value,
    or the remaining length. A Malformed Packet (0x81)."""
    found = _find(rng, segments)
    if found is None:
        return list(segments)
    i, first, body, pos, start, end, carrier = found
    props = body[start:end]
    r = rng.random()
    extra = rng.randint(1, 3)
    if r < 0.4:
        new = body[:pos] + _overlong(len(props), extra) + props + body[end:]
    elif r < 0.7 and 0x0B in ALLOWED[carrier]:
        sub_id = rng.choice((1, 127, 128, 16_383))
        item = b"\x0b" + _overlong(sub_id, extra)
        new = body[:pos] + pack_varint(len(props) + len(item)) + props + item + body[end:]
    else:
        new = body[:pos] + pack_varint(len(props)) + props + body[end:]
        return replace_segment(segments, i, bytes((first,)) + _overlong(len(new), extra) + new)
    return replace_segment(segments, i, bytes((first,)) + encode_remaining_length(len(new)) + new)
