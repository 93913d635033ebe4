"""WebSocket mutators in how frames are built (RFC 6455 §5): masks, lengths,
fragmentation, control frames, reserved bits and opcodes. Pure.

The ``ws_*`` mutators are drawn as faults, the ``shape_*`` ones as valid reshapings a
server must take as the same messages. Which are drawn, how often, and what a server
may answer to each: :mod:`.mutators_ws`; where a frame may go: :mod:`.ws_segments`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from .mutators_ws_messages import BAD_UTF8
from .segments import Segments, replace_segment
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
    encode,
)
from .ws_segments import (
    anywhere,
    binary_frame,
    boundaries,
    data_frames,
    fragmented,
    frames_of,
    insert_frames,
    mask_key,
    reach,
    split_frame,
)

__all__ = [
    "BAD_CLOSE_CODES",
    "MAX_SIZE",
    "RESERVED_OPCODES",
    "shape_control_between",
    "shape_fragment",
    "shape_ping",
    "shape_zero_mask",
    "ws_close_bad_code",
    "ws_close_bad_utf8",
    "ws_close_one_byte",
    "ws_continuation_first",
    "ws_control_oversized",
    "ws_fragmented_control",
    "ws_interleaved",
    "ws_length_beyond",
    "ws_length_msb",
    "ws_length_nonminimal",
    "ws_length_short",
    "ws_reserved_opcode",
    "ws_rsv_bits",
    "ws_too_big",
    "ws_unfinished",
    "ws_unmasked",
]

MAX_SIZE = 64 * 1024
"""``--ws-max-size`` of the fuzz run's HTTP server (:mod:`.targets`): a message past it is 1009."""


# -- masks ------------------------------------------------------------------------------


