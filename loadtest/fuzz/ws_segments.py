"""Where the frames of a WebSocket fuzz input are, and the small frame builders its
mutators share (:mod:`.mutators_ws_framing`, :mod:`.mutators_ws_messages`). Pure.

Segment 0 is the opening handshake and every other segment one frame
(:mod:`.ws_frames`). A server reads up to the client's first close frame, so only
the frames before it count; a new message may start only where no fragmented one is
open (:func:`boundaries`), while a control frame may go anywhere (:func:`anywhere`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .segments import Segments
from .ws_frames import BINARY, CLOSE, CONTINUATION, CONTROL, Frame, encode, parse

__all__ = [
    "anywhere",
    "binary_frame",
    "boundaries",
    "data_frames",
    "fragmented",
    "frames_of",
    "insert_frames",
    "mask_key",
    "reach",
    "split_frame",
]


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


def anywhere(rng: random.Random, segments: Sequence[bytes]) -> int:
    """An index a control frame may go before, the server reading it (before the close)."""
    return rng.randint(1, reach(segments))


def data_frames(segments: Sequence[bytes], whole: bool = False) -> list[tuple[int, Frame]]:
    """Data frames (text, binary, continuation); ``whole``: only unfragmented messages."""
    found = [(i, f) for i, f in frames_of(segments) if f.opcode not in CONTROL]
    if whole:
        found = [(i, f) for i, f in found if f.fin and f.opcode != CONTINUATION]
    return found


def mask_key(rng: random.Random) -> bytes:
    """A random masking key, as a client draws one for every frame."""
    return rng.randbytes(4)


def insert_frames(segments: Sequence[bytes], at: int, *frames: Frame) -> Segments:
    """A copy of ``segments`` with ``frames`` encoded and inserted before index ``at``."""
    out = list(segments)
    out[at:at] = [encode(f) for f in frames]
    return out


def binary_frame(rng: random.Random, size: int = 0) -> Frame:
    """A masked binary frame of ``size`` random bytes (0: up to 40)."""
    return Frame(BINARY, rng.randbytes(size or rng.randint(0, 40)), mask=mask_key(rng))


def split_frame(rng: random.Random, frame: Frame, parts: int) -> list[Frame]:
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
        out.append(Frame(opcode, piece, fin=last, rsv=frame.rsv if k == 0 else 0, mask=mask_key(rng)))
    return out


def fragmented(rng: random.Random, segments: Sequence[bytes]) -> tuple[Segments, int, int] | None:
    """The segments with one message in two or more fragments (made so if none is):
    the segments, its first fragment's index and its last's; None without data frames."""
    out = list(segments)
    found = data_frames(out)
    starts = [i for i, f in found if f.opcode != CONTINUATION and not f.fin]
    if starts:
        first = rng.choice(starts)
    else:
        whole = data_frames(out, whole=True)
        if not whole:
            return None
        first, frame = rng.choice(whole)
        out[first : first + 1] = [encode(f) for f in split_frame(rng, frame, rng.randint(2, 4))]
    last = first
    for i, f in frames_of(out):
        if i > first and f.opcode not in CONTROL:
            last = i
            if f.fin:
                break
    return out, first, last
