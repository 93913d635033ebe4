"""What a fuzz input is between the corpus and the mutators, and what a mutator is. Pure.

An input is a list of *segments*: the MQTT packets or the HTTP requests it is made
of, in the order they go on the wire. Keeping the boundaries lets a mutator lie
about one packet's length, duplicate or reorder whole packets, or rewrite one
request's ``Content-Length``; byte-level mutators work inside one segment, so
several can be stacked and still leave the others intact.

Every mutator takes a ``random.Random`` and the segments and returns new segments
(never changing its argument), so a case is a pure function of its seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

__all__ = ["Mutator", "Segments", "pick_segment", "replace_segment"]

Segments = list[bytes]
"""An input as the packets (MQTT) or requests (HTTP) it is made of."""
Mutator = Callable[[random.Random, Sequence[bytes]], Segments]
"""``mutator(rng, segments) -> new segments``."""


def pick_segment(rng: random.Random, segments: Sequence[bytes]) -> int:
    """Index of a non-empty segment (-1 if every one is empty)."""
    candidates = [i for i, s in enumerate(segments) if s]
    return rng.choice(candidates) if candidates else -1


def replace_segment(segments: Sequence[bytes], i: int, new: bytes) -> Segments:
    """A copy of ``segments`` with segment ``i`` replaced by ``new``."""
    out = list(segments)
    out[i] = new
    return out
