"""Values every online device holds alike, kept as one object per value.

A keep-alive above 256 is an int object of its own (32 bytes) and a receive window a
float (24 bytes), each held by a device for as long as it is online; a fleet uses a
handful of values. Each table here keeps at most 1,024 of them: past that, a value
is its own object, as before, and nothing grows without bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["keep_alive", "silence_allowed"]

_K = TypeVar("_K")
_V = TypeVar("_V")

_KEPT = 1024


def _shared(table: dict[_K, _V], key: _K, make: Callable[[_K], _V]) -> _V:
    value = table.get(key)
    if value is None:
        value = make(key)
        if len(table) < _KEPT:
            table[key] = value
    return value


_KEEP_ALIVES: dict[int, int] = {}
_SILENCES: dict[int, float] = {}


def keep_alive(seconds: int) -> int:
    """``seconds``, as the one int object every CONNECT with that keep-alive shares."""
    return _shared(_KEEP_ALIVES, seconds, int)


def silence_allowed(keep_alive_seconds: int) -> float:
    """1.5 × the keep-alive (MQTT-3.1.2-24), one float per keep-alive value: the
    receive timeout a device holds while online."""
    return _shared(_SILENCES, keep_alive_seconds, _one_and_a_half)


def _one_and_a_half(seconds: int) -> float:
    return 1.5 * seconds
