"""Mutators for a WebSocket fuzz input, where segment 0 is the opening handshake and
every other segment one frame (:mod:`.ws_frames`). Pure.

Two families:

- **faults** (:data:`WS_FAULTS`, :data:`MQTT_WS_FAULTS`): each breaks RFC 6455 (or
  RFC 7692, or MQTT over WebSockets) in one way, and says what a server may answer
  to it: the close code the RFC gives the fault (1002 protocol error, 1007 invalid
  payload, 1009 too big, 1003 a text frame on MQTT), the HTTP status for a handshake
  it must refuse, :data:`SERVED` for what is no fault at all (a compressed message
  where compression was agreed; a length beyond the data, which leaves the server
  waiting), or :data:`ANY` for blind byte-level damage, whose answer cannot be told
  in advance (only that it is a clear one);
- **shapes** (:data:`WS_SHAPES`): valid reshapings (fragments, control frames
  between them, a zero mask key, a character split across fragments) that a server
  must take as the same messages.

A case gets a few shapes, then one fault (:mod:`.corpus_ws`), so the fault decides
the answer; the faults insert a frame only where a message may start, or within a
message where the fault is to be there, and stop the input where it must end.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .mutators import GENERIC
from .segments import Mutator, Segments, replace_segment
from .ws_frames import (
    BINARY,
    CLOSE,
    CONTINUATION,
    CONTROL,
    PING,
    PONG,
    RSV1,
    RSV2,
    RSV3,
    TEXT,
    Frame,
    close_payload,
    deflate,
    encode,
    parse,
)

__all__ = [
    "ALLOWED_ORIGIN",
    "ANY",
    "BAD_UTF8",
    "MAX_SIZE",
    "MQTT_WS_FAULTS",
    "MQTT_WS_SHAPES",
    "SERVED",
    "WS_FAULTS",
    "WS_SHAPES",
    "WsFault",
    "boundaries",
    "frames_of",
    "reach",
]

SERVED = "served"
"""An outcome token: what a valid input gets (the end the case asked for)."""
ANY = "any"
"""An outcome token: any clear answer (a close frame, an HTTP status below 500, the end)."""

MAX_SIZE = 64 * 1024
"""``--ws-max-size`` of the fuzz run's HTTP server (:mod:`.targets`): a message past it is 1009."""

BAD_UTF8 = (
    b"\xff",
    b"\xc0\x80",  # an overlong NUL
    b"\xed\xa0\x80",  # a surrogate
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\xe2\x28\xa1",  # a lead byte followed by no continuation
    b"\x80",  # a continuation byte alone
    b"\xf8\x88\x80\x80\x80",  # a 5-byte form
)
"""Byte sequences that are not UTF-8, in any position."""


@dataclass(frozen=True)
class WsFault:
    """A fault mutator, how often it is drawn, and what a server may answer to it."""

    weight: float
    mutator: Mutator
    outcomes: tuple[str, ...]
    """``close-<code>``, ``http-<status>``, :data:`SERVED` or :data:`ANY`."""
    unnegotiated: tuple[str, ...] | None = None
    """The outcomes when ``permessage-deflate`` was not agreed, where they differ
    (a compressed frame is then a protocol error, whatever is in it)."""

    def expected(self, negotiated: bool) -> tuple[str, ...]:
        """The outcomes with compression agreed or not."""
        return self.outcomes if negotiated or self.unnegotiated is None else self.unnegotiated


# -- where the frames are -----------------------------------------------------------------


def reach(segments: Sequence[bytes]) -> int:
    """How far a server reads: the index of the client's first close frame (nothing
    after it counts), else the number of segments."""
    for i, s in enumerate(segments[1:], 1):
        frame = parse(s)
        if frame is not None and frame.opcode == CLOSE:
            return i
    return len(segments)


def frames_of(segments: Sequence[bytes]) -> list[tuple[int, Frame]]:
    """Every segment after the handshake that is one whole frame, up to the client's
    first close (included), with its index."""
    out = []
    for i, s in enumerate(segments[1 : reach(segments) + 1], 1):
        frame = parse(s)
        if frame is not None:
            out.append((i, frame))
    return out


