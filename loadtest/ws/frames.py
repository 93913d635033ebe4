"""The WebSocket wire as the load's clients speak it (RFC 6455): the opening request,
the check of the server's 101, masked client frames built once, and a parser of the
server's frames.

Written here rather than taken from the servers' own code (``servers.ws``) or a client
library: a load generator should speak the wire independently of what it tests, and a
library's per-message costs would make the client the bottleneck of the echo load.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass

__all__ = [
    "BINARY",
    "CLOSE",
    "PING",
    "PONG",
    "TEXT",
    "Frame",
    "FrameReader",
    "accepted",
    "client_frame",
    "server_frame",
    "upgrade_request",
]

TEXT, BINARY, CLOSE, PING, PONG = 0x1, 0x2, 0x8, 0x9, 0xA

# One key for every connection: the server only has to answer it, and the answer is
# then checked against a value computed once.
_KEY = base64.b64encode(b"idlekeeper-load!").decode()
_ACCEPT = base64.b64encode(hashlib.sha1((_KEY + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
_MASK = b"\x37\xfa\x21\x3d"


def upgrade_request(port: int, path: str = "/", subprotocol: str | None = None) -> bytes:
    """The opening handshake's request: no extension offered, so frames go uncompressed."""
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {_KEY}",
        "Sec-WebSocket-Version: 13",
    ]
    if subprotocol is not None:
        lines.append(f"Sec-WebSocket-Protocol: {subprotocol}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def accepted(head: bytes) -> bool:
    """Whether a response head (up to its blank line) is a 101 that answers our key."""
    status, _, rest = head.partition(b"\r\n")
    if not status.startswith(b"HTTP/1.1 101"):
        return False
    for line in rest.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"sec-websocket-accept":
            return value.strip() == _ACCEPT
    return False


def _header(opcode: int, length: int, mask_bit: int) -> bytes:
    first = 0x80 | opcode  # FIN: every message here is one frame
    if length < 126:
        return bytes((first, mask_bit | length))
    if length < 1 << 16:
        return bytes((first, mask_bit | 126)) + struct.pack("!H", length)
    return bytes((first, mask_bit | 127)) + struct.pack("!Q", length)


def client_frame(opcode: int, payload: bytes = b"") -> bytes:
    """A masked frame, as a client must send it; build it once and send it many times."""
    masked = bytes(b ^ _MASK[i % 4] for i, b in enumerate(payload))
    return _header(opcode, len(payload), 0x80) + _MASK + masked


def server_frame(opcode: int, payload: bytes = b"") -> bytes:
    """An unmasked frame, as a server sends it: what an echo of ``payload`` looks like."""
    return _header(opcode, len(payload), 0) + payload


@dataclass(frozen=True)
class Frame:
    """One frame from the server."""

    opcode: int
    payload: bytes


class FrameReader:
    """Frames from the server's bytes, however they were split across reads."""

    __slots__ = ("_buf",)

    def __init__(self, data: bytes = b"") -> None:
        self._buf = bytearray(data)

    def feed(self, data: bytes) -> list[Frame]:
        """Every frame complete after ``data``; the rest waits for more."""
        self._buf += data
        frames: list[Frame] = []
        buf = self._buf
        at = 0
        while len(buf) - at >= 2:
            opcode, second = buf[at] & 0x0F, buf[at + 1]
            length, head = second & 0x7F, 2
            if length == 126:
                if len(buf) - at < 4:
                    break
                length, head = struct.unpack_from("!H", buf, at + 2)[0], 4
            elif length == 127:
                if len(buf) - at < 10:
                    break
                length, head = struct.unpack_from("!Q", buf, at + 2)[0], 10
            mask = b""
            if second & 0x80:  # a server must not mask, but read it right if one does
                if len(buf) - at < head + 4:
                    break
                mask, head = bytes(buf[at + head : at + head + 4]), head + 4
            if len(buf) - at < head + length:
                break
            payload = bytes(buf[at + head : at + head + length])
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            frames.append(Frame(opcode, payload))
            at += head + length
        del buf[:at]
        return frames

    def pending(self) -> int:
        """Bytes held for a frame not yet complete."""
        return len(self._buf)
