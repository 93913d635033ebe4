"""What the server answered on a fuzz connection, read from the raw bytes kept of it:
the first MQTT packet's kind (a 3.x or a 5.0 CONNACK's code), a 5.0 server's
DISCONNECT reason, the status of every HTTP response, or a WebSocket's answer (the
handshake's status, the messages, the close code), read as strictly as RFC 6455
and RFC 7692 ask of what a server sends. Pure.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass

from servers.heartbeat.mqtt.v5.codec import read_packet
from servers.heartbeat.mqtt.v5.packets import Connack, Disconnect
from servers.heartbeat.mqtt.v5.reason_codes import PacketError

from ..mqtt_frames import frames

__all__ = ["ACCEPTED", "WsReply", "http_statuses", "mqtt_disconnect", "mqtt_reply", "ws_reply"]

ACCEPTED = ("connack-0", "connack-v5-0x00")
"""The replies that accept a session: a 3.x CONNACK 0, a 5.0 CONNACK with reason code 0x00."""

_PACKET_NAMES = {
    0x2: "connack",
    0x3: "publish",
    0x4: "puback",
    0x5: "pubrec",
    0x6: "pubrel",
    0x7: "pubcomp",
    0x9: "suback",
    0xB: "unsuback",
    0xD: "pingresp",
}


def mqtt_reply(data: bytes) -> str:
    """What the server's first packet was: ``connack-<rc>`` (3.x), ``connack-v5-0x<rc>``
    (5.0, or ``connack-v5-malformed`` if it does not parse), ``disconnect-v5-0x<rc>``,
    another type's name, or ``none``."""
    try:
        found, _ = frames(data)
    except ValueError:
        return "malformed"
    if not found:
        return "none" if not data else "partial"
    first, start, end = found[0]
    kind = first >> 4
    if kind == 0x2 and end - start == 2:
        return f"connack-{data[start + 1]}"
    if kind == 0x2:
        try:
            packet = read_packet(first, data[start:end])
        except PacketError:
            return "connack-v5-malformed"
        assert isinstance(packet, Connack)
        return f"connack-v5-0x{packet.reason_code:02X}"
    if kind == 0xE:
        return f"disconnect-v5-{mqtt_disconnect(data) or 'malformed'}"
    return _PACKET_NAMES.get(kind, f"type-{kind}")


def mqtt_disconnect(data: bytes) -> str:
    """The reason code of the DISCONNECT a 5.0 server sent before closing (``0x81``),
    ``malformed`` if it does not parse, or empty if it sent none."""
    try:
        found, _ = frames(data)
    except ValueError:
        return ""
    for first, start, end in reversed(found):
        if first >> 4 == 0xE:
            try:
                packet = read_packet(first, data[start:end])
            except PacketError:
                return "malformed"
            assert isinstance(packet, Disconnect)
            return f"0x{packet.reason_code:02X}"
    return ""


_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})[^\r\n]*\r\n")


def http_statuses(data: bytes) -> tuple[int, ...]:
    """The status of every response in ``data``, framed by Content-Length or chunked
    encoding; a body that does not frame (a HEAD's, say) is skipped by looking for the
    next status line after the head."""
    out: list[int] = []
    pos = 0
    while pos < len(data):
        m = _STATUS_LINE.match(data, pos)
        if m is None:
            nxt = _STATUS_LINE.search(data, pos)
            if nxt is None:
                break
            m = nxt
        status = int(m.group(1))
        out.append(status)
        head_end = data.find(b"\r\n\r\n", m.start())
        if head_end < 0:
            break
        head = data[m.start() : head_end].lower()
        body = head_end + 4
        if status < 200 or status in (204, 304):
            pos = body
            continue
        length = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
        if length is not None:
            pos = body + int(length.group(1))
            if not data.startswith(b"HTTP/1.", pos):
                pos = body  # no body after all (a HEAD's): look again from the head's end
        elif b"transfer-encoding: chunked" in head:
            pos = _skip_chunked(data, body)
        else:
            break  # a body until close: nothing else follows
    return tuple(out)


def _skip_chunked(data: bytes, pos: int) -> int:
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return len(data)
        try:
            size = int(data[pos:line_end].split(b";")[0], 16)
        except ValueError:
            return len(data)
        pos = line_end + 2
        if size == 0:
            end = data.find(b"\r\n\r\n", pos - 2)
            return len(data) if end < 0 else end + 4
        pos += size + 2


# -- WebSocket ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WsReply:
    """What a server answered to a WebSocket input."""

    outcome: str
    """``http-<status>`` (the handshake refused, or served as plain HTTP), ``close-<code>``
    (its close frame; 1005 for one without a code), ``eof`` (no close frame: the
    connection ended, or we stopped reading), ``none`` (not a byte), ``http-garbage``
    (not an HTTP response) or ``bad-frame`` (a frame a client must refuse: :attr:`problem`);
    the connection's record may say ``bad-handshake`` instead (a compression offer
    agreed that had to be declined, or the other way round)."""
    messages: tuple[str | bytes, ...] = ()
    """The messages it sent, whole, in order."""
    binary: bytes = b""
    """The bytes of its binary messages, joined (MQTT over WebSockets: the MQTT bytes)."""
    deflate: bool = False
    """Whether its 101 agreed to ``permessage-deflate``."""
    problem: str = ""


_WINDOW_BITS = re.compile(rb"server_max_window_bits=(\d+)")
_SENDABLE_CODES = frozenset((1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014))


