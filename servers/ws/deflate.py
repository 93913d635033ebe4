"""``permessage-deflate`` (RFC 7692) with its memory bounded: wsproto's extension,
with a ceiling on what one message may inflate to and small compressor state.

wsproto inflates each frame in one ``decompress`` call with no output limit, so a
client can send a few kilobytes that inflate to gigabytes before the server sees
the message's size (a decompression bomb). Here every call is given the bytes left
of the message's ``max_size``, and a message that would inflate past it ends the
connection with 1009 (Message Too Big) having inflated no more than the limit.

What a connection holds between messages: the server answers
``server_no_context_takeover`` (always allowed, RFC 7692 §7.1.1.1), so its
compressor lives only while it sends a message; it compresses with a 4 KiB window
and ``memLevel`` 5 (about 32 KiB while it lives, where zlib's defaults take 256
KiB), which any client's decompressor reads. The client's context, when it keeps
one, is its window (at most 32 KiB), and is kept only from its first compressed
message on.
"""

from __future__ import annotations

import zlib

from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason, FrameDecoder, FrameProtocol, Opcode, RsvBits

__all__ = ["COMPRESS_WINDOW_BITS", "BoundedDeflate"]

COMPRESS_WINDOW_BITS = 12
"""The server's compression window (4 KiB): smaller than the 32 KiB default, and
readable by any inflater."""
_MEM_LEVEL = 5

_TAIL = b"\x00\x00\xff\xff"


class BoundedDeflate(PerMessageDeflate):
    """wsproto's ``permessage-deflate``, refusing a message that inflates past
    ``max_size`` bytes (close 1009) and keeping no compressor between messages."""

    def __init__(self, *, max_size: int) -> None:
        super().__init__(server_no_context_takeover=True)
        self.max_size = max_size
        self._inflated = 0
        self._control = False  # a control frame is being read, inside a message or not
        self._open = False  # a message's first frame has come, its last not yet

    def frame_inbound_header(
        self, proto: FrameDecoder | FrameProtocol, opcode: Opcode, rsv: RsvBits, payload_length: int
    ) -> CloseReason | RsvBits:
        if opcode.iscontrol():
            # wsproto's extension forgets a compressed message open across a ping
            # between its fragments; a control frame is never compressed, so it is
            # passed by without touching the message's state.
            if rsv.rsv1:
                return CloseReason.PROTOCOL_ERROR
            self._control = True
            return RsvBits(True, False, False)
        if opcode is not Opcode.CONTINUATION:
            # wsproto asks again when a header it began came in two reads: whether a
            # message is open is known from frames completed, not headers seen.
            if self._open:
                # A new message while one is open (RFC 6455 §5.4): a protocol error,
                # which the inflater must not turn into a bad payload first.
                return CloseReason.PROTOCOL_ERROR
            self._inflated = 0  # a new message
        return super().frame_inbound_header(proto, opcode, rsv, payload_length)

    def _inflate(self, data: bytes) -> bytes | CloseReason:
        inflater = self._decompressor
        assert inflater is not None
        room = self.max_size - self._inflated
        try:
            # One byte past the room: inflating that much proves the message too big.
            out = inflater.decompress(data, room + 1)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self._inflated += len(out)
        if self._inflated > self.max_size or inflater.unconsumed_tail:
            return CloseReason.MESSAGE_TOO_BIG
        return out

    def frame_inbound_payload_data(self, proto: FrameDecoder | FrameProtocol, data: bytes) -> bytes | CloseReason:
        if self._control or not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        return self._inflate(bytes(data))

    def frame_inbound_complete(self, proto: FrameDecoder | FrameProtocol, fin: bool) -> bytes | CloseReason | None:
        if self._control:
            self._control = False
            return None
        self._open = not fin
        if not fin or not self._inbound_is_compressible or not self._inbound_compressed:
            return super().frame_inbound_complete(proto, fin)
        out = self._inflate(_TAIL)
        if isinstance(out, CloseReason):
            return out
        if self.client_no_context_takeover:
            self._decompressor = None
        self._inbound_compressed = None
        return out

    def frame_outbound(
        self, proto: FrameDecoder | FrameProtocol, opcode: Opcode, rsv: RsvBits, data: bytes, fin: bool
    ) -> tuple[RsvBits, bytes]:
        if self._compressor is None and opcode in (Opcode.TEXT, Opcode.BINARY):
            # Never a longer window than the client allowed (RFC 7692 §7.1.2.1).
            bits = min(COMPRESS_WINDOW_BITS, self.server_max_window_bits)
            self._compressor = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -bits, _MEM_LEVEL)
        return super().frame_outbound(proto, opcode, rsv, data, fin)
