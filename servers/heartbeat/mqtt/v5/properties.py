"""MQTT 5.0 properties (§2.2.2): their types, which packet may carry which, how often.

:class:`Properties` is one packet's set, a frozen value; :func:`read_properties`
parses one from the wire for a given :class:`Carrier` and :func:`pack_properties`
writes one. A property the packet may not carry, or of the wrong type, is a
Malformed Packet (0x81); one given twice that may appear once, or a value out of its
range, is a Protocol Error (0x82), as §2.2.2.2 and the packets' sections say. User
Properties keep their order, which the spec requires of a server that forwards them.
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .reason_codes import PacketError, ReasonCode, malformed, protocol_error
from .wire import (
    pack_binary,
    pack_string,
    pack_varint,
    read_binary,
    read_string,
    read_u8,
    read_u16,
    read_u32,
    read_varint,
)

__all__ = ["EMPTY", "Carrier", "Properties", "pack_properties", "read_properties"]


class Carrier(enum.Enum):
    """What carries a property set: a packet, or a CONNECT's Will."""

    CONNECT = "CONNECT"
    WILL = "Will"
    CONNACK = "CONNACK"
    PUBLISH = "PUBLISH"
    PUBACK = "PUBACK"
    PUBREC = "PUBREC"
    PUBREL = "PUBREL"
    PUBCOMP = "PUBCOMP"
    SUBSCRIBE = "SUBSCRIBE"
    SUBACK = "SUBACK"
    UNSUBSCRIBE = "UNSUBSCRIBE"
    UNSUBACK = "UNSUBACK"
    DISCONNECT = "DISCONNECT"
    AUTH = "AUTH"


@dataclass(frozen=True, slots=True)
class Properties:
    """One packet's properties; None (or empty) where absent. Field names follow the
    spec's property names."""

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: tuple[int, ...] = ()
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None

    def __bool__(self) -> bool:
        return self != EMPTY

    def replace(self, **changes: Any) -> Properties:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


EMPTY = Properties()
"""No properties: what most packets carry, one shared instance."""


# -- the table ------------------------------------------------------------------------

_BYTE, _U16, _U32, _VARINT, _STRING, _BINARY, _PAIR = range(7)

_C = Carrier
_ACKS = (_C.PUBACK, _C.PUBREC, _C.PUBREL, _C.PUBCOMP)
_MESSAGE = (_C.PUBLISH, _C.WILL)


@dataclass(frozen=True, slots=True)
class _Spec:
    ident: int
    field: str
    kind: int
    carriers: frozenset[Carrier]
    least: int = 0
    most: int | None = None
    code: ReasonCode = ReasonCode.PROTOCOL_ERROR
    """What a value out of range is answered with (the spec names 0x94 for a Topic Alias of 0)."""


def _spec(
    ident: int,
    field: str,
    kind: int,
    carriers: tuple[Carrier, ...],
    least: int = 0,
    most: int | None = None,
    code: ReasonCode = ReasonCode.PROTOCOL_ERROR,
) -> _Spec:
    return _Spec(ident, field, kind, frozenset(carriers), least, most, code)


_SPECS = {
    s.ident: s
    for s in (
        _spec(0x01, "payload_format_indicator", _BYTE, _MESSAGE, most=1),
        _spec(0x02, "message_expiry_interval", _U32, _MESSAGE),
        _spec(0x03, "content_type", _STRING, _MESSAGE),
        _spec(0x08, "response_topic", _STRING, _MESSAGE),
        _spec(0x09, "correlation_data", _BINARY, _MESSAGE),
        _spec(0x0B, "subscription_identifiers", _VARINT, (_C.PUBLISH, _C.SUBSCRIBE), least=1),
        _spec(0x11, "session_expiry_interval", _U32, (_C.CONNECT, _C.CONNACK, _C.DISCONNECT)),
        _spec(0x12, "assigned_client_identifier", _STRING, (_C.CONNACK,)),
        _spec(0x13, "server_keep_alive", _U16, (_C.CONNACK,)),
        _spec(0x15, "authentication_method", _STRING, (_C.CONNECT, _C.CONNACK, _C.AUTH)),
        _spec(0x16, "authentication_data", _BINARY, (_C.CONNECT, _C.CONNACK, _C.AUTH)),
        _spec(0x17, "request_problem_information", _BYTE, (_C.CONNECT,), most=1),
        _spec(0x18, "will_delay_interval", _U32, (_C.WILL,)),
        _spec(0x19, "request_response_information", _BYTE, (_C.CONNECT,), most=1),
        _spec(0x1A, "response_information", _STRING, (_C.CONNACK,)),
        _spec(0x1C, "server_reference", _STRING, (_C.CONNACK, _C.DISCONNECT)),
        _spec(
            0x1F,
            "reason_string",
            _STRING,
            (_C.CONNACK, *_ACKS, _C.SUBACK, _C.UNSUBACK, _C.DISCONNECT, _C.AUTH),
        ),
        _spec(0x21, "receive_maximum", _U16, (_C.CONNECT, _C.CONNACK), least=1),
        _spec(0x22, "topic_alias_maximum", _U16, (_C.CONNECT, _C.CONNACK)),
        _spec(0x23, "topic_alias", _U16, (_C.PUBLISH,), least=1, code=ReasonCode.TOPIC_ALIAS_INVALID),
        _spec(0x24, "maximum_qos", _BYTE, (_C.CONNACK,), most=1),
        _spec(0x25, "retain_available", _BYTE, (_C.CONNACK,), most=1),
        _spec(0x26, "user_properties", _PAIR, tuple(Carrier)),
        _spec(0x27, "maximum_packet_size", _U32, (_C.CONNECT, _C.CONNACK), least=1),
        _spec(0x28, "wildcard_subscription_available", _BYTE, (_C.CONNACK,), most=1),
        _spec(0x29, "subscription_identifier_available", _BYTE, (_C.CONNACK,), most=1),
        _spec(0x2A, "shared_subscription_available", _BYTE, (_C.CONNACK,), most=1),
    )
}
_BY_FIELD = {s.field: s for s in _SPECS.values()}
_USER, _SUB_ID = 0x26, 0x0B


