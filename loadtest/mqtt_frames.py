"""Framing the MQTT packets a server sends out of a receive buffer, in place."""

from __future__ import annotations

__all__ = ["frames"]


def frames(buf: bytearray | bytes) -> tuple[list[tuple[int, int, int]], int]:
    """The whole packets at the start of ``buf``: (first byte, body start, body end) each,
    and how many bytes they take. Offsets rather than copies: the subscriber reads
    tens of thousands of packets a second straight out of its buffer."""
    out: list[tuple[int, int, int]] = []
    i = 0
    n = len(buf)
    while i + 2 <= n:
        length = 0
        shift = 0
        j = i + 1
        while True:
            if j >= n:
                return out, i
            byte = buf[j]
            j += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 21:
                raise ValueError("malformed remaining length")
        end = j + length
        if end > n:
            break
        out.append((buf[i], j, end))
        i = end
    return out, i
