"""MQTT reader, sans-IO: bytes from a client in, packets out (3.1.1 and 3.1 as
:mod:`.packets`, 5.0 as :mod:`.v5.packets` once its CONNECT said so).

:class:`PacketReader` parses what clients send, incrementally: several packets per
read, a packet split across reads, and never more than one packet of the configured
maximum size held back (the size is checked as soon as the remaining length is known,
before the body arrives). Every violation raises :class:`~.packets.ProtocolError`, whose
``connack_code`` is the refusal the spec prescribes when there is one.

Nothing here does I/O or knows about trio: the connection loop feeds bytes and acts on
the packets that come back.
"""

from __future__ import annotations

import re
from typing import TypeAlias

from . import sharing
from .packets import (
    PINGREQ_WIRE,
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

__all__ = ["AnyPacket", "PacketReader", "check_filter", "forbidden_character", "idle_reader"]

AnyPacket: TypeAlias = Packet | v5_packets.Packet
"""A packet from a client of either version: 3.1.1 (and 3.1) or, after an MQTT 5
CONNECT, 5.0."""

_V5_CONNECT = 0x10

# The empty packets carry nothing, so one instance of each serves every connection.
_PINGREQ = Pingreq()
_DISCONNECT = Disconnect()

_CONNECT, _PUBLISH, _PUBACK, _PUBREC, _PUBREL, _PUBCOMP = 1, 3, 4, 5, 6, 7
_SUBSCRIBE, _UNSUBSCRIBE, _PINGREQ_TYPE, _DISCONNECT_TYPE = 8, 10, 12, 14

# Fixed-header flags each client packet type must carry (PUBLISH's are its own).
_REQUIRED_FLAGS = {
    _CONNECT: 0,
    _PUBACK: 0,
    _PUBREC: 0,
    _PUBREL: 2,
    _PUBCOMP: 0,
    _SUBSCRIBE: 2,
    _UNSUBSCRIBE: 2,
    _PINGREQ_TYPE: 0,
    _DISCONNECT_TYPE: 0,
}
_TYPE_NAMES = {
    0: "reserved type 0",
    1: "CONNECT",
    2: "CONNACK",
    3: "PUBLISH",
    4: "PUBACK",
    5: "PUBREC",
    6: "PUBREL",
    7: "PUBCOMP",
    8: "SUBSCRIBE",
    9: "SUBACK",
    10: "UNSUBSCRIBE",
    11: "UNSUBACK",
    12: "PINGREQ",
    13: "PINGRESP",
    14: "DISCONNECT",
    15: "reserved type 15",
}
# Remaining lengths fixed by the spec, so a lie is caught before its body is waited for.
_FIXED_LENGTHS = {_PUBACK: 2, _PUBREC: 2, _PUBREL: 2, _PUBCOMP: 2, _PINGREQ_TYPE: 0, _DISCONNECT_TYPE: 0}


def _first_byte_problem(first: int) -> tuple[str, str] | None:
    kind, flags = first >> 4, first & 0x0F
    name = _TYPE_NAMES[kind]
    if kind == _PUBLISH:
        qos = (flags >> 1) & 0x03
        if qos == 3:
            return "bad-qos", "PUBLISH with QoS 3"
        if flags & 0x08 and not qos:
            return "reserved-flags", "DUP set on a QoS 0 PUBLISH"
        return None
    required = _REQUIRED_FLAGS.get(kind)
    if required is None:
        return "bad-packet-type", f"{name} from a client"
    if flags != required:
        return "reserved-flags", f"{name} with flags {flags:#06b}"
    return None


# Every header byte judged once, up front: the per-packet check is then one index.
_FIRST_BYTE_PROBLEMS: tuple[tuple[str, str] | None, ...] = tuple(_first_byte_problem(b) for b in range(256))
# MQTT 5 adds AUTH (type 15) from clients, with flags 0.
_FIRST_BYTE_PROBLEMS_V5 = tuple(
    (None if b == 0xF0 else ("reserved-flags", f"AUTH with flags {b & 0x0F:#06b}")) if b >> 4 == 15 else problem
    for b, problem in enumerate(_FIRST_BYTE_PROBLEMS)
)
# In MQTT 5 an acknowledgement or a DISCONNECT may carry a reason code and properties.
_FIXED_LENGTHS_V5 = {_PINGREQ_TYPE: 0}


def _parse_v5(kind: int, flags: int, src: bytes, pos: int, end: int) -> AnyPacket:
    if kind == _PINGREQ_TYPE:
        return _PINGREQ
    return v5_codec.read_packet((kind << 4) | flags, src[pos:end])


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


def check_filter(topic_filter: str) -> None:
    """Raise :class:`ProtocolError` unless ``topic_filter`` is a valid filter (4.7.1)."""
    if not topic_filter:
        raise ProtocolError("bad-topic-filter", detail="empty filter")
    if "+" not in topic_filter and "#" not in topic_filter:
        return
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if level == "+" or (level == "#" and i == last):
            continue
        if "+" in level or "#" in level:
            raise ProtocolError("bad-topic-filter", detail=repr(topic_filter[:64]))


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
    level = src[pos]
    pos += 1
    # Judge the protocol before anything after it: MQTT 5 lays out the rest differently.
    if name == "MQTT":
        if level == 5:
            # MQTT 5.0: its own reader (properties, reason codes), from the protocol name on.
            connect = v5_codec.read_packet(_V5_CONNECT, src[start:end])
            assert isinstance(connect, v5_packets.Connect)
            return connect
        if level != 4:
            raise ProtocolError("bad-protocol-level", connack_code=1, detail=f"MQTT protocol level {level}")
    elif name == "MQIsdp":
        # MQTT 3.1, which old devices still send: the same layout as 3.1.1 (the session
        # handles its differences: an id required, no session-present flag).
        if level != 3:
            raise ProtocolError("bad-protocol-level", connack_code=1, detail=f"MQIsdp with level {level}, not 3")
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
    )