def boundaries(segments: Sequence[bytes]) -> list[int]:
    """Indices (1 up to the client's first close, or the end) before which a new message
    may start: no fragmented message is open there."""
    out = [1]
    open_message = False
    for i, s in enumerate(segments[1 : reach(segments)], 1):
        frame = parse(s)
        if frame is None:
            break  # past a frame that does not parse, nothing is sure
        if frame.opcode not in CONTROL:
            open_message = not frame.fin
        if not open_message:
            out.append(i + 1)
    return out


def _anywhere(rng: random.Random, segments: Sequence[bytes]) -> int:
    """An index a control frame may go before, the server reading it (before the close)."""
    return rng.randint(1, reach(segments))


def _data_frames(segments: Sequence[bytes], whole: bool = False) -> list[tuple[int, Frame]]:
    """Data frames (text, binary, continuation); ``whole``: only unfragmented messages."""
    found = [(i, f) for i, f in frames_of(segments) if f.opcode not in CONTROL]
    if whole:
        found = [(i, f) for i, f in found if f.fin and f.opcode != CONTINUATION]
    return found


def _key(rng: random.Random) -> bytes:
    return rng.randbytes(4)


def _insert(segments: Sequence[bytes], at: int, *frames: Frame) -> Segments:
    out = list(segments)
    out[at:at] = [encode(f) for f in frames]
    return out


def _binary(rng: random.Random, size: int = 0) -> Frame:
    return Frame(BINARY, rng.randbytes(size or rng.randint(0, 40)), mask=_key(rng))


def _split_frame(rng: random.Random, frame: Frame, parts: int) -> list[Frame]:
    """A whole message's frame as ``parts`` fragments (the first keeps its opcode and
    RSV1, the others are continuations); an empty payload gives empty fragments."""
    data = frame.payload
    cuts = sorted(rng.sample(range(1, len(data)), min(parts - 1, len(data) - 1))) if len(data) > 1 else []
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    while len(pieces) < parts:
        pieces.append(b"")
    out = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        opcode = frame.opcode if k == 0 else CONTINUATION
        out.append(Frame(opcode, piece, fin=last, rsv=frame.rsv if k == 0 else 0, mask=_key(rng)))
    return out


def _fragmented(rng: random.Random, segments: Sequence[bytes]) -> tuple[Segments, int, int] | None:
    """The segments with one message in two or more fragments (made so if none is):
    the segments, its first fragment's index and its last's; None without data frames."""
    out = list(segments)
    found = _data_frames(out)
    starts = [i for i, f in found if f.opcode != CONTINUATION and not f.fin]
    if starts:
        first = rng.choice(starts)
    else:
        whole = _data_frames(out, whole=True)
        if not whole:
            return None
        first, frame = rng.choice(whole)
        out[first : first + 1] = [encode(f) for f in _split_frame(rng, frame, rng.randint(2, 4))]
    last = first
    for i, f in frames_of(out):
        if i > first and f.opcode not in CONTROL:
            last = i
            if f.fin:
                break
    return out, first, last


# -- masks ------------------------------------------------------------------------------


