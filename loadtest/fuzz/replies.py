"""What the server answered on a fuzz connection, read from the raw bytes kept of it:
the first MQTT packet's kind (a 3.x or a 5.0 CONNACK's code), a 5.0 server's
DISCONNECT reason, or the status of every HTTP response. Pure.
"""

from __future__ import annotations

import re

from servers.heartbeat.v5.codec import read_packet
from servers.heartbeat.v5.packets import Connack, Disconnect
from servers.heartbeat.v5.reason_codes import PacketError

from ..mqtt_frames import frames

__all__ = ["ACCEPTED", "http_statuses", "mqtt_disconnect", "mqtt_reply"]

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
