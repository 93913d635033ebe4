"""The ``Date`` header's value (RFC 9110 §6.6.1), which an origin server sends with
every response, its own refusals included: formatted once a second, not per response."""

from __future__ import annotations

import email.utils
import time

__all__ = ["http_date"]

_second = 0
_value = b""


def http_date() -> bytes:
    """The ``Date`` header's value for now (an IMF-fixdate, as ``email.utils`` writes it)."""
    global _second, _value
    now = int(time.time())
    if now != _second:
        _second = now
        _value = email.utils.formatdate(now, usegmt=True).encode()
    return _value