def ws_unmasked(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """One frame from the client without a mask (RFC 6455 §5.1: the server must close)."""
    found = frames_of(segments)
    if not found:
        return _insert(segments, reach(segments), replace(_binary(rng), mask=None))
    i, frame = rng.choice(found)
    return replace_segment(segments, i, encode(replace(frame, mask=None)))


def shape_zero_mask(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A frame masked with the key 0 (valid: the payload goes as it is)."""
    found = frames_of(segments)
    if not found:
        return list(segments)
    i, frame = rng.choice(found)
    return replace_segment(segments, i, encode(replace(frame, mask=b"\x00\x00\x00\x00")))


# -- lengths -----------------------------------------------------------------------------


def ws_length_nonminimal(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A length in more bytes than it needs: up to 125 in the 16-bit or 64-bit field, up
    to 65,535 in the 64-bit one (RFC 6455 §5.2: the minimal number of bytes MUST be used)."""
    found = frames_of(segments)
    if not found:
        return _insert(segments, reach(segments), replace(_binary(rng), form="64"))
    i, frame = rng.choice(found)
    form = "64" if len(frame.payload) > 125 else rng.choice(("16", "64"))
    return replace_segment(segments, i, encode(replace(frame, form=form)))


def ws_length_msb(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A 64-bit length with its most significant bit set (RFC 6455 §5.2: it MUST be 0)."""
    found = _data_frames(segments)
    at, frame = rng.choice(found) if found else (0, _binary(rng))
    lie = replace(frame, length=(1 << 63) | rng.choice((len(frame.payload), rng.getrandbits(63))), form="64")
    if not at:
        return _insert(segments, reach(segments), lie)
    return replace_segment(segments, at, encode(lie))


def ws_length_beyond(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A frame declaring more payload than comes, a few bytes more or up to 2^62 (the
    64-bit field), and nothing after it: the server waits for the rest, bounded by its
    deadlines (or, past ``--ws-max-size``, by the size)."""
    found = frames_of(segments)
    if not found:
        return list(segments)
    i, frame = rng.choice(found)
    n = len(frame.payload)
    if frame.opcode in CONTROL:
        declared = rng.randint(n + 1, 125) if n < 125 else 125
        if declared <= n:
            return list(segments)
    else:
        declared = rng.choice((n + rng.randint(1, 8), n + rng.randint(9, 4000), rng.randint(1 << 16, 1 << 62)))
    return [*segments[:i], encode(replace(frame, length=declared))]


def ws_length_short(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A frame declaring less payload than it carries: the rest is read as the next
    frame's header, whatever it holds."""
    found = [(i, f) for i, f in frames_of(segments) if f.payload]
    if not found:
        return list(segments)
    i, frame = rng.choice(found)
    return replace_segment(segments, i, encode(replace(frame, length=rng.randrange(len(frame.payload)))))


def ws_too_big(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A message past :data:`MAX_SIZE`: in one frame, in fragments each under it, or
    in a frame declaring up to 2^62 bytes of which just past the limit come."""
    size = MAX_SIZE + rng.randint(1, 4096)
    opcode = rng.choice((BINARY, TEXT))
    frame = Frame(opcode, b"a" * size, mask=_key(rng))
    way = rng.randrange(3)
    if way == 0:
        frames = [frame]
    elif way == 1:
        frames = _split_frame(rng, frame, rng.randint(2, 6))
    else:
        frames = [replace(frame, length=rng.randint(1 << 17, 1 << 62))]
    at = rng.choice(boundaries(segments))
    return _insert(segments[:at], at, *frames)


# -- fragmentation ------------------------------------------------------------------------


def ws_continuation_first(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A continuation frame where no message is open (RFC 6455 §5.4)."""
    frame = Frame(CONTINUATION, rng.randbytes(rng.randint(0, 20)), fin=rng.random() < 0.5, mask=_key(rng))
    return _insert(segments, rng.choice(boundaries(segments)), frame)


def ws_interleaved(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A new text or binary frame between the fragments of a message (RFC 6455 §5.4:
    fragments of one message are not interleaved with another's)."""
    found = _fragmented(rng, segments)
    if found is None:
        return ws_continuation_first(rng, segments)
    out, first, last = found
    intruder = Frame(rng.choice((TEXT, BINARY)), b"", fin=rng.random() < 0.5, mask=_key(rng))
    return _insert(out, rng.randint(first + 1, last), intruder)


def ws_fragmented_control(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A ping, pong or close frame without FIN (RFC 6455 §5.5: control frames MUST NOT
    be fragmented), followed or not by a continuation."""
    opcode = rng.choice(CONTROL)
    payload = close_payload(1000) if opcode == CLOSE else rng.randbytes(rng.randint(0, 10))
    frames = [Frame(opcode, payload, fin=False, mask=_key(rng))]
    if rng.random() < 0.5:
        frames.append(Frame(CONTINUATION, b"", mask=_key(rng)))
    return _insert(segments, _anywhere(rng, segments), *frames)


def ws_unfinished(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A message whose last fragment never comes: the input ends inside it."""
    found = _fragmented(rng, segments)
    if found is None:
        return list(segments)
    out, first, last = found
    return out[: rng.randint(first + 1, last)]


def shape_fragment(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """One message in two to five fragments (compressed, it stays one compressed message)."""
    whole = _data_frames(segments, whole=True)
    if not whole:
        return list(segments)
    i, frame = rng.choice(whole)
    out = list(segments)
    out[i : i + 1] = [encode(f) for f in _split_frame(rng, frame, rng.randint(2, 5))]
    return out


def shape_control_between(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A ping or an unsolicited pong between the fragments of a message (RFC 6455 §5.4:
    control frames MAY be injected in the middle of a fragmented message)."""
    found = _fragmented(rng, segments)
    if found is None:
        return list(segments)
    out, first, last = found
    frame = Frame(rng.choice((PING, PONG)), rng.randbytes(rng.randint(0, 125)), mask=_key(rng))
    return _insert(out, rng.randint(first + 1, last), frame)


def shape_ping(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A ping (to be answered) or a pong, of up to 125 bytes, anywhere among the frames."""
    frame = Frame(rng.choice((PING, PING, PONG)), rng.randbytes(rng.choice((0, 4, 125))), mask=_key(rng))
    return _insert(segments, _anywhere(rng, segments), frame)


# -- control frames ------------------------------------------------------------------------


def ws_control_oversized(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A ping, pong or close of more than 125 bytes (RFC 6455 §5.5), its length in the
    16-bit or the 64-bit field."""
    opcode = rng.choice((PING, PING, PONG, CLOSE))
    size = rng.choice((126, 127, rng.randint(128, 2000)))
    payload = close_payload(1000, b"r" * (size - 2)) if opcode == CLOSE else rng.randbytes(size)
    frame = Frame(opcode, payload, mask=_key(rng), form=rng.choice(("min", "64")))
    return _insert(segments, _anywhere(rng, segments), frame)


BAD_CLOSE_CODES = (0, 1, 999, 1004, 1005, 1006, 1014, 1015, 1016, 1100, 2000, 2999, 5000, 65535)
"""Close codes a peer may not send (RFC 6455 §7.4: reserved, local-only, unassigned or out of range)."""


def ws_close_bad_code(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A close frame with a code a peer may not send."""
    payload = close_payload(rng.choice(BAD_CLOSE_CODES), rng.choice((b"", b"bye")))
    return _insert(segments, _anywhere(rng, segments), Frame(CLOSE, payload, mask=_key(rng)))


def ws_close_one_byte(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A close frame with a 1-byte payload (half a code)."""
    return _insert(segments, _anywhere(rng, segments), Frame(CLOSE, rng.randbytes(1), mask=_key(rng)))


def ws_close_bad_utf8(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A close frame whose reason is not UTF-8 (RFC 6455 §7.1.6; close 1007)."""
    reason = rng.choice((b"", b"bye ")) + rng.choice(BAD_UTF8)
    frame = Frame(CLOSE, close_payload(rng.choice((1000, 1001, 3000)), reason), mask=_key(rng))
    return _insert(segments, _anywhere(rng, segments), frame)


# -- reserved bits and opcodes ------------------------------------------------------------

RESERVED_OPCODES = (0x3, 0x4, 0x5, 0x6, 0x7, 0xB, 0xC, 0xD, 0xE, 0xF)


def ws_reserved_opcode(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A frame with a reserved opcode, new or in place of one's own."""
    opcode = rng.choice(RESERVED_OPCODES)
    found = frames_of(segments)
    if found and rng.random() < 0.5:
        i, frame = rng.choice(found)
        return replace_segment(segments, i, encode(replace(frame, opcode=opcode)))
    return _insert(segments, rng.choice(boundaries(segments)), replace(_binary(rng), opcode=opcode))


def ws_rsv_bits(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """RSV2 or RSV3 set on a frame: no extension either side agreed gives them a meaning."""
    bits = rng.choice((RSV2, RSV3, RSV2 | RSV3, RSV1 | RSV2))
    found = frames_of(segments)
    if not found:
        return _insert(segments, reach(segments), replace(_binary(rng), rsv=bits))
    i, frame = rng.choice(found)
    return replace_segment(segments, i, encode(replace(frame, rsv=frame.rsv | bits)))


# -- UTF-8 ---------------------------------------------------------------------------------


def ws_text_bad_utf8(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A text message that is not UTF-8: a bad sequence at its start, inside it, or a
    character cut off at its end (RFC 6455 §8.1; close 1007)."""
    bad = rng.choice(BAD_UTF8)
    text = "fuzz é ✓ 𝄞".encode()
    where = rng.randrange(3)
    if where == 0:
        payload = bad + text
    elif where == 1:
        payload = text[:5] + bad + text[5:]
    else:
        payload = text + "✓".encode()[: rng.randint(1, 2)]
    return _insert(segments, rng.choice(boundaries(segments)), Frame(TEXT, payload, mask=_key(rng)))


def _split_char(rng: random.Random, bad: bool) -> list[Frame]:
    text = "fuzz é ✓ 𝄞 end".encode()
    if bad:
        # A lead byte ends one fragment; what starts the next does not continue it.
        head = text[:5] + rng.choice((b"\xe2\x82", b"\xf0\x9d", b"\xc3"))
        tail = rng.choice((b"A", b"\xc3\xa9", b"\xff")) + text[5:]
    else:
        cut = rng.choice([k for k in range(1, len(text)) if text[k] & 0xC0 == 0x80])  # inside a character
        head, tail = text[:cut], text[cut:]
    return [Frame(TEXT, head, fin=False, mask=_key(rng)), Frame(CONTINUATION, tail, mask=_key(rng))]


def ws_utf8_split_invalid(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A text message in two fragments, the first ending in a character's lead byte the
    second does not continue (the fault is only seen across the fragments)."""
    return _insert(segments, rng.choice(boundaries(segments)), *_split_char(rng, bad=True))


def shape_utf8_split(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A text message in two fragments cut inside a multi-byte character (valid: UTF-8
    is checked over the whole message)."""
    return _insert(segments, rng.choice(boundaries(segments)), *_split_char(rng, bad=False))


# -- compression (RFC 7692) ---------------------------------------------------------------


def _compressed(rng: random.Random, segments: Sequence[bytes], payload: bytes) -> Segments:
    """``payload`` (already compressed) as a new message with RSV1, whole or fragmented."""
    frame = Frame(rng.choice((BINARY, TEXT)), payload, rsv=RSV1, mask=_key(rng))
    frames = [frame] if rng.random() < 0.7 else _split_frame(rng, frame, rng.randint(2, 3))
    return _insert(segments, rng.choice(boundaries(segments)), *frames)


def ws_deflate(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A message compressed (RSV1): valid where ``permessage-deflate`` was agreed, a
    protocol error where it was not."""
    whole = [(i, f) for i, f in _data_frames(segments, whole=True) if not f.rsv]
    if whole and rng.random() < 0.6:
        i, frame = rng.choice(whole)
        return replace_segment(segments, i, encode(replace(frame, payload=deflate(frame.payload), rsv=RSV1)))
    return _compressed(rng, segments, deflate(b"fuzz " * rng.randint(1, 50)))


def ws_deflate_corrupt(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A compressed message that does not inflate: a reserved block type, a stored
    block whose length and its complement disagree, or good data then such a block
    (close 1007 where compression was agreed)."""
    corrupt = rng.choice(
        (
            b"\x07" + rng.randbytes(rng.randint(0, 20)),  # BFINAL, BTYPE 11: reserved
            b"\x00\x05\x00\x00\x00hello",  # a stored block, LEN 5, NLEN 0
            deflate(b"fuzz " * rng.randint(1, 20)) + b"\x07\xff\xff",
        )
    )
    return _compressed(rng, segments, corrupt)


@functools.lru_cache(maxsize=8)
def _bomb(size: int) -> bytes:
    return deflate(b"\x00" * size)


def ws_deflate_bomb(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A few kilobytes that inflate to 1 to 16 MiB of zeros (close 1009 past
    ``--ws-max-size`` where compression was agreed; no more than the limit may be inflated)."""
    return _compressed(rng, segments, _bomb(rng.choice((1, 4, 16)) << 20))


def ws_rsv1_continuation(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """RSV1 on a continuation frame (RFC 7692 §6.1: only a message's first frame has it)."""
    frame = Frame(BINARY, deflate(b"fuzz " * 30), rsv=RSV1, mask=_key(rng))
    frames = _split_frame(rng, frame, rng.randint(2, 3))
    k = rng.randrange(1, len(frames))
    frames[k] = replace(frames[k], rsv=RSV1)
    return _insert(segments, rng.choice(boundaries(segments)), *frames)


def ws_rsv1_control(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """RSV1 on a ping, pong or close (RFC 7692 §6.1: control frames are never compressed)."""
    opcode = rng.choice(CONTROL)
    payload = close_payload(1000) if opcode == CLOSE else b"ping"
    return _insert(segments, _anywhere(rng, segments), Frame(opcode, payload, rsv=RSV1, mask=_key(rng)))


# -- MQTT over WebSockets -----------------------------------------------------------------


def ws_text_frame(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A text frame where MQTT goes in binary ones (MQTT-6.0.0-1: close; 1003, the
    RFC's code for a type of data the endpoint cannot take)."""
    found = _data_frames(segments, whole=True)
    if found and rng.random() < 0.5:
        i, frame = rng.choice(found)
        try:
            frame.payload.decode()
        except UnicodeDecodeError:
            frame = replace(frame, payload=b"mqtt in a text frame")
        return replace_segment(segments, i, encode(replace(frame, opcode=TEXT)))
    text = rng.choice((b"", b"hello", "é ✓".encode(), b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"))
    return _insert(segments, rng.choice(boundaries(segments)), Frame(TEXT, text, mask=_key(rng)))


# -- the opening handshake -----------------------------------------------------------------

_HEADER = re.compile(rb"(?im)^([A-Za-z-]+):[ \t]*([^\r\n]*)\r\n")


def _header(handshake: bytes, name: bytes) -> re.Match[bytes] | None:
    for m in _HEADER.finditer(handshake):
        if m.group(1).lower() == name:
            return m
    return None


def _without(handshake: bytes, name: bytes) -> bytes:
    m = _header(handshake, name)
    return handshake if m is None else handshake[: m.start()] + handshake[m.end() :]


def _with(handshake: bytes, line: bytes) -> bytes:
    """``line`` added as the handshake's last header."""
    return handshake[:-2] + line + b"\r\n\r\n"


def _set(handshake: bytes, name: bytes, line: bytes) -> bytes:
    return _with(_without(handshake, name), line)


def _handshake(segments: Sequence[bytes], change: bytes) -> Segments:
    out = list(segments)
    out[0] = change
    return out


def hs_key(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """``Sec-WebSocket-Key`` missing, not base64, not 16 bytes once decoded, or twice
    (RFC 6455 §4.2.1: the server MUST refuse; 400)."""
    hs = segments[0]
    bad = rng.choice((b"", b"abc", b"not base64!!", b"dGhlIHNhbXBsZQ==", b"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"))
    way = rng.randrange(3)
    if way == 0:
        return _handshake(segments, _without(hs, b"sec-websocket-key"))
    if way == 1:
        return _handshake(segments, _set(hs, b"sec-websocket-key", b"Sec-WebSocket-Key: " + bad))
    return _handshake(segments, _with(hs, b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="))


def hs_version(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """``Sec-WebSocket-Version`` other than 13, or missing (426 with the version spoken,
    or 400)."""
    version = rng.choice((b"8", b"12", b"14", b"13, 8", b"", None))
    hs = _without(segments[0], b"sec-websocket-version")
    return _handshake(segments, hs if version is None else _with(hs, b"Sec-WebSocket-Version: " + version))


def hs_connection(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """``Connection`` without the ``upgrade`` token, or missing (400)."""
    value = rng.choice((b"keep-alive", b"close", b"upgrades", None))
    hs = _without(segments[0], b"connection")
    return _handshake(segments, hs if value is None else _with(hs, b"Connection: " + value))


def hs_upgrade(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """``Upgrade`` missing or not ``websocket``: no WebSocket asked for (an HTTP server
    serves the request as a plain one; a WebSocket-only listener refuses it)."""
    value = rng.choice((b"h2c", b"websockets", None))
    hs = _without(segments[0], b"upgrade")
    return _handshake(segments, hs if value is None else _with(hs, b"Upgrade: " + value))


def hs_method(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Another method than GET, or HTTP/1.0 (RFC 6455 §4.1: GET, HTTP/1.1 or later; 400)."""
    hs = segments[0]
    line_end = hs.index(b"\r\n")
    method, target, version = hs[:line_end].split(b" ", 2)
    if rng.random() < 0.5:
        method = rng.choice((b"POST", b"PUT", b"HEAD", b"OPTIONS"))
        hs = _with(hs, b"Content-Length: 0") if method in (b"POST", b"PUT") else hs
    else:
        version = b"HTTP/1.0"
    return _handshake(segments, b" ".join((method, target, version)) + hs[line_end:])


def hs_host(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """No ``Host`` (HTTP/1.1 requires one; 400)."""
    return _handshake(segments, _without(segments[0], b"host"))


def hs_path(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Another path than the listener's (404)."""
    hs = segments[0]
    line_end = hs.index(b"\r\n")
    method, _, version = hs[:line_end].split(b" ", 2)
    target = rng.choice((b"/", b"/mqt", b"/mqtt/", b"/MQTT", b"/ws", b"/mqtt%00"))
    return _handshake(segments, b" ".join((method, target, version)) + hs[line_end:])


def hs_subprotocol(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """No subprotocol the listener speaks offered (MQTT-6.0.0-3; 400)."""
    value = rng.choice((b"mqttv5", b"MQTT", b"wamp, chat", b"", None))
    hs = _without(segments[0], b"sec-websocket-protocol")
    return _handshake(segments, hs if value is None else _with(hs, b"Sec-WebSocket-Protocol: " + value))


ALLOWED_ORIGIN = b"http://allowed.fuzz"
"""The one browser origin the fuzz run's MQTT listener lets in (``--ws-allowed-origins``)."""


def hs_origin(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A browser page from an origin not on the allow-list (cross-site WebSocket
    hijacking; 403)."""
    origin = rng.choice((b"http://evil.fuzz", b"null", ALLOWED_ORIGIN + b".evil", b"https://allowed.fuzz"))
    return _handshake(segments, _set(segments[0], b"origin", b"Origin: " + origin))


# -- the registries ------------------------------------------------------------------------

_1002 = ("close-1002",)

WS_FAULTS: dict[str, WsFault] = {
    "unmasked": WsFault(2.0, ws_unmasked, _1002),
    "length-nonminimal": WsFault(2.0, ws_length_nonminimal, _1002),
    "length-64-msb": WsFault(1.5, ws_length_msb, _1002),
    "length-beyond-data": WsFault(2.0, ws_length_beyond, (SERVED,)),
    "too-big": WsFault(1.0, ws_too_big, ("close-1009",)),
    "continuation-first": WsFault(2.0, ws_continuation_first, _1002),
    "interleaved-data": WsFault(2.0, ws_interleaved, _1002),
    "fragmented-control": WsFault(2.0, ws_fragmented_control, _1002),
    "unfinished-message": WsFault(1.0, ws_unfinished, (SERVED,)),
    "control-oversized": WsFault(2.0, ws_control_oversized, _1002),
    "close-bad-code": WsFault(2.0, ws_close_bad_code, _1002),
    "close-1-byte": WsFault(1.5, ws_close_one_byte, _1002),
    "close-bad-utf8": WsFault(1.5, ws_close_bad_utf8, ("close-1007",)),
    "reserved-opcode": WsFault(2.0, ws_reserved_opcode, _1002),
    "rsv-bits": WsFault(2.0, ws_rsv_bits, _1002),
    "text-bad-utf8": WsFault(2.0, ws_text_bad_utf8, ("close-1007",)),
    "utf8-split-invalid": WsFault(1.5, ws_utf8_split_invalid, ("close-1007",)),
    "deflate": WsFault(2.0, ws_deflate, (SERVED,), unnegotiated=_1002),
    "deflate-corrupt": WsFault(1.5, ws_deflate_corrupt, ("close-1007",), unnegotiated=_1002),
    "deflate-bomb": WsFault(1.0, ws_deflate_bomb, ("close-1009",), unnegotiated=_1002),
    "rsv1-continuation": WsFault(1.0, ws_rsv1_continuation, _1002),
    "rsv1-control": WsFault(1.0, ws_rsv1_control, _1002),
    "length-short": WsFault(1.0, ws_length_short, (ANY,)),
    "hs-key": WsFault(1.0, hs_key, ("http-400",)),
    "hs-version": WsFault(0.7, hs_version, ("http-426", "http-400")),
    "hs-connection": WsFault(0.7, hs_connection, ("http-400",)),
    "hs-upgrade": WsFault(0.5, hs_upgrade, ("http-200",)),  # a plain GET: the app answers it
    "hs-method": WsFault(0.7, hs_method, ("http-400",)),
    "hs-host": WsFault(0.4, hs_host, ("http-400",)),
    **{name: WsFault(weight / 3, mutator, (ANY,)) for name, (weight, mutator) in GENERIC.items()},
}
"""Every fault a WebSocket input to an ASGI echo app may get, by name."""

_MQTT_ONLY = {
    "text-frame": WsFault(2.0, ws_text_frame, ("close-1003",)),
    "hs-path": WsFault(0.7, hs_path, ("http-404",)),
    "hs-subprotocol": WsFault(0.7, hs_subprotocol, ("http-400",)),
    "hs-origin": WsFault(0.7, hs_origin, ("http-403",)),
}

MQTT_WS_FAULTS: dict[str, WsFault] = {
    **{name: fault for name, fault in WS_FAULTS.items() if name != "too-big"},  # MQTT bounds packets, not frames
    # A text message is refused as text (1003) as soon as its first bytes come, or as
    # invalid UTF-8 (1007) if that shows first.
    "text-bad-utf8": WsFault(2.0, ws_text_bad_utf8, ("close-1007", "close-1003")),
    "utf8-split-invalid": WsFault(1.5, ws_utf8_split_invalid, ("close-1007", "close-1003")),
    # Never negotiated there: a compressed frame is always a protocol error.
    "deflate": WsFault(2.0, ws_deflate, _1002),
    "deflate-corrupt": WsFault(1.5, ws_deflate_corrupt, _1002),
    "deflate-bomb": WsFault(1.0, ws_deflate_bomb, _1002),
    "hs-upgrade": WsFault(0.5, hs_upgrade, ("http-400",)),  # a WebSocket-only listener
    **_MQTT_ONLY,
}
"""Every fault an MQTT-over-WebSocket input may get, by name."""

WS_SHAPES: dict[str, tuple[float, Mutator]] = {
    "fragment": (3.0, shape_fragment),
    "control-between-fragments": (2.0, shape_control_between),
    "ping": (1.5, shape_ping),
    "zero-mask": (1.0, shape_zero_mask),
    "utf8-split-valid": (1.5, shape_utf8_split),
}
"""Valid reshapings of a WebSocket input, by name: (weight, mutator)."""

MQTT_WS_SHAPES = {name: entry for name, entry in WS_SHAPES.items() if name != "utf8-split-valid"}
"""The same for MQTT over WebSockets, where any text frame is a fault."""
