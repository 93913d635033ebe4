"""Values as Redis gives them back (bytes, mostly) made Python ones: text, bytes, stream ids."""

from __future__ import annotations

from typing import Any

__all__ = ["as_bytes", "stream_id", "text"]


def text(value: Any) -> str:
    """A reply's value as text (the client answers bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def as_bytes(value: str | bytes) -> bytes:
    """A reply's value as bytes."""
    return value if isinstance(value, bytes) else value.encode()


def stream_id(raw: bytes | str) -> tuple[int, int]:
    """A stream entry's id (``<ms>-<seq>``) as a pair that orders as Redis orders them."""
    value = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)
