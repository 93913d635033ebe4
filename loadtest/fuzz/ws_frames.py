"""WebSocket frames as a fuzz client writes them (RFC 6455 §5.2), free to lie: any
opcode, reserved bits, mask or none, a length encoded longer than it needs or other
than the payload's. Pure.

A fuzz input's segments (:mod:`.segments`) are its opening handshake, then one frame
each; :func:`encode` writes a :class:`Frame`, and :func:`parse` reads one back from
a segment, so a mutator can rewrite a frame's header and leave its payload, or the
other way round. :func:`deflate` compresses a message as ``permessage-deflate``
(RFC 7692 §7.2.1) does.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, replace

__all__ = [
    "BINARY",
    "CLOSE",
    "CONTINUATION",
    "CONTROL",
    "FORMS",
    "PING",
    "PONG",
    "RSV1",
    "RSV2",
    "RSV3",
    "TEXT",
    "Frame",
    "close_payload",
    "deflate",
    "encode",
    "parse",
    "reframe",
]

CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
CONTROL = (CLOSE, PING, PONG)
RSV1, RSV2, RSV3 = 0x40, 0x20, 0x10
"""The reserved bits, as they sit in a frame's first byte (RSV1: compressed, RFC 7692)."""

FORMS = ("min", "16", "64")
"""How a payload length is written: in as few bytes as it needs (the only valid way),
or always in the 16-bit or the 64-bit extended field."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame from the client: its header's fields and its payload (unmasked)."""

    opcode: int
    payload: bytes
    fin: bool = True
    rsv: int = 0
    """The reserved bits set (:data:`RSV1` and so on, or'ed)."""
    mask: bytes | None = b"\x00\x00\x00\x00"
    """The masking key (4 bytes); None: unmasked, which a client must never send."""
    length: int | None = None
    """The payload length the header declares, if not the payload's own."""
    form: str = "min"
    """One of :data:`FORMS`."""

    @property
    def declared(self) -> int:
        """The payload length the header says."""
        return len(self.payload) if self.length is None else self.length


def _masked(payload: bytes, key: bytes) -> bytes:
    if key == b"\x00\x00\x00\x00":
        return payload
    # XOR by whole words: a frame of 64 KiB masks in microseconds.
    stream = (key * (len(payload) // 4 + 1))[: len(payload)]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(payload), "big")


def encode(frame: Frame) -> bytes:
    """The frame's bytes, lies and all."""
    first = (0x80 if frame.fin else 0) | (frame.rsv & 0x70) | (frame.opcode & 0x0F)
    mask_bit = 0x80 if frame.mask is not None else 0
    n = frame.declared
    if frame.form == "64" or (frame.form == "min" and n > 0xFFFF):
        head = bytes((first, mask_bit | 127)) + struct.pack("!Q", n & 0xFFFFFFFFFFFFFFFF)
    elif frame.form == "16" or (frame.form == "min" and n > 125):
        head = bytes((first, mask_bit | 126)) + struct.pack("!H", n & 0xFFFF)
    else:
        head = bytes((first, mask_bit | n))
    if frame.mask is None:
        return head + frame.payload
    return head + frame.mask + _masked(frame.payload, frame.mask)


def parse(data: bytes) -> Frame | None:
    """The frame ``data`` holds, whole (None if it is not exactly one frame: a
    handshake, a frame cut short or followed by more)."""
    if len(data) < 2:
        return None
    first, second = data[0], data[1]
    n = second & 0x7F
    at = 2
    form = "min"
    if n == 126:
        if len(data) < 4:
            return None
        n = struct.unpack("!H", data[2:4])[0]
        at, form = 4, "16" if n <= 125 else "min"
    elif n == 127:
        if len(data) < 10:
            return None
        n = struct.unpack("!Q", data[2:10])[0]
        at, form = 10, "64" if n <= 0xFFFF else "min"
    mask: bytes | None = None
    if second & 0x80:
        mask = data[at : at + 4]
        if len(mask) < 4:
            return None
        at += 4
    if len(data) - at != n:
        return None
    payload = data[at:] if mask is None else _masked(data[at:], mask)
    return Frame(first & 0x0F, payload, bool(first & 0x80), first & 0x70, mask, None, form)


def reframe(data: bytes, **changes: object) -> bytes | None:
    """The frame in ``data`` with ``changes`` to its fields, re-encoded (None if ``data``
    is not one whole frame)."""
    frame = parse(data)
    if frame is None:
        return None
    return encode(replace(frame, **changes))  # type: ignore[arg-type]


_TAIL = b"\x00\x00\xff\xff"


def deflate(message: bytes) -> bytes:
    """``message`` compressed as one ``permessage-deflate`` message: raw deflate, a sync
    flush, its 4-byte tail taken off. A fresh compressor each time, so a server keeping
    its inflater's window (client context takeover) and one not read it alike."""
    compressor = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
    out = compressor.compress(message) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return out[: -len(_TAIL)] if out.endswith(_TAIL) else out


def close_payload(code: int | None, reason: bytes = b"") -> bytes:
    """A close frame's payload: the code (none: empty) and the reason's bytes."""
    return b"" if code is None else struct.pack("!H", code) + reason
