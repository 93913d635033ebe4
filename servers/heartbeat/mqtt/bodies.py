"""The bodies of the packets an MQTT 3.1.1 (or 3.1) client sends, parsed field by field,
sans-IO; and the rule on code points every version's strings share.

:mod:`.reader` frames the packets and checks each fixed header once; :func:`parse` reads
what follows it. A CONNECT that names protocol level 5 is read by the MQTT 5 codec
(:mod:`.v5.codec`). Every violation raises :class:`~.packets.ProtocolError`.
"""

from __future__ import annotations

import re
from typing import TypeAlias

from . import sharing
from .filters import check_filter
from .packets import (
    CONNECT,
    DISCONNECT,
    PINGREQ,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBSCRIBE,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    ProtocolError,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Subscribe,
    Unsubscribe,
)
from .v5 import codec as v5_codec
from .v5 import packets as v5_packets

__all__ = ["SHARED_DISCONNECT", "SHARED_PINGREQ", "AnyPacket", "forbidden_character", "read_body"]

AnyPacket: TypeAlias = Packet | v5_packets.Packet
"""A packet from a client of either version: 3.1.1 (and 3.1) or, after an MQTT 5
CONNECT, 5.0."""

V5_CONNECT_HEADER = CONNECT << 4
"""A CONNECT's first byte, as the MQTT 5 codec reads one that names level 5."""

# The empty packets carry nothing, so one instance of each serves every connection.
SHARED_PINGREQ = Pingreq()
SHARED_DISCONNECT = Disconnect()


# -- field readers: each takes the packet's bytes, a position and the packet's end,
# and returns the value and the position after it -------------------------------------


def _u16(src: bytes, pos: int, end: int) -> int:
    if pos + 2 > end:
        raise ProtocolError("truncated-packet", detail="two-byte field past the end")
    return (src[pos] << 8) | src[pos + 1]


def _binary(src: bytes, pos: int, end: int) -> tuple[bytes, int]:
    start = pos + 2
    stop = start + _u16(src, pos, end)
    if stop > end:
        raise ProtocolError("truncated-packet", detail="length-prefixed field past the end")
    return src[start:stop], stop


# Code points no client id, topic, filter, username or Will topic may hold. U+0000 is
# forbidden outright (MQTT-1.5.3-2); C0 and C1 controls and the Unicode non-characters
# are the ones MQTT 1.5.3 lets a server refuse, and refusing them keeps subscribers
# (terminals, JSON and C-string consumers of presence topics) from choking on them.
# Surrogates never get this far: the UTF-8 decoder refuses them (MQTT-1.5.3-1).
_NONCHARACTERS = "\\ufdd0-\\ufdef" + "".join(f"\\U{p:04x}fffe\\U{p:04x}ffff" for p in range(17))
_FORBIDDEN = re.compile(f"[\\x00-\\x1f\\x7f-\\x9f{_NONCHARACTERS}]")


def forbidden_character(text: str) -> str | None:
    """The first code point of ``text`` that no client id, topic, filter or username may
    hold (see :data:`_FORBIDDEN`), or None: the same rule for MQTT 5's strings."""
    if text.isascii() and text.isprintable():
        return None
    bad = _FORBIDDEN.search(text)
    return None if bad is None else bad.group()


def _string(
    src: bytes, pos: int, end: int, what: str = "a string", reason: str = "forbidden-character", code: int | None = None
) -> tuple[str, int]:
    """A UTF-8 string field; one holding a :data:`_FORBIDDEN` code point raises ``reason``
    (with CONNACK ``code``), U+0000 always ``invalid-utf8`` without a CONNACK."""
    raw, pos = _binary(src, pos, end)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("invalid-utf8", detail=f"{raw[:32]!r}") from None
    # Every PUBLISH topic comes through here: printable ASCII, the usual case, is judged
    # by two C-level scans; only other strings pay for the regex.
    if not (text.isascii() and text.isprintable()):
        bad = _FORBIDDEN.search(text)
        if bad is not None:
            char = bad.group()
            if char == "\x00":
                raise ProtocolError("invalid-utf8", detail=f"U+0000 in {what}")  # MQTT-1.5.3-2: close
            raise ProtocolError(reason, connack_code=code, detail=f"U+{ord(char):04X} in {what}")
    return text, pos


def _packet_id(src: bytes, pos: int, end: int) -> int:
    packet_id = _u16(src, pos, end)
    if not packet_id:
        raise ProtocolError("bad-packet-id", detail="packet id 0")
    return packet_id


def _check_topic(topic: str) -> None:
    # Wildcards belong to filters only (MQTT-3.3.2-2); an empty topic names nothing (MQTT-4.7.3-1).
    if not topic or "+" in topic or "#" in topic:
        raise ProtocolError("bad-topic", detail=repr(topic[:64]))


# -- packet parsers: the fixed header has been checked; src[pos:end] is the rest ------


def _parse_publish(flags: int, src: bytes, pos: int, end: int) -> Publish:
    topic, pos = _string(src, pos, end, "a topic")
    _check_topic(topic)
    qos = (flags >> 1) & 0x03
    packet_id = None
    if qos:
        packet_id = _packet_id(src, pos, end)
        pos += 2
    return Publish(topic, src[pos:end], qos, bool(flags & 0x01), bool(flags & 0x08), packet_id)


