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

from .bodies import SHARED_PINGREQ, AnyPacket, read_body
from .packets import (
    CONNECT,
    DISCONNECT,
    PINGREQ,
    PINGREQ_WIRE,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBSCRIBE,
    TYPE_NAMES,
    UNSUBSCRIBE,
    ProtocolError,
)
from .v5 import codec as v5_codec
from .v5 import packets as v5_packets

__all__ = ["AnyPacket", "PacketReader", "idle_reader"]

# Fixed-header flags each client packet type must carry (PUBLISH's are its own).
_REQUIRED_FLAGS = {
    CONNECT: 0,
    PUBACK: 0,
    PUBREC: 0,
    PUBREL: 2,
    PUBCOMP: 0,
    SUBSCRIBE: 2,
    UNSUBSCRIBE: 2,
    PINGREQ: 0,
    DISCONNECT: 0,
}
# Remaining lengths fixed by the spec, so a lie is caught before its body is waited for.
_FIXED_LENGTHS = {PUBACK: 2, PUBREC: 2, PUBREL: 2, PUBCOMP: 2, PINGREQ: 0, DISCONNECT: 0}


def _first_byte_problem(first: int) -> tuple[str, str] | None:
    kind, flags = first >> 4, first & 0x0F
    name = TYPE_NAMES[kind]
    if kind == PUBLISH:
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
_FIXED_LENGTHS_V5 = {PINGREQ: 0}


def _parse_v5(kind: int, flags: int, src: bytes, pos: int, end: int) -> AnyPacket:
    if kind == PINGREQ:
        return SHARED_PINGREQ
    return v5_codec.read_packet((kind << 4) | flags, src[pos:end])


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
            return [SHARED_PINGREQ]  # a lone heartbeat, by far the commonest read
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
        parse = _parse_v5 if v5 else read_body
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
                    raise ProtocolError("bad-length", detail=f"{TYPE_NAMES[kind]} with remaining length {length}")
                stop = pos + total
                if stop > end:
                    self._need = total
                    break
                packet = parse(kind, first & 0x0F, src, i, stop)
                out.append(packet)
                pos = stop
                if kind == CONNECT and not v5 and type(packet) is v5_packets.Connect:
                    self.v5 = v5 = True
                    problems, lengths, parse = _FIRST_BYTE_PROBLEMS_V5, _FIXED_LENGTHS_V5, _parse_v5
                continue
            break  # the remaining length itself is still arriving
        return out, pos
