"""MQTT 5.0 packets to and from bytes, both directions, sans-IO.

:func:`read_packet` parses one packet's body given its first byte; :func:`read_packets`
splits a buffer of whole packets; :func:`pack` writes one. What the spec calls a
Malformed Packet raises :class:`~.reason_codes.PacketError` with 0x81, a Protocol
Error with 0x82, so that the connection can answer with the code (a CONNACK before the
session exists, a DISCONNECT after) and close only itself.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from .. import sharing
from ..encoders import encode_frame as _frame
from ..packets import TYPE_NAMES
from .packets import (
    AUTH,
    CONNACK,
    CONNECT,
    DISCONNECT,
    PINGREQ,
    PINGRESP,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBACK,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
    Ack,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Publish,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
)
from .properties import EMPTY, Carrier, Properties, pack_properties, read_properties
from .reason_codes import ReasonCode, malformed, protocol_error
from .wire import pack_binary, pack_string, read_binary, read_string, read_u8, read_u16, read_varint

__all__ = ["fit_reason", "pack", "read_packet", "read_packets", "read_whole"]

_PINGREQ, _PINGRESP = Pingreq(), Pingresp()
_Reader = Callable[[int, bytes, int, int], Packet]

# Fixed-header flags of every type but PUBLISH (§2.1.3): anything else is malformed.
_FLAGS = {t: (2 if t in (PUBREL, SUBSCRIBE, UNSUBSCRIBE) else 0) for t in range(1, 16) if t != PUBLISH}

_ACK_CARRIER = {PUBACK: Carrier.PUBACK, PUBREC: Carrier.PUBREC, PUBREL: Carrier.PUBREL, PUBCOMP: Carrier.PUBCOMP}

# The reason codes each packet may carry (§3.x tables); another is a Protocol Error.
_PUB_CODES = frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99})
_ALLOWED: dict[int, frozenset[int]] = {
    PUBACK: _PUB_CODES,
    PUBREC: _PUB_CODES,
    PUBREL: frozenset({0x00, 0x92}),
    PUBCOMP: frozenset({0x00, 0x92}),
    CONNACK: frozenset({0x00, *range(0x80, 0x8B), 0x8C, 0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}),
    SUBACK: frozenset({0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2}),
    UNSUBACK: frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91}),
    DISCONNECT: frozenset(
        {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, *range(0x8D, 0x91), *range(0x93, 0xA3)}
    ),
    AUTH: frozenset({0x00, 0x18, 0x19}),
}
_NAMES = {**TYPE_NAMES, AUTH: "AUTH"}


def fit_reason(kind: int, code: int) -> int:
    """``code`` if packet ``kind`` (CONNACK, DISCONNECT...) may carry it, else 0x82 (Protocol
    Error): a packet refused before CONNACK for a DISCONNECT's reason (a Topic Alias of
    0 behind the CONNECT, 0x94) is told in a CONNACK the client can parse."""
    return code if code in _ALLOWED[kind] else int(ReasonCode.PROTOCOL_ERROR)


def _reason(kind: int, src: bytes, pos: int, end: int) -> tuple[int, int]:
    code, pos = read_u8(src, pos, end)
    if code not in _ALLOWED[kind]:
        raise protocol_error(f"reason code 0x{code:02X} in {_NAMES[kind]}")
    return code, pos


def _packet_id(src: bytes, pos: int, end: int) -> tuple[int, int]:
    packet_id, pos = read_u16(src, pos, end)
    if not packet_id:
        raise protocol_error("packet identifier 0")
    return packet_id, pos


def _done(kind: int, pos: int, end: int) -> None:
    if pos != end:
        raise malformed(f"{end - pos} bytes left over at the end of {_NAMES[kind]}")


# -- reading --------------------------------------------------------------------------


def _connect(flags: int, src: bytes, pos: int, end: int) -> Connect:
    name, pos = read_string(src, pos, end)
    level, pos = read_u8(src, pos, end)
    if name != "MQTT" or level != 5:
        raise malformed(f"protocol {name!r} level {level}, where this reader takes MQTT 5")
    bits, pos = read_u8(src, pos, end)
    if bits & 0x01:
        raise malformed("CONNECT's reserved flag is set")
    will_flag, will_qos, will_retain = bits & 0x04, (bits >> 3) & 0x03, bool(bits & 0x20)
    if will_qos == 3 or (not will_flag and (will_qos or will_retain)):
        raise malformed("Will QoS or Retain set without a valid Will")
    keep_alive, pos = read_u16(src, pos, end)
    keep_alive = sharing.keep_alive(keep_alive)
    props, pos = read_properties(src, pos, end, Carrier.CONNECT)
    if props.authentication_data is not None and props.authentication_method is None:
        raise protocol_error("Authentication Data without an Authentication Method")
    client_id, pos = read_string(src, pos, end)
    will = None
    if will_flag:
        will_props, pos = read_properties(src, pos, end, Carrier.WILL)
        topic, pos = read_string(src, pos, end)
        payload, pos = read_binary(src, pos, end)
        will = Will(topic, payload, will_qos, will_retain, will_props)
    username = password = None
    if bits & 0x80:
        username, pos = read_string(src, pos, end)
    if bits & 0x40:
        password, pos = read_binary(src, pos, end)
    _done(CONNECT, pos, end)
    return Connect(client_id, keep_alive, bool(bits & 0x02), props, will, username, password)


def _connack(flags: int, src: bytes, pos: int, end: int) -> Connack:
    ack_flags, pos = read_u8(src, pos, end)
    if ack_flags & 0xFE:
        raise malformed("CONNACK's reserved flags are set")
    code, pos = _reason(CONNACK, src, pos, end)
    props, pos = read_properties(src, pos, end, Carrier.CONNACK)
    _done(CONNACK, pos, end)
    return Connack(bool(ack_flags & 1), code, props)


def _publish(flags: int, src: bytes, pos: int, end: int) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise malformed("PUBLISH at QoS 3")
    dup = bool(flags & 0x08)
    if dup and not qos:
        raise malformed("DUP set on a QoS 0 PUBLISH")
    topic, pos = read_string(src, pos, end)
    if "+" in topic or "#" in topic:
        raise protocol_error(f"a wildcard in the topic name {topic[:64]!r}")
    packet_id = None
    if qos:
        packet_id, pos = _packet_id(src, pos, end)
    props, pos = read_properties(src, pos, end, Carrier.PUBLISH)
    if not topic and props.topic_alias is None:
        raise protocol_error("an empty topic name and no Topic Alias")
    return Publish(topic, bytes(src[pos:end]), qos, bool(flags & 1), dup, packet_id, props)


def _ack(kind: int) -> Callable[[int, bytes, int, int], Ack]:
    carrier = _ACK_CARRIER[kind]

    def read(flags: int, src: bytes, pos: int, end: int) -> Ack:
        packet_id, pos = _packet_id(src, pos, end)
        if pos == end:  # §3.4.2.1: no reason code means 0x00, and no properties
            return Ack(kind, packet_id)
        code, pos = _reason(kind, src, pos, end)
        props = EMPTY
        if pos < end:
            props, pos = read_properties(src, pos, end, carrier)
        _done(kind, pos, end)
        return Ack(kind, packet_id, code, props)

    return read


def _subscribe(flags: int, src: bytes, pos: int, end: int) -> Subscribe:
    packet_id, pos = _packet_id(src, pos, end)
    props, pos = read_properties(src, pos, end, Carrier.SUBSCRIBE)
    subs: list[Subscription] = []
    while pos < end:
        topic_filter, pos = read_string(src, pos, end)
        options, pos = read_u8(src, pos, end)
        if options & 0xC0:
            raise malformed("a subscription's reserved option bits are set")
        qos, handling = options & 0x03, (options >> 4) & 0x03
        if qos == 3:
            raise malformed("a subscription at QoS 3")
        if handling == 3:
            raise protocol_error("Retain Handling 3")
        subs.append(Subscription(topic_filter, qos, bool(options & 0x04), bool(options & 0x08), handling))
    if not subs:
        raise protocol_error("a SUBSCRIBE without a filter")
    return Subscribe(packet_id, tuple(subs), props)


def _acks(kind: int, carrier: Carrier, make: Callable[[int, tuple[int, ...], Properties], Packet]) -> _Reader:
    """SUBACK and UNSUBACK: a packet id, properties, then a reason code per filter."""

    def read(flags: int, src: bytes, pos: int, end: int) -> Packet:
        packet_id, pos = _packet_id(src, pos, end)
        props, pos = read_properties(src, pos, end, carrier)
        codes = []
        while pos < end:
            code, pos = _reason(kind, src, pos, end)
            codes.append(code)
        return make(packet_id, tuple(codes), props)

    return read


def _unsubscribe(flags: int, src: bytes, pos: int, end: int) -> Unsubscribe:
    packet_id, pos = _packet_id(src, pos, end)
    props, pos = read_properties(src, pos, end, Carrier.UNSUBSCRIBE)
    filters = []
    while pos < end:
        topic_filter, pos = read_string(src, pos, end)
        filters.append(topic_filter)
    if not filters:
        raise protocol_error("an UNSUBSCRIBE without a filter")
    return Unsubscribe(packet_id, tuple(filters), props)


def _empty(kind: int) -> Callable[[int, bytes, int, int], Packet]:
    value = _PINGREQ if kind == PINGREQ else _PINGRESP

    def read(flags: int, src: bytes, pos: int, end: int) -> Packet:
        _done(kind, pos, end)
        return value

    return read


def _disconnect(flags: int, src: bytes, pos: int, end: int) -> Disconnect:
    if pos == end:  # §3.14.2.1: no reason code means 0x00
        return Disconnect()
    code, pos = _reason(DISCONNECT, src, pos, end)
    props = EMPTY
    if pos < end:
        props, pos = read_properties(src, pos, end, Carrier.DISCONNECT)
    _done(DISCONNECT, pos, end)
    return Disconnect(code, props)


def _auth(flags: int, src: bytes, pos: int, end: int) -> Auth:
    if pos == end:  # §3.15.2.1: no reason code means 0x00
        return Auth()
    code, pos = _reason(AUTH, src, pos, end)
    props, pos = read_properties(src, pos, end, Carrier.AUTH)
    _done(AUTH, pos, end)
    return Auth(code, props)


_READERS: dict[int, _Reader] = {
    CONNECT: _connect,
    CONNACK: _connack,
    PUBLISH: _publish,
    PUBACK: _ack(PUBACK),
    PUBREC: _ack(PUBREC),
    PUBREL: _ack(PUBREL),
    PUBCOMP: _ack(PUBCOMP),
    SUBSCRIBE: _subscribe,
    SUBACK: _acks(SUBACK, Carrier.SUBACK, Suback),
    UNSUBSCRIBE: _unsubscribe,
    UNSUBACK: _acks(UNSUBACK, Carrier.UNSUBACK, Unsuback),
    PINGREQ: _empty(PINGREQ),
    PINGRESP: _empty(PINGRESP),
    DISCONNECT: _disconnect,
    AUTH: _auth,
}


def read_packet(first: int, body: bytes) -> Packet:
    """The packet whose fixed header's first byte is ``first`` and whose body (what
    follows the remaining length) is ``body``."""
    kind, flags = first >> 4, first & 0x0F
    reader = _READERS.get(kind)
    if reader is None:
        raise malformed(f"packet type {kind}")
    if kind != PUBLISH and flags != _FLAGS[kind]:
        raise malformed(f"{_NAMES[kind]} with fixed-header flags 0x{flags:X}")
    return reader(flags, body, 0, len(body))


def read_whole(data: bytes) -> tuple[list[tuple[Packet, int]], int]:
    """The whole packets at the start of ``data`` (a stream read so far), each with its
    size on the wire, and how many bytes they took; the rest waits for more (for
    clients and benchmarks)."""
    out: list[tuple[Packet, int]] = []
    pos, end = 0, len(data)
    while end - pos >= 2:
        last = pos + 1
        while last < end and data[last] & 0x80 and last - pos < 4:
            last += 1
        if last >= end:
            break  # the length itself is still arriving
        length, start = read_varint(data, pos + 1, end)
        stop = start + length
        if stop > end:
            break
        out.append((read_packet(data[pos], data[start:stop]), stop - pos))
        pos = stop
    return out, pos


def read_packets(data: bytes) -> list[Packet]:
    """Every packet in ``data``, which holds whole packets only (for clients and tests)."""
    out = []
    pos, end = 0, len(data)
    while pos < end:
        first = data[pos]
        length, start = read_varint(data, pos + 1, end)
        stop = start + length
        if stop > end:
            raise malformed("a packet runs past the end of the buffer")
        out.append(read_packet(first, data[start:stop]))
        pos = stop
    return out


# -- writing --------------------------------------------------------------------------

_H = struct.Struct("!H")


def _pack_connect(p: Connect) -> bytes:
    bits = 0x02 if p.clean_start else 0
    tail = pack_string(p.client_id)
    if p.will is not None:
        bits |= 0x04 | (p.will.qos << 3) | (0x20 if p.will.retain else 0)
        tail += pack_properties(p.will.properties, Carrier.WILL)
        tail += pack_string(p.will.topic) + pack_binary(p.will.payload)
    if p.username is not None:
        bits |= 0x80
        tail += pack_string(p.username)
    if p.password is not None:
        bits |= 0x40
        tail += pack_binary(p.password)
    head = pack_string("MQTT") + bytes((5, bits)) + _H.pack(p.keep_alive)
    return _frame(CONNECT << 4, head + pack_properties(p.properties, Carrier.CONNECT) + tail)


def _pack_publish(p: Publish) -> bytes:
    first = (PUBLISH << 4) | (0x08 if p.dup else 0) | (p.qos << 1) | (1 if p.retain else 0)
    body = pack_string(p.topic)
    if p.qos:
        if not p.packet_id:
            raise ValueError("a QoS 1 or 2 PUBLISH needs a packet id")
        body += _H.pack(p.packet_id)
    return _frame(first, body + pack_properties(p.properties, Carrier.PUBLISH) + p.payload)


def _pack_ack(p: Ack) -> bytes:
    first = (p.kind << 4) | _FLAGS[p.kind]
    body = _H.pack(p.packet_id)
    if p.properties:
        body += bytes((p.reason_code,)) + pack_properties(p.properties, _ACK_CARRIER[p.kind])
    elif p.reason_code:
        body += bytes((p.reason_code,))
    return _frame(first, body)


def _pack_subscribe(p: Subscribe) -> bytes:
    body = bytearray(_H.pack(p.packet_id) + pack_properties(p.properties, Carrier.SUBSCRIBE))
    for s in p.subscriptions:
        options = (
            s.qos | (0x04 if s.no_local else 0) | (0x08 if s.retain_as_published else 0) | (s.retain_handling << 4)
        )
        body += pack_string(s.topic_filter) + bytes((options,))
    return _frame((SUBSCRIBE << 4) | 2, bytes(body))


def _pack_codes(kind: int, carrier: Carrier, packet_id: int, codes: tuple[int, ...], props: Properties) -> bytes:
    return _frame(kind << 4, _H.pack(packet_id) + pack_properties(props, carrier) + bytes(codes))


def _pack_short(kind: int, code: int, props: Properties) -> bytes:
    # DISCONNECT and AUTH: nothing at all for success without properties (§3.14.2.1, §3.15.2.1).
    if not props and not code:
        return bytes((kind << 4, 0))
    carrier = Carrier.DISCONNECT if kind == DISCONNECT else Carrier.AUTH
    return _frame(kind << 4, bytes((code,)) + pack_properties(props, carrier))


def pack(packet: Packet) -> bytes:
    """``packet`` on the wire, fixed header included."""
    if isinstance(packet, Publish):
        return _pack_publish(packet)
    if isinstance(packet, Ack):
        return _pack_ack(packet)
    if isinstance(packet, Connack):
        body = bytes((1 if packet.session_present else 0, packet.reason_code))
        return _frame(CONNACK << 4, body + pack_properties(packet.properties, Carrier.CONNACK))
    if isinstance(packet, Connect):
        return _pack_connect(packet)
    if isinstance(packet, Subscribe):
        return _pack_subscribe(packet)
    if isinstance(packet, Suback):
        return _pack_codes(SUBACK, Carrier.SUBACK, packet.packet_id, packet.reason_codes, packet.properties)
    if isinstance(packet, Unsubscribe):
        body = _H.pack(packet.packet_id) + pack_properties(packet.properties, Carrier.UNSUBSCRIBE)
        return _frame((UNSUBSCRIBE << 4) | 2, body + b"".join(pack_string(f) for f in packet.topic_filters))
    if isinstance(packet, Unsuback):
        return _pack_codes(UNSUBACK, Carrier.UNSUBACK, packet.packet_id, packet.reason_codes, packet.properties)
    if isinstance(packet, Pingreq):
        return b"\xc0\x00"
    if isinstance(packet, Pingresp):
        return b"\xd0\x00"
    if isinstance(packet, Disconnect):
        return _pack_short(DISCONNECT, packet.reason_code, packet.properties)
    return _pack_short(AUTH, packet.reason_code, packet.properties)
