"""What a remote broker sends a client, sans-IO: bytes in, packets out, for either version.

Both versions come out as :mod:`..v5.packets` values (a 3.1.1 packet is a 5.0 one with
reason code 0 and no properties), so that the session speaks one vocabulary. 5.0
bodies are read by :mod:`..v5.codec`; 3.1.1 PUBLISH and the four acknowledgements by
the server's own body reader (:mod:`..bodies`: they are laid out alike both ways),
and the packets only a server sends (CONNACK, SUBACK, UNSUBACK, PINGRESP) here.
"""

from __future__ import annotations

from .. import packets as v3
from ..bodies import read_body
from ..packets import MAX_REMAINING_LENGTH, ProtocolError
from ..v5 import codec as v5_codec
from ..v5 import packets as v5
from ..v5.reason_codes import PacketError, ReasonCode, malformed

__all__ = ["ServerPacketReader"]

# The packet types a server may send a client; a client's own (CONNECT, SUBSCRIBE...)
# coming back is a violation. AUTH is 5.0 only.
_FROM_SERVER_V3 = frozenset({v3.CONNACK, v3.PUBLISH, v3.PUBACK, v3.PUBREC, v3.PUBREL, v3.PUBCOMP, v3.SUBACK})
_FROM_SERVER_V3 |= {v3.UNSUBACK, v3.PINGRESP}
_FROM_SERVER_V5 = _FROM_SERVER_V3 | {v5.DISCONNECT, v5.AUTH}

# 3.1.1's fixed header flags (2.2.2) and remaining lengths fixed by the spec.
_FLAGS_V3 = {kind: (2 if kind == v3.PUBREL else 0) for kind in _FROM_SERVER_V3 - {v3.PUBLISH}}
_LENGTHS_V3 = {v3.CONNACK: 2, v3.PUBACK: 2, v3.PUBREC: 2, v3.PUBREL: 2, v3.PUBCOMP: 2, v3.UNSUBACK: 2}
_LENGTHS_V3[v3.PINGRESP] = 0
_GRANTED_V3 = frozenset({0, 1, 2, 0x80})
_PINGRESP = v5.Pingresp()


def _read_v3(first: int, body: bytes) -> v5.Packet:
    """A 3.1.1 packet from a server, as the 5.0 value that means the same."""
    kind, flags = first >> 4, first & 0x0F
    if kind == v3.PUBLISH:
        if (flags >> 1) & 3 == 3 or (flags & 0x08 and not flags & 0x06):
            raise ProtocolError("reserved-flags", detail=f"PUBLISH with flags {flags:#06b}")
        p = read_body(kind, flags, body, 0, len(body))
        assert isinstance(p, v3.Publish)
        return v5.Publish(p.topic, bytes(p.payload), p.qos, p.retain, p.dup, p.packet_id)
    if flags != _FLAGS_V3[kind]:
        raise ProtocolError("reserved-flags", detail=f"{v3.TYPE_NAMES[kind]} with flags {flags:#06b}")
    fixed = _LENGTHS_V3.get(kind)
    if fixed is not None and fixed != len(body):
        raise ProtocolError("bad-length", detail=f"{v3.TYPE_NAMES[kind]} with remaining length {len(body)}")
    if kind == v3.CONNACK:
        if body[0] & 0xFE:
            raise ProtocolError("reserved-flags", detail="CONNACK's reserved flags are set")
        return v5.Connack(bool(body[0] & 1), body[1])
    if kind == v3.PINGRESP:
        return _PINGRESP
    if len(body) < 2 or not (packet_id := (body[0] << 8) | body[1]):
        raise ProtocolError("bad-packet-id", detail=f"{v3.TYPE_NAMES[kind]} without a packet id")
    if kind == v3.SUBACK:
        codes = tuple(body[2:])
        if not codes or not set(codes) <= _GRANTED_V3:
            raise ProtocolError("bad-suback", detail=f"return codes {codes!r}")
        return v5.Suback(packet_id, codes)
    if kind == v3.UNSUBACK:
        return v5.Unsuback(packet_id, ())
    # PUBACK, PUBREC, PUBREL, PUBCOMP: the same two bytes either way.
    return v5.Ack(kind, packet_id)


class ServerPacketReader:
    """Incremental parser of what a server sends: several packets per read, a packet
    split across reads, never more than ``max_packet_size`` bytes held (the size is
    judged as soon as the remaining length is known). Raises
    :class:`~..packets.ProtocolError` (5.0: a :class:`~..v5.reason_codes.PacketError`
    carrying the reason code to send) on the first violation."""

    __slots__ = ("_buf", "_max", "v5")

    def __init__(self, v5: bool, max_packet_size: int = MAX_REMAINING_LENGTH + 5) -> None:
        self._buf = bytearray()
        self._max = max_packet_size
        self.v5 = v5
        """Whether the remote speaks 5.0 (chosen by our CONNECT, not by the remote)."""

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a packet."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[v5.Packet]:
        """Add received bytes; return every packet they complete, in order."""
        buf = self._buf
        buf += data
        out: list[v5.Packet] = []
        pos, end = 0, len(buf)
        allowed = _FROM_SERVER_V5 if self.v5 else _FROM_SERVER_V3
        while end - pos >= 2:
            first = buf[pos]
            if first >> 4 not in allowed:
                raise ProtocolError("bad-packet-type", detail=f"{v3.TYPE_NAMES[first >> 4]} from a server")
            header = self._length(buf, pos + 1, end)
            if header is None:
                break  # the remaining length itself is still arriving
            length, start = header
            total = start - pos + length
            if total > self._max:
                raise self._too_large(total)
            if pos + total > end:
                break
            body = bytes(buf[start : pos + total])
            out.append(v5_codec.read_packet(first, body) if self.v5 else _read_v3(first, body))
            pos += total
        del buf[:pos]
        return out

    def _length(self, buf: bytearray, pos: int, end: int) -> tuple[int, int] | None:
        """The remaining length at ``pos`` and where the body starts; None while incomplete."""
        length = 0
        for shift in (0, 7, 14, 21):
            if pos >= end:
                return None
            byte = buf[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if self.v5 and shift and not byte:
                    raise malformed("a longer remaining length than it needs")  # MQTT-1.5.5-1
                return length, pos
        raise ProtocolError("malformed-remaining-length", detail="continuation bit on the fourth byte")

    def _too_large(self, total: int) -> ProtocolError:
        detail = f"{total} bytes, more than the {self._max} we allow"
        if self.v5:
            return PacketError(ReasonCode.PACKET_TOO_LARGE, detail)
        return ProtocolError("packet-too-large", detail=detail)