def _parse(kind: int, flags: int, src: bytes, pos: int, end: int) -> AnyPacket:
    # Ordered by how often each arrives from a fleet of devices.
    if kind == _PINGREQ_TYPE:
        return _PINGREQ
    if kind == _PUBLISH:
        return _parse_publish(flags, src, pos, end)
    if kind == _PUBACK:
        return Puback(_packet_id(src, pos, end))
    if kind == _CONNECT:
        return _parse_connect(src, pos, end)
    if kind == _SUBSCRIBE:
        return _parse_subscribe(src, pos, end)
    if kind == _DISCONNECT_TYPE:
        return _DISCONNECT
    if kind == _PUBREC:
        return Pubrec(_packet_id(src, pos, end))
    if kind == _PUBREL:
        return Pubrel(_packet_id(src, pos, end))
    if kind == _PUBCOMP:
        return Pubcomp(_packet_id(src, pos, end))
    return _parse_unsubscribe(src, pos, end)  # the header table admits no other type


_IDLE_READERS: dict[tuple[int, bool], PacketReader] = {}


def idle_reader(max_packet_size: int, v5: bool = False) -> PacketReader:
    """The reader shared by every idle connection of this packet bound and version.

    Between packets a reader holds nothing but its bound and its version, so idle
    connections need not hold one each (a million devices, 72 bytes each): they share
    this one, and keep :meth:`PacketReader.settled` after every feed, which gives a
    connection a reader of its own only while it has state to keep.
    """
    reader = _IDLE_READERS.get((max_packet_size, v5))
    if reader is None:
        reader = PacketReader(max_packet_size)
        reader.v5 = reader._home = v5
        reader.shared = True
        _IDLE_READERS[(max_packet_size, v5)] = reader
    return reader


