"""WebSocket mutators in what messages carry: text that is not UTF-8 (RFC 6455 §8.1),
compressed messages (RFC 7692), and, for MQTT over WebSockets, a text frame where
binary ones go. Pure.

The ``ws_*`` mutators are drawn as faults, :func:`shape_utf8_split` as a valid
reshaping a server must take as the same message. Which are drawn, how often, and
what a server may answer to each: :mod:`.mutators_ws`; where a frame may go:
:mod:`.ws_segments`.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import replace

from .segments import Segments, replace_segment
from .ws_frames import BINARY, CLOSE, CONTINUATION, CONTROL, RSV1, TEXT, Frame, close_payload, deflate, encode
from .ws_segments import anywhere, boundaries, data_frames, insert_frames, mask_key, split_frame

__all__ = [
    "BAD_UTF8",
    "shape_utf8_split",
    "ws_deflate",
    "ws_deflate_bomb",
    "ws_deflate_corrupt",
    "ws_rsv1_continuation",
    "ws_rsv1_control",
    "ws_text_bad_utf8",
    "ws_text_frame",
    "ws_utf8_split_invalid",
]

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
    return insert_frames(segments, rng.choice(boundaries(segments)), Frame(TEXT, payload, mask=mask_key(rng)))


def _split_char(rng: random.Random, bad: bool) -> list[Frame]:
    text = "fuzz é ✓ 𝄞 end".encode()
    if bad:
        # A lead byte ends one fragment; what starts the next does not continue it.
        head = text[:5] + rng.choice((b"\xe2\x82", b"\xf0\x9d", b"\xc3"))
        tail = rng.choice((b"A", b"\xc3\xa9", b"\xff")) + text[5:]
    else:
        cut = rng.choice([k for k in range(1, len(text)) if text[k] & 0xC0 == 0x80])  # inside a character
        head, tail = text[:cut], text[cut:]
    return [Frame(TEXT, head, fin=False, mask=mask_key(rng)), Frame(CONTINUATION, tail, mask=mask_key(rng))]


def ws_utf8_split_invalid(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A text message in two fragments, the first ending in a character's lead byte the
    second does not continue (the fault is only seen across the fragments)."""
    return insert_frames(segments, rng.choice(boundaries(segments)), *_split_char(rng, bad=True))


def shape_utf8_split(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A text message in two fragments cut inside a multi-byte character (valid: UTF-8
    is checked over the whole message)."""
    return insert_frames(segments, rng.choice(boundaries(segments)), *_split_char(rng, bad=False))


# -- compression (RFC 7692) ---------------------------------------------------------------


def _compressed(rng: random.Random, segments: Sequence[bytes], payload: bytes) -> Segments:
    """``payload`` (already compressed) as a new message with RSV1, whole or fragmented."""
    frame = Frame(rng.choice((BINARY, TEXT)), payload, rsv=RSV1, mask=mask_key(rng))
    frames = [frame] if rng.random() < 0.7 else split_frame(rng, frame, rng.randint(2, 3))
    return insert_frames(segments, rng.choice(boundaries(segments)), *frames)


def ws_deflate(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A message compressed (RSV1): valid where ``permessage-deflate`` was agreed, a
    protocol error where it was not."""
    whole = [(i, f) for i, f in data_frames(segments, whole=True) if not f.rsv]
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
    frame = Frame(BINARY, deflate(b"fuzz " * 30), rsv=RSV1, mask=mask_key(rng))
    frames = split_frame(rng, frame, rng.randint(2, 3))
    k = rng.randrange(1, len(frames))
    frames[k] = replace(frames[k], rsv=RSV1)
    return insert_frames(segments, rng.choice(boundaries(segments)), *frames)


def ws_rsv1_control(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """RSV1 on a ping, pong or close (RFC 7692 §6.1: control frames are never compressed)."""
    opcode = rng.choice(CONTROL)
    payload = close_payload(1000) if opcode == CLOSE else b"ping"
    return insert_frames(segments, anywhere(rng, segments), Frame(opcode, payload, rsv=RSV1, mask=mask_key(rng)))


# -- MQTT over WebSockets -----------------------------------------------------------------


def ws_text_frame(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A text frame where MQTT goes in binary ones (MQTT-6.0.0-1: close; 1003, the
    RFC's code for a type of data the endpoint cannot take)."""
    found = data_frames(segments, whole=True)
    if found and rng.random() < 0.5:
        i, frame = rng.choice(found)
        try:
            frame.payload.decode()
        except UnicodeDecodeError:
            frame = replace(frame, payload=b"mqtt in a text frame")
        return replace_segment(segments, i, encode(replace(frame, opcode=TEXT)))
    text = rng.choice((b"", b"hello", "é ✓".encode(), b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"))
    return insert_frames(segments, rng.choice(boundaries(segments)), Frame(TEXT, text, mask=mask_key(rng)))
