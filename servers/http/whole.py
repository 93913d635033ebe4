"""A whole response (head and body in one ASGI message) written without h11's
per-event cost, h11's state machine told as if it had written it.

h11 validates and re-normalizes a response's headers twice and runs its state
machine three times (head, body, end), about 30 µs of a small request's 150 here.
For the common case (a complete response with a length we set, to an HTTP/1.1
client that keeps the connection) the bytes are simple: this writes them itself
after a strict check of every header, and gives h11 the two state changes it
needs (so that ``start_next_cycle`` and its view of keep-alive stay right). Any
other case, or an h11 without the hooks used, returns None and the caller takes
h11's public path.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import h11

from .linememo import remember

__all__ = ["HOOKS", "whole_bytes", "whole_response"]

# RFC 9110 §5.1 token, and §5.5 field-value without obs-fold: no CR, LF or NUL, no
# leading or trailing whitespace. Anything else goes to h11, which refuses it.
_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-z]+")
_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?)?")
# Headers h11 rewrites or acts on: left to it.
_FRAMING = frozenset({b"transfer-encoding", b"connection"})


def _hooks_present() -> bool:
    try:
        h11.Response(status_code=200, headers=[], _parsed=True)
    except TypeError:
        return False
    conn = h11.Connection(h11.SERVER)
    return callable(getattr(conn, "_process_event", None)) and hasattr(getattr(conn, "_cstate", None), "keep_alive")


HOOKS = _hooks_present()
"""Whether this h11 has the private hooks used here (and by :mod:`.quickhead`'s replay)."""


# Header lines written before (see .linememo), keyed by the app's own (name, value)
# pair: a look-up stands in for checking and formatting each one. Lengths and dates,
# which change, are never kept, nor long lines (an app may echo what a client sent).
_lines: dict[tuple[bytes, bytes], bytes] = {}
_status_lines: dict[tuple[int, bytes], bytes] = {}


def whole_bytes(
    status: int,
    reason: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes,
    *,
    send_body: bool,
    date: bytes | None = None,
    keep: list[tuple[bytes, bytes]] | None = None,
) -> bytes | None:
    """The bytes of a complete keep-alive HTTP/1.1 response with ``Content-Length:
    len(body)`` (and the body unless ``send_body`` is false: HEAD), or None if h11
    must write it.

    ``headers`` are the app's, as ASGI sends them: names already lowercase (any
    other name is h11's to judge). A ``Content-Length`` among them must be the
    body's; ``Transfer-Encoding`` or ``Connection`` leave the response to h11.
    ``date`` is added as the ``Date`` header unless the app sent one. ``keep``, if
    given, is filled with the headers the response carries.
    """
    if status < 200 or status in (204, 304) or status > 999:
        return None
    length = b"%d" % len(body)
    first = _status_lines.get((status, reason))
    if first is None:
        first = _status_lines[status, reason] = b"HTTP/1.1 %d %s\r\n" % (status, reason)
    parts = [first]
    lines = _lines
    declared = False
    for pair in headers:
        try:
            line = lines.get(pair)
        except TypeError:  # a list, or a bytearray in it: h11's
            return None
        if line is None:
            name, value = pair
            if name == b"content-length":
                if value != length or declared:
                    return None  # h11 refuses a body that does not match
                declared = True
                pair = (b"content-length", length)
                line = b"content-length: %s\r\n" % length
            else:
                if name.__class__ is not bytes or value.__class__ is not bytes or name in _FRAMING:
                    return None
                if not _NAME.fullmatch(name) or not _VALUE.fullmatch(value):
                    return None
                line = b"%s: %s\r\n" % (name, value)
                if name == b"date":
                    date = None
                elif pair.__class__ is tuple:
                    remember(lines, pair, line, len(line))
        parts.append(line)
        if keep is not None:
            keep.append(pair)
    if not declared:
        parts.append(b"content-length: %s\r\n" % length)
        if keep is not None:
            keep.append((b"content-length", length))
    if date is not None:
        parts.append(b"date: %s\r\n" % date)
        if keep is not None:
            keep.append((b"date", date))
    parts.append(b"\r\n")
    if send_body:
        parts.append(body)
    return b"".join(parts)


def whole_response(
    conn: h11.Connection,
    status: int,
    reason: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes,
    *,
    send_body: bool,
    date: bytes | None = None,
) -> bytes | None:
    """:func:`whole_bytes` for a request h11 read: None also when the connection is not
    ready for such a response (a request that is not HTTP/1.1, or asked to close: h11
    adds the header). On success h11's state is as after ``send(Response)``,
    ``send(Data)`` and ``send(EndOfMessage())``.
    """
    if not HOOKS or conn.our_state is not h11.SEND_RESPONSE or conn.their_http_version != b"1.1":
        return None
    if not conn._cstate.keep_alive:
        return None  # the client said close: h11 adds the header
    kept: list[tuple[bytes, bytes]] = []
    out = whole_bytes(status, reason, headers, body, send_body=send_body, date=date, keep=kept)
    if out is None:
        return None
    event = h11.Response(status_code=status, headers=kept, reason=reason, _parsed=True)
    process = conn._process_event
    process(h11.SERVER, event)
    process(h11.SERVER, h11.EndOfMessage())
    return out