def _read_pair(src: bytes, pos: int, end: int) -> tuple[tuple[str, str], int]:
    key, pos = read_string(src, pos, end)
    value, pos = read_string(src, pos, end)
    return (key, value), pos


_READERS: dict[int, Callable[[bytes, int, int], tuple[Any, int]]] = {
    _BYTE: read_u8,
    _U16: read_u16,
    _U32: read_u32,
    _VARINT: read_varint,
    _STRING: read_string,
    _BINARY: read_binary,
    _PAIR: _read_pair,
}


def read_properties(src: bytes, pos: int, end: int, carrier: Carrier) -> tuple[Properties, int]:
    """The property set at ``pos`` (its length first), checked for ``carrier``."""
    length, pos = read_varint(src, pos, end)
    stop = pos + length
    if stop > end:
        raise malformed(f"{carrier.value} properties run past the end")
    if not length:
        return EMPTY, pos
    found: dict[str, Any] = {}
    users: list[tuple[str, str]] = []
    sub_ids: list[int] = []
    while pos < stop:
        ident, pos = read_varint(src, pos, stop)
        spec = _SPECS.get(ident)
        if spec is None:
            raise malformed(f"unknown property 0x{ident:02X} in {carrier.value}")
        if carrier not in spec.carriers:
            raise malformed(f"property {spec.field} (0x{ident:02X}) may not be in {carrier.value}")
        value, pos = _READERS[spec.kind](src, pos, stop)
        if ident == _USER:
            users.append(value)
            continue
        if spec.kind <= _VARINT:  # a number: its range
            if value < spec.least:
                raise PacketError(spec.code, f"{spec.field} {value} in {carrier.value}: at least {spec.least}")
            if spec.most is not None and value > spec.most:
                raise protocol_error(f"{spec.field} {value} in {carrier.value}: 0 or 1 only")
        if ident == _SUB_ID:
            if sub_ids and carrier is not Carrier.PUBLISH:
                raise protocol_error(f"subscription_identifier twice in {carrier.value}")
            sub_ids.append(value)
            continue
        if spec.field in found:
            raise protocol_error(f"{spec.field} twice in {carrier.value}")
        found[spec.field] = value
    if users:
        found["user_properties"] = tuple(users)
    if sub_ids:
        found["subscription_identifiers"] = tuple(sub_ids)
    return Properties(**found), stop


_B = struct.Struct("!B")
_H = struct.Struct("!H")
_I = struct.Struct("!I")


def _pack_value(kind: int, value: Any) -> bytes:
    if kind == _BYTE:
        return _B.pack(value)
    if kind == _U16:
        return _H.pack(value)
    if kind == _U32:
        return _I.pack(value)
    if kind == _VARINT:
        return pack_varint(value)
    if kind == _STRING:
        return pack_string(value)
    if kind == _BINARY:
        return pack_binary(value)
    return pack_string(value[0]) + pack_string(value[1])


def pack_properties(props: Properties, carrier: Carrier) -> bytes:
    """``props`` on the wire, length first, in the order of the spec's table (User
    Properties in their own order). A property ``carrier`` may not carry is a
    ValueError: the server never sends one."""
    if props is EMPTY:
        return b"\x00"
    out = bytearray()
    for spec in _SPECS.values():
        value = getattr(props, spec.field)
        if value is None or value == ():
            continue
        if carrier not in spec.carriers:
            raise ValueError(f"property {spec.field} may not be in {carrier.value}")
        head = pack_varint(spec.ident)
        if spec.ident in (_USER, _SUB_ID):
            for item in value:
                out += head + _pack_value(spec.kind, item)
        else:
            out += head + _pack_value(spec.kind, value)
    return pack_varint(len(out)) + bytes(out)


def field_ident(field: str) -> int:
    """The property identifier of a :class:`Properties` field (for tests and logs)."""
    return _BY_FIELD[field].ident