def ws_unmasked(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """One frame from the client without a mask (RFC 6455 §5.1: the server must close)."""
    found = frames_of(segments)
    if not found:
        return insert_frames(segments, reach(segments), replace(binary_frame(rng), mask=None))
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
        return insert_frames(segments, reach(segments), replace(binary_frame(rng), form="64"))
    i, frame = rng.choice(found)
    form = "64" if len(frame.payload) > 125 else rng.choice(("16", "64"))
    return replace_segment(segments, i, encode(replace(frame, form=form)))


def ws_length_msb(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A 64-bit length with its most significant bit set (RFC 6455 §5.2: it MUST be 0)."""
    found = data_frames(segments)
    at, frame = rng.choice(found) if found else (0, binary_frame(rng))
    lie = replace(frame, length=(1 << 63) | rng.choice((len(frame.payload), rng.getrandbits(63))), form="64")
    if not at:
        return insert_frames(segments, reach(segments), lie)
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
    frame = Frame(opcode, b"a" * size, mask=mask_key(rng))
    way = rng.randrange(3)
    if way == 0:
        frames = [frame]
    elif way == 1:
        frames = split_frame(rng, frame, rng.randint(2, 6))
    else:
        frames = [replace(frame, length=rng.randint(1 << 17, 1 << 62))]
    at = rng.choice(boundaries(segments))
    return insert_frames(segments[:at], at, *frames)


# -- fragmentation ------------------------------------------------------------------------


def ws_continuation_first(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A continuation frame where no message is open (RFC 6455 §5.4)."""
    frame = Frame(CONTINUATION, rng.randbytes(rng.randint(0, 20)), fin=rng.random() < 0.5, mask=mask_key(rng))
    return insert_frames(segments, rng.choice(boundaries(segments)), frame)


def ws_interleaved(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A new text or binary frame between the fragments of a message (RFC 6455 §5.4:
    fragments of one message are not interleaved with another's)."""
    found = fragmented(rng, segments)
    if found is None:
        return ws_continuation_first(rng, segments)
    out, first, last = found
    intruder = Frame(rng.choice((TEXT, BINARY)), b"", fin=rng.random() < 0.5, mask=mask_key(rng))
    return insert_frames(out, rng.randint(first + 1, last), intruder)


def ws_fragmented_control(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A ping, pong or close frame without FIN (RFC 6455 §5.5: control frames MUST NOT
    be fragmented), followed or not by a continuation."""
    opcode = rng.choice(CONTROL)
    payload = close_payload(1000) if opcode == CLOSE else rng.randbytes(rng.randint(0, 10))
    frames = [Frame(opcode, payload, fin=False, mask=mask_key(rng))]
    if rng.random() < 0.5:
        frames.append(Frame(CONTINUATION, b"", mask=mask_key(rng)))
    return insert_frames(segments, anywhere(rng, segments), *frames)


def ws_unfinished(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A message whose last fragment never comes: the input ends inside it."""
    found = fragmented(rng, segments)
    if found is None:
        return list(segments)
    out, first, last = found
    return out[: rng.randint(first + 1, last)]


def shape_fragment(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """One message in two to five fragments (compressed, it stays one compressed message)."""
    whole = data_frames(segments, whole=True)
    if not whole:
        return list(segments)
    i, frame = rng.choice(whole)
    out = list(segments)
    out[i : i + 1] = [encode(f) for f in split_frame(rng, frame, rng.randint(2, 5))]
    return out


def shape_control_between(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A ping or an unsolicited pong between the fragments of a message (RFC 6455 §5.4:
    control frames MAY be injected in the middle of a fragmented message)."""
    found = fragmented(rng, segments)
    if found is None:
        return list(segments)
    out, first, last = found
    frame = Frame(rng.choice((PING, PONG)), rng.randbytes(rng.randint(0, 125)), mask=mask_key(rng))
    return insert_frames(out, rng.randint(first + 1, last), frame)


def shape_ping(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A ping (to be answered) or a pong, of up to 125 bytes, anywhere among the frames."""
    frame = Frame(rng.choice((PING, PING, PONG)), rng.randbytes(rng.choice((0, 4, 125))), mask=mask_key(rng))
    return insert_frames(segments, anywhere(rng, segments), frame)


# -- control frames ------------------------------------------------------------------------


def ws_control_oversized(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A ping, pong or close of more than 125 bytes (RFC 6455 §5.5), its length in the
    16-bit or the 64-bit field."""
    opcode = rng.choice((PING, PING, PONG, CLOSE))
    size = rng.choice((126, 127, rng.randint(128, 2000)))
    payload = close_payload(1000, b"r" * (size - 2)) if opcode == CLOSE else rng.randbytes(size)
    frame = Frame(opcode, payload, mask=mask_key(rng), form=rng.choice(("min", "64")))
    return insert_frames(segments, anywhere(rng, segments), frame)


BAD_CLOSE_CODES = (0, 1, 999, 1004, 1005, 1006, 1014, 1015, 1016, 1100, 2000, 2999, 5000, 65535)
"""Close codes a peer may not send (RFC 6455 §7.4: reserved, local-only, unassigned or out of range)."""


def ws_close_bad_code(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A close frame with a code a peer may not send."""
    payload = close_payload(rng.choice(BAD_CLOSE_CODES), rng.choice((b"", b"bye")))
    return insert_frames(segments, anywhere(rng, segments), Frame(CLOSE, payload, mask=mask_key(rng)))


def ws_close_one_byte(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A close frame with a 1-byte payload (half a code)."""
    return insert_frames(segments, anywhere(rng, segments), Frame(CLOSE, rng.randbytes(1), mask=mask_key(rng)))


def ws_close_bad_utf8(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A close frame whose reason is not UTF-8 (RFC 6455 §7.1.6; close 1007)."""
    reason = rng.choice((b"", b"bye ")) + rng.choice(BAD_UTF8)
    frame = Frame(CLOSE, close_payload(rng.choice((1000, 1001, 3000)), reason), mask=mask_key(rng))
    return insert_frames(segments, anywhere(rng, segments), frame)


# -- reserved bits and opcodes ------------------------------------------------------------

RESERVED_OPCODES = (0x3, 0x4, 0x5, 0x6, 0x7, 0xB, 0xC, 0xD, 0xE, 0xF)


def ws_reserved_opcode(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A frame with a reserved opcode, new or in place of one's own."""
    opcode = rng.choice(RESERVED_OPCODES)
    found = frames_of(segments)
    if found and rng.random() < 0.5:
        i, frame = rng.choice(found)
        return replace_segment(segments, i, encode(replace(frame, opcode=opcode)))
    return insert_frames(segments, rng.choice(boundaries(segments)), replace(binary_frame(rng), opcode=opcode))


def ws_rsv_bits(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """RSV2 or RSV3 set on a frame: no extension either side agreed gives them a meaning."""
    bits = rng.choice((RSV2, RSV3, RSV2 | RSV3, RSV1 | RSV2))
    found = frames_of(segments)
    if not found:
        return insert_frames(segments, reach(segments), replace(binary_frame(rng), rsv=bits))
    i, frame = rng.choice(found)
    return replace_segment(segments, i, encode(replace(frame, rsv=frame.rsv | bits)))
