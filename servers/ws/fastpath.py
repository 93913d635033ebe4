"""The common case of an open WebSocket's traffic, without wsproto's frame machinery.

Most frames a server reads are whole, unfragmented, masked data frames of a few bytes
(an echo, a chat line, a sensor reading), and most it writes are whole messages.
wsproto parses each through a generator, a buffer and a message decoder, which was a
third of the CPU of an echo server here (``py-spy``); these read and write exactly
that case in a few lines, and leave everything else to wsproto:

- :func:`read_whole_frames` takes frames from the front of the bytes read for as long
  as each is complete, final, masked, with no RSV bit, text or binary, its length in
  the shortest form and within ``max_size``, and (text) valid UTF-8. At the first that
  is not, it stops, at a frame boundary, and the caller hands wsproto the rest, so
  every error and every control frame gets wsproto's answer.
- :func:`frame_message` writes a message as one unmasked final frame, as a server's
  must be (RFC 6455 §5.1, §5.2).

Only for a connection with no extension (no permessage-deflate, whose frames carry
RSV1 and a compressed payload), and only while wsproto holds nothing of a frame or a
message (see :func:`wsproto_idle`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["frame_message", "read_whole_frames", "wsproto_idle"]

_TEXT = 0x81  # FIN | text
_BINARY = 0x82  # FIN | binary
_MASKED = 0x80


def _unmask(payload: bytes, mask: bytes) -> bytes:
    n = len(payload)
    if not n:
        return b""
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


def read_whole_frames(data: bytes, max_size: int, out: list[str | bytes]) -> int:
    """Append the messages of the whole plain data frames at the front of ``data`` to
    ``out``; how many bytes they took (0: the first is not one, or is not all there)."""
    pos, n = 0, len(data)
    while pos + 6 <= n:
        first, second = data[pos], data[pos + 1]
        if (first != _TEXT and first != _BINARY) or not second & _MASKED:
            break
        length = second & 0x7F
        head = pos + 2
        if length == 126:
            if head + 2 > n:
                break
            length = int.from_bytes(data[head : head + 2], "big")
            if length < 126:
                break  # not the shortest form: wsproto's to refuse
            head += 2
        elif length == 127:
            break  # 64 KiB or more: rare, and wsproto's
        end = head + 4 + length
        if end > n or length > max_size:
            break
        payload = _unmask(data[head + 4 : end], data[head : head + 4])
        if first == _TEXT:
            try:
                out.append(payload.decode("utf-8"))
            except UnicodeDecodeError:
                break  # wsproto closes it with 1007
        else:
            out.append(payload)
        pos = end
    return pos


def frame_message(message: str | bytes) -> bytes:
    """``message`` as one final, unmasked frame: text for ``str``, binary for ``bytes``."""
    if isinstance(message, str):
        payload, first = message.encode("utf-8"), _TEXT
    else:
        payload, first = bytes(message), _BINARY
    n = len(payload)
    if n < 126:
        return bytes((first, n)) + payload
    if n < 65536:
        return bytes((first, 126)) + n.to_bytes(2, "big") + payload
    return bytes((first, 127)) + n.to_bytes(8, "big") + payload


def wsproto_idle(connection: Any) -> bool:
    """Whether wsproto's frame layer holds nothing: no bytes of a frame, no header read,
    no message begun. Reads its internals (wsproto 1.2, 1.3); anything unexpected
    there answers False, and wsproto then reads everything, as before."""
    try:
        proto = connection._proto
        decoder = proto._frame_decoder
        return (
            not proto.extensions
            and decoder.header is None
            and len(decoder.buffer) == 0
            and proto._message_decoder.opcode is None
        )
    except AttributeError:
        return False