def _extension(head: bytes) -> tuple[bool, int, bool]:
    """From a 101's head: permessage-deflate agreed, the server's window bits, and
    whether it keeps no context between messages."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"sec-websocket-extensions" and b"permessage-deflate" in value.lower():
            bits = _WINDOW_BITS.search(value)
            return True, int(bits.group(1)) if bits else 15, b"server_no_context_takeover" in value.lower()
    return False, 15, False


def _inflate(inflater: zlib._Decompress, data: bytes, bits: int) -> bytes:
    """Inflate as a client holding only the agreed window would: in steps small enough
    that a reference further back than ``2**bits`` bytes is an error, not a lucky read
    from the output zlib still has."""
    if bits >= 15:
        return inflater.decompress(data)
    out = bytearray()
    while data:
        out += inflater.decompress(data, 64)
        data = inflater.unconsumed_tail
    return bytes(out)


class _Bad(Exception):
    """A frame from the server that a client must refuse."""


def _server_frames(data: bytes, head: bytes, mqtt: bool) -> tuple[list[str | bytes], int | None]:
    """The messages and the close code in the frames after a 101 (raises :class:`_Bad`)."""
    deflated, bits, no_context = _extension(head)
    inflater = zlib.decompressobj(-bits) if deflated else None
    messages: list[str | bytes] = []
    parts: list[bytes] = []
    opcode: int | None = None
    compressed = False
    pos = 0
    while len(data) - pos >= 2:
        first, second = data[pos], data[pos + 1]
        n, at = second & 0x7F, pos + 2
        if n == 126:
            if len(data) < at + 2:
                break
            n, at = struct.unpack("!H", data[at : at + 2])[0], at + 2
            if n <= 125:
                raise _Bad("a 16-bit length that fits in 7 bits")
        elif n == 127:
            if len(data) < at + 8:
                break
            n, at = struct.unpack("!Q", data[at : at + 8])[0], at + 8
            if n <= 0xFFFF or n >> 63:
                raise _Bad("a 64-bit length that fits in 16 bits, or with its top bit set")
        if second & 0x80:
            raise _Bad("a masked frame from the server")
        if len(data) < at + n:
            break  # cut short: the end of what was read
        payload, pos = data[at : at + n], at + n
        kind, fin, rsv = first & 0x0F, bool(first & 0x80), first & 0x70
        if kind >= 0x8:
            if kind not in (0x8, 0x9, 0xA) or not fin or n > 125 or rsv:
                raise _Bad(f"a bad control frame (opcode {kind:#x}, FIN {fin}, {n} bytes, RSV {rsv:#x})")
            if kind == 0x8:
                if pos < len(data):
                    raise _Bad("bytes after the close frame")
                return messages, _close_code(payload)
            continue
        if kind not in (0x0, 0x1, 0x2) or (kind == 0x0) != (opcode is not None):
            raise _Bad(f"a data frame out of place (opcode {kind:#x})")
        if rsv & ~0x40 or (rsv and (kind == 0x0 or inflater is None)):
            raise _Bad(f"reserved bits {rsv:#x} that no extension agreed gives a meaning")
        if opcode is None:
            opcode, compressed = kind, bool(rsv)
        parts.append(payload)
        if not fin:
            continue
        body = b"".join(parts)
        if compressed:
            assert inflater is not None
            try:
                body = _inflate(inflater, body + b"\x00\x00\xff\xff", bits)
            except zlib.error as exc:
                raise _Bad(f"a compressed message that does not inflate with {bits} window bits: {exc}") from None
            if no_context:
                inflater = zlib.decompressobj(-bits)
        if opcode == 0x1:
            if mqtt:
                raise _Bad("a text frame carrying MQTT")
            try:
                messages.append(body.decode())
            except UnicodeDecodeError:
                raise _Bad("a text message that is not UTF-8") from None
        else:
            messages.append(body)
        parts, opcode = [], None
    return messages, None


def _close_code(payload: bytes) -> int:
    if not payload:
        return 1005
    if len(payload) == 1:
        raise _Bad("a close frame with a 1-byte payload")
    code = int.from_bytes(payload[:2], "big")
    if code not in _SENDABLE_CODES and not 3000 <= code <= 4999:
        raise _Bad(f"a close code an endpoint may not send ({code})")
    try:
        payload[2:].decode()
    except UnicodeDecodeError:
        raise _Bad("a close reason that is not UTF-8") from None
    return code


def ws_reply(data: bytes, mqtt: bool = False) -> WsReply:
    """What a server answered to a WebSocket input (``mqtt``: it carries MQTT, where a
    text frame from the server is a fault too)."""
    if not data:
        return WsReply("none")
    m = _STATUS_LINE.match(data)
    if m is None:
        return WsReply("http-garbage", problem=repr(data[:40]))
    status = int(m.group(1))
    head_end = data.find(b"\r\n\r\n")
    if status != 101:
        return WsReply(f"http-{status}")
    if head_end < 0:
        return WsReply("eof")
    deflate = _extension(data[:head_end])[0]
    try:
        messages, code = _server_frames(data[head_end + 4 :], data[:head_end], mqtt)
    except _Bad as exc:
        return WsReply("bad-frame", deflate=deflate, problem=str(exc))
    binary = b"".join(m for m in messages if isinstance(m, bytes))
    return WsReply("eof" if code is None else f"close-{code}", tuple(messages), binary, deflate)