def _parse_subscribe(src: bytes, pos: int, end: int) -> Subscribe:
    packet_id = _packet_id(src, pos, end)
    pos += 2
    topics: list[tuple[str, int]] = []
    while pos < end:
        topic_filter, pos = _string(src, pos, end, "a topic filter")
        check_filter(topic_filter)
        if pos >= end:
            raise ProtocolError("truncated-packet", detail="filter without its QoS byte")
        qos = src[pos]
        pos += 1
        if qos > 2:  # also catches the six reserved upper bits (MQTT-3.8.3-4)
            raise ProtocolError("bad-qos", detail=f"requested QoS byte {qos:#04x}")
        topics.append((topic_filter, qos))
    if not topics:
        raise ProtocolError("empty-subscribe", detail="SUBSCRIBE without a filter")
    return Subscribe(packet_id, tuple(topics))


def _parse_unsubscribe(src: bytes, pos: int, end: int) -> Unsubscribe:
    packet_id = _packet_id(src, pos, end)
    pos += 2
    filters: list[str] = []
    while pos < end:
        topic_filter, pos = _string(src, pos, end, "a topic filter")
        check_filter(topic_filter)
        filters.append(topic_filter)
    if not filters:
        raise ProtocolError("empty-unsubscribe", detail="UNSUBSCRIBE without a filter")
    return Unsubscribe(packet_id, tuple(filters))


def _parse_connect(src: bytes, pos: int, end: int) -> Connect | v5_packets.Connect:
    start = pos
    name, pos = _string(src, pos, end, "the protocol name")
    if pos >= end:
        raise ProtocolError("truncated-packet", detail="CONNECT without a protocol level")
    # The top bit marks a bridge (Mosquitto's try_private): the level is the rest.
    bridge, level = bool(src[pos] & 0x80), src[pos] & 0x7F
    pos += 1
    # Judge the protocol before anything after it: MQTT 5 lays out the rest differently.
    if name == "MQTT":
        if level == 5 and not bridge:
            # MQTT 5.0: its own reader (properties, reason codes), from the protocol name on.
            connect = v5_codec.read_packet(V5_CONNECT_HEADER, src[start:end])
            assert isinstance(connect, v5_packets.Connect)
            return connect
        if level != 4:
            raise ProtocolError("bad-protocol-level", connack_code=1, detail=f"MQTT protocol level {src[pos - 1]}")
    elif name == "MQIsdp":
        # MQTT 3.1, which old devices still send: the same layout as 3.1.1 (the session
        # handles its differences: an id required, no session-present flag).
        if level != 3:
            raise ProtocolError("bad-protocol-level", connack_code=1, detail=f"MQIsdp with level {src[pos - 1]}, not 3")
    else:
        raise ProtocolError("unknown-protocol", detail=repr(name[:32]))
    if pos >= end:
        raise ProtocolError("truncated-packet", detail="CONNECT without flags")
    flags = src[pos]
    pos += 1
    if flags & 0x01:
        raise ProtocolError("connect-reserved-flag")
    will_flag = bool(flags & 0x04)
    will_qos = (flags >> 3) & 0x03
    will_retain = bool(flags & 0x20)
    has_password = bool(flags & 0x40)
    has_username = bool(flags & 0x80)
    if will_qos == 3:
        raise ProtocolError("bad-will-flags", detail="will QoS 3")
    if not will_flag and (will_qos or will_retain):
        raise ProtocolError("bad-will-flags", detail="will QoS or retain without a will")
    if has_password and not has_username:
        raise ProtocolError("password-without-username")
    keep_alive = sharing.keep_alive(_u16(src, pos, end))
    pos += 2
    # MQTT-3.1.3-9 lets a server refuse an id it does not like: 2, identifier rejected.
    client_id, pos = _string(src, pos, end, "the client id", "identifier-rejected", 2)
    will_topic: str | None = None
    will_message: bytes | None = None
    if will_flag:
        will_topic, pos = _string(src, pos, end, "the Will topic")
        _check_topic(will_topic)
        will_message, pos = _binary(src, pos, end)
    username: str | None = None
    password: bytes | None = None
    if has_username:
        username, pos = _string(src, pos, end, "the username")
    if has_password:
        password, pos = _binary(src, pos, end)
    if pos != end:
        raise ProtocolError("trailing-bytes", detail=f"{end - pos} bytes after the last CONNECT field")
    return Connect(
        protocol_name=name,
        protocol_level=level,
        clean_session=bool(flags & 0x02),
        keep_alive=keep_alive,
        client_id=client_id,
        will_topic=will_topic,
        will_message=will_message,
        will_qos=will_qos,
        will_retain=will_retain,
        username=username,
        password=password,
        bridge=bridge,
    )


def read_body(kind: int, flags: int, src: bytes, pos: int, end: int) -> AnyPacket:
    """The packet of type ``kind`` whose body is ``src[pos:end]`` (its fixed header already
    checked), or :class:`~.packets.ProtocolError`."""
    # Ordered by how often each arrives from a fleet of devices.
    if kind == PINGREQ:
        return SHARED_PINGREQ
    if kind == PUBLISH:
        return _parse_publish(flags, src, pos, end)
    if kind == PUBACK:
        return Puback(_packet_id(src, pos, end))
    if kind == CONNECT:
        return _parse_connect(src, pos, end)
    if kind == SUBSCRIBE:
        return _parse_subscribe(src, pos, end)
    if kind == DISCONNECT:
        return SHARED_DISCONNECT
    if kind == PUBREC:
        return Pubrec(_packet_id(src, pos, end))
    if kind == PUBREL:
        return Pubrel(_packet_id(src, pos, end))
    if kind == PUBCOMP:
        return Pubcomp(_packet_id(src, pos, end))
    return _parse_unsubscribe(src, pos, end)  # the header table admits no other type