class PacketReader:
    """Incremental parser of client-to-server packets.

    Feed it whatever the socket delivered; it returns the packets completed so far and
    keeps the start of an unfinished one, never more than ``max_packet_size`` bytes
    (a whole packet: fixed header plus remaining length). After a :class:`ProtocolError`
    the reader is spent: it drops its buffer and every later :meth:`feed` raises again.

    A CONNECT at MQTT 5's protocol level turns the reader to 5.0 (:attr:`v5`): what
    follows it is read by :mod:`.v5.codec`, the framing and the size bound unchanged.
    """

    __slots__ = ("_buf", "_error", "_max", "_need", "v5", "_home", "shared")

    def __init__(self, max_packet_size: int = 256 * 1024) -> None:
        if max_packet_size < 2:
            raise ValueError("max_packet_size must be at least 2 (the smallest packet)")
        # Only while a packet is split across reads: an idle device holds no buffer.
        self._buf: bytearray | None = None
        self._max = max_packet_size
        # Size of the packet whose start is buffered, once its header is known; until
        # the buffer reaches it a feed only appends, so a big packet trickling in costs
        # linear time instead of a re-scan per chunk.
        self._need = 0
        self._error: ProtocolError | None = None
        self.v5 = False
        """Whether the client's CONNECT said MQTT 5.0."""
        # None: this connection's own. False or True: a reader shared by idle 3.1.1 or
        # 5.0 connections (see idle_reader), and the version it goes back to.
        self._home: bool | None = None
        self.shared = False
        """Whether this is an :func:`idle_reader`: it holds nothing between feeds (a
        plain attribute, read on every heartbeat)."""

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a packet."""
        return 0 if self._buf is None else len(self._buf)

    def settled(self) -> PacketReader:
        """The reader to keep after a :meth:`feed`, for a connection whose idle reader is
        shared (:func:`idle_reader`).

        A shared reader left holding state (the start of a packet, a failure, a CONNECT
        that turned it to 5.0) hands it to a reader of the connection's own and is as
        new again; a reader of its own with nothing left gives way to the shared one
        of its version. Otherwise the reader stays.
        """
        home = self._home
        spare = self._buf is None and self._error is None
        if home is None:
            return idle_reader(self._max, self.v5) if spare else self
        if spare:
            # Nothing to keep but perhaps a turn to 5.0: the shared reader of that version.
            v5, self.v5 = self.v5, home
            return self if v5 == home else idle_reader(self._max, v5)
        own = PacketReader(self._max)
        own._buf, own._need, own._error, own.v5 = self._buf, self._need, self._error, self.v5
        self._buf, self._need, self._error, self.v5 = None, 0, None, home
        return own

    def feed(self, data: bytes | bytearray | memoryview) -> list[AnyPacket]:
        """Add received bytes; return every packet they complete, in order.

        Raises :class:`ProtocolError` on the first violation; packets completed earlier
        in the same call are then not returned (the connection is going away anyway).
        """
        if self._error is not None:
            error = self._error
            raise ProtocolError(error.reason, error.connack_code, f"reader already failed ({error.detail})")
        buf = self._buf
        if buf is not None:
            buf += data
            if len(buf) < self._need:
                return []
            src = bytes(buf)
            self._buf = None
        elif data == PINGREQ_WIRE:
            return [_PINGREQ]  # a lone heartbeat, by far the commonest read
        else:
            src = data if type(data) is bytes else bytes(data)
        self._need = 0
        try:
            out, pos = self._scan(src)
        except ProtocolError as exc:
            # Kept without its traceback: the traceback's frames hold this reader, and
            # the cycle would outlive the connection once gc.freeze() (servers.gcpolicy)
            # had moved the reader out of the collector's sight. (The buffer is already
            # gone: its bytes moved into src.)
            self._error = ProtocolError(exc.reason, exc.connack_code, exc.detail)
            raise
        if pos < len(src):
            self._buf = bytearray(memoryview(src)[pos:])
        return out

    def _scan(self, src: bytes) -> tuple[list[AnyPacket], int]:
        """Parse whole packets from ``src``; return them and where the unfinished rest begins."""
        out: list[AnyPacket] = []
        v5 = self.v5
        problems = _FIRST_BYTE_PROBLEMS_V5 if v5 else _FIRST_BYTE_PROBLEMS
        lengths = _FIXED_LENGTHS_V5 if v5 else _FIXED_LENGTHS
        parse = _parse_v5 if v5 else _parse
        limit = self._max
        pos = 0
        end = len(src)
        while pos < end:
            first = src[pos]
            problem = problems[first]
            if problem is not None:
                raise ProtocolError(problem[0], detail=problem[1])
            # Remaining length: 7 bits a byte, least significant first, at most 4 bytes.
            i = pos + 1
            if i >= end:
                break
            byte = src[i]
            i += 1
            length = byte & 0x7F
            shift = 7
            while byte & 0x80:
                if shift == 28:
                    raise ProtocolError("malformed-remaining-length", detail="continuation bit on the fourth byte")
                if i - pos >= limit:
                    # The header alone already fills the allowance; the body makes it larger.
                    raise ProtocolError("packet-too-large", detail=f"more than {limit} bytes")
                if i >= end:
                    break
                byte = src[i]
                i += 1
                length |= (byte & 0x7F) << shift
                shift += 7
            else:
                if v5 and not byte and i - pos > 2:
                    # MQTT-1.5.5-1 (5.0): the shortest encoding, so a length cannot hide bytes.
                    raise ProtocolError("malformed-remaining-length", detail="a longer encoding than the length needs")
                kind = first >> 4
                total = i - pos + length
                if total > limit:
                    raise ProtocolError("packet-too-large", detail=f"{total} bytes, more than {limit}")
                fixed = lengths.get(kind)
                if fixed is not None and fixed != length:
                    raise ProtocolError("bad-length", detail=f"{_TYPE_NAMES[kind]} with remaining length {length}")
                stop = pos + total
                if stop > end:
                    self._need = total
                    break
                packet = parse(kind, first & 0x0F, src, i, stop)
                out.append(packet)
                pos = stop
                if kind == _CONNECT and not v5 and type(packet) is v5_packets.Connect:
                    self.v5 = v5 = True
                    problems, lengths, parse = _FIRST_BYTE_PROBLEMS_V5, _FIXED_LENGTHS_V5, _parse_v5
                continue
            break  # the remaining length itself is still arriving
        return out, pos
