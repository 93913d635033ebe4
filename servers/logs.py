"""Log lines a hostile client cannot inflate: what it sent is cut to a sane length,
and a refusal it repeats is logged once per client per spell, then only counted.

A client id may be 65,535 bytes on the wire and a client may be refused a thousand
times a second; a log line per refusal, quoting the whole id, would let one client
write gigabytes of log. The counters (``/metrics``) carry the totals.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

__all__ = ["LOG_SPELL", "OncePer", "shown"]

SHOWN = 64
"""Characters of a client-supplied string quoted in a log line."""
LOG_SPELL = 600.0
"""Seconds before the same refusal of the same client is logged again."""


def shown(text: str | None, limit: int = SHOWN) -> str:
    """``text`` quoted for a log line: ``repr`` (so controls show), cut to ``limit``
    characters with its full length said."""
    if text is None:
        return "None"
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


class OncePer:
    """Whether a key's event is worth a log line now: once per ``spell`` seconds, for
    at most ``keys`` keys remembered (the oldest forgotten first), on the caller's clock."""

    __slots__ = ("spell", "keys", "_last")

    def __init__(self, spell: float = LOG_SPELL, keys: int = 10_000) -> None:
        self.spell = spell
        self.keys = keys
        self._last: collections.OrderedDict[Hashable, float] = collections.OrderedDict()

    def due(self, key: Hashable, now: float) -> bool:
        """Whether to log ``key``'s event at ``now`` (and, if so, note that it was)."""
        last = self._last.get(key)
        if last is not None and now - last < self.spell:
            return False
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self.keys:
            self._last.popitem(last=False)
        return True
