"""Mutators for any protocol's fuzz input: byte-level ones inside one segment (bit flips,
interesting bytes, insertions, deletions, junk) and segment-level ones (truncate,
duplicate, reorder, drop). Pure.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .segments import Segments, pick_segment, replace_segment

__all__ = [
    "INTERESTING",
    "bit_flip",
    "byte_set",
    "delete",
    "drop",
    "duplicate",
    "extend",
    "insert",
    "random_bytes",
    "reorder",
    "truncate",
]

INTERESTING = (0x00, 0x01, 0x02, 0x0A, 0x0D, 0x20, 0x3A, 0x7F, 0x80, 0xC0, 0xFE, 0xFF)
"""Bytes that sit on boundaries parsers care about: NUL, CR/LF, space, colon, the
varint continuation bit, UTF-8 lead bytes, the top of a byte."""


def bit_flip(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Flip 1 to 4 distinct bits of one segment."""
    i = pick_segment(rng, segments)
    if i < 0:
        return list(segments)
    data = bytearray(segments[i])
    for bit in rng.sample(range(len(data) * 8), min(rng.randint(1, 4), len(data) * 8)):
        data[bit // 8] ^= 1 << (bit % 8)
    return replace_segment(segments, i, bytes(data))


def byte_set(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Set 1 to 4 bytes of one segment to an :data:`INTERESTING` or a random value."""
    i = pick_segment(rng, segments)
    if i < 0:
        return list(segments)
    data = bytearray(segments[i])
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.choice(INTERESTING) if rng.random() < 0.6 else rng.randrange(256)
    return replace_segment(segments, i, bytes(data))


def truncate(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Cut the whole input short, anywhere from its first byte to one before its last."""
    total = sum(len(s) for s in segments)
    if total < 2:
        return list(segments)
    cut = rng.randrange(1, total)
    out: Segments = []
    for s in segments:
        if cut <= 0:
            break
        out.append(s[:cut])
        cut -= len(s)
    return out


def extend(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Append 1 to 64 random bytes to one segment (trailing junk inside or after a packet)."""
    i = pick_segment(rng, segments)
    if i < 0:
        return [rng.randbytes(rng.randint(1, 64))]
    return replace_segment(segments, i, segments[i] + rng.randbytes(rng.randint(1, 64)))


def insert(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Insert 1 to 16 bytes (random or interesting) somewhere in one segment."""
    i = pick_segment(rng, segments)
    if i < 0:
        return list(segments)
    data = segments[i]
    at = rng.randrange(len(data) + 1)
    junk = bytes(rng.choice(INTERESTING) for _ in range(rng.randint(1, 4))) if rng.random() < 0.4 else b""
    junk += rng.randbytes(rng.randint(0 if junk else 1, 12))
    return replace_segment(segments, i, data[:at] + junk + data[at:])


def delete(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Delete 1 to 8 consecutive bytes from one segment."""
    i = pick_segment(rng, segments)
    if i < 0:
        return list(segments)
    data = segments[i]
    at = rng.randrange(len(data))
    return replace_segment(segments, i, data[:at] + data[at + rng.randint(1, 8) :])


def random_bytes(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Throw the input away: 1 to 512 random bytes, sometimes behind a plausible first byte."""
    junk = rng.randbytes(rng.randint(1, 512))
    if segments and segments[0] and rng.random() < 0.3:
        junk = segments[0][:1] + junk
    return [junk]


def duplicate(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Send one segment twice (a second CONNECT, a repeated request), right after itself or at the end."""
    if not segments:
        return []
    i = rng.randrange(len(segments))
    out = list(segments)
    out.insert(i + 1 if rng.random() < 0.5 else len(out), segments[i])
    return out


def reorder(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Swap two segments, or shuffle them all (CONNECT no longer first, say)."""
    out = list(segments)
    if len(out) < 2:
        return out
    if rng.random() < 0.5:
        a, b = rng.sample(range(len(out)), 2)
        out[a], out[b] = out[b], out[a]
    else:
        rng.shuffle(out)
    return out


def drop(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Leave one segment out (the CONNECT, a request's head...)."""
    out = list(segments)
    if len(out) < 2:
        return out
    del out[rng.randrange(len(out))]
    return out
