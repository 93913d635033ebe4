"""The bounded memos of header lines, shared by the plain-head reader
(:mod:`.quickhead`) and the whole-response writer (:mod:`.whole`).

A client sends the same few lines on every request (Host, User-Agent, Accept...) and
an app the same few headers on every response, so each side keeps what a line came
to: a look-up stands in for the grammar's regular expressions. Only lines of at most
:data:`LINE_BYTES` are kept and a memo is emptied when it holds :data:`LINES`, so a
peer sending endless new lines costs each memo at most ``LINES x LINE_BYTES`` and
slows nobody but itself.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["LINES", "LINE_BYTES", "remember"]

LINES = 1024
"""Entries a memo holds before it is emptied."""
LINE_BYTES = 256
"""The longest line a memo keeps."""

_K = TypeVar("_K")
_V = TypeVar("_V")


def remember(memo: dict[_K, _V], key: _K, value: _V, size: int) -> None:
    """Keep ``key -> value`` in ``memo`` if the line (``size`` bytes) is short enough,
    emptying the memo first when it is full."""
    if size <= LINE_BYTES:
        if len(memo) >= LINES:
            memo.clear()
        memo[key] = value
