"""MQTT 5.0's data types on the wire (§1.5), read and written. Pure.

Every reader takes ``(src, pos, end)`` and returns ``(value, new_pos)``; one that
would read past ``end`` raises a Malformed Packet (0x81), as does a UTF-8 string that
is not well-formed or holds U+0000 (§1.5.4).
"""

from __future__ import annotations

import struct

from ..encoders import U16, encode_remaining_length
from .reason_codes import malformed

__all__ = [
    "pack_binary",
    "pack_string",
    "pack_varint",
    "read_binary",
    "read_string",
    "read_u8",
    "read_u16",
    "read_u32",
    "read_varint",
]

_U32 = struct.Struct("!I")
MAX_VARINT = 268_435_455


def read_u8(src: bytes, pos: int, end: int) -> tuple[int, int]:
    """One byte."""
    if pos >= end:
        raise malformed("a byte past the end")
    return src[pos], pos + 1


def read_u16(src: bytes, pos: int, end: int) -> tuple[int, int]:
    """A two-byte integer, big-endian."""
    if pos + 2 > end:
        raise malformed("a two-byte integer past the end")
    return (src[pos] << 8) | src[pos + 1], pos + 2


def read_u32(src: bytes, pos: int, end: int) -> tuple[int, int]:
    """A four-byte integer, big-endian."""
    if pos + 4 > end:
        raise malformed("a four-byte integer past the end")
    return _U32.unpack_from(src, pos)[0], pos + 4


def read_varint(src: bytes, pos: int, end: int) -> tuple[int, int]:
    """A variable byte integer: 1 to 4 bytes, 7 bits each, least significant first.
    A fifth byte, or a longer encoding than the value needs, is malformed (§1.5.5)."""
    value = 0
    for i in range(4):
        if pos >= end:
            raise malformed("a variable byte integer past the end")
        byte = src[pos]
        pos += 1
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if i and not byte:
                raise malformed("a variable byte integer longer than its value needs")
            return value, pos
    raise malformed("a variable byte integer of more than four bytes")


def read_binary(src: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """Binary data: a two-byte length, then that many bytes."""
    length, pos = read_u16(src, pos, end)
    stop = pos + length
    if stop > end:
        raise malformed("binary data past the end")
    return bytes(src[pos:stop]), stop


def read_string(src: bytes, pos: int, end: int) -> tuple[str, int]:
    """A UTF-8 encoded string: well-formed, no surrogates, no U+0000."""
    raw, pos = read_binary(src, pos, end)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise malformed(f"not well-formed UTF-8: {raw[:32]!r}") from None
    if "\x00" in text:
        raise malformed("U+0000 in a UTF-8 string")
    return text, pos


def pack_varint(n: int) -> bytes:
    """A variable byte integer (ValueError outside 0..268,435,455)."""
    return encode_remaining_length(n)


def pack_binary(raw: bytes) -> bytes:
    """Binary data (ValueError over 65,535 bytes)."""
    if len(raw) > 0xFFFF:
        raise ValueError(f"field of {len(raw)} bytes; MQTT allows at most 65535")
    return U16.pack(len(raw)) + raw


def pack_string(text: str) -> bytes:
    """A UTF-8 encoded string."""
    return pack_binary(text.encode("utf-8"))
