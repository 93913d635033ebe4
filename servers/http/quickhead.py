"""The plain request head, read past h11: a GET that carries no body, and nothing else.

Most requests a server sees are a request line, a ``Host`` and a few more headers,
and no body. h11 parses each one through its receive buffer, its readers and its
state machine, and runs that machine again for the end of the message and for the
next cycle: about a fifth of a small request's CPU here. :func:`quick_head` reads
such a head itself, with h11's own grammar (the same token, field-value and
request-line rules, and the same CRLF splitting), and answers only for heads whose
meaning is beyond doubt:

- a complete head, every line ending in CRLF, with no bare CR or LF, no obs-fold,
  and no NUL or whitespace other than spaces and tabs between words;
- ``HTTP/1.1`` and an origin-form target (``/...``);
- exactly one ``Host``;
- no ``Content-Length``, ``Transfer-Encoding``, ``Expect``, ``Connection`` or
  ``Upgrade``, and not ``CONNECT``: no body, no 100-continue, no close, no switch.

Anything else (and every head that is not complete yet) is h11's, byte for byte, as
before. h11 is told of a quick request only if the exchange comes to need it (a
streamed response, say): :func:`replay` then gives a fresh h11 connection the two
state changes that parsing it would have made. A property test checks every head
this accepts against h11's own parse of the same bytes.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import h11

from .linememo import remember

__all__ = ["QuickHead", "quick_head", "replay"]

# h11's ABNF (h11/_abnf.py), restated: the quick path must accept nothing h11 would
# read differently.
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_VCHAR = rb"[^\x00\s]"
_FIELD_CONTENT = _FIELD_VCHAR + rb"+(?:[ \t]+" + _FIELD_VCHAR + rb"+)*"
_HEADER_FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*((?:" + _FIELD_CONTENT + rb")?)[ \t]*")
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") (/[\x21-\x7e]*) HTTP/1\.1")
# Headers that give a request a body, a close, an interim response or a protocol
# switch: their requests are h11's.
_NOT_PLAIN = frozenset({b"content-length", b"transfer-encoding", b"connection", b"expect", b"upgrade"})


class QuickHead(NamedTuple):
    """A plain request head, in the shape of the h11 ``Request`` it stands for."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    """``(lowercase name, value)`` pairs, ASGI's form."""
    size: int
    """Bytes of the buffer the head took, its blank line included."""
    http_version: bytes = b"1.1"


# Lines read before, and what they parse to (see .linememo): a tenth of a small
# request's Python was the grammar's regular expression on lines seen before.
_fields: dict[bytes, tuple[bytes, bytes]] = {}
_request_lines: dict[bytes, tuple[bytes, bytes]] = {}


def quick_head(buf: bytes | bytearray) -> QuickHead | None:
    """The plain head at the start of ``buf``, or None: not plain, or not complete yet
    (the caller then hands the bytes to h11)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = bytes(buf[:end]).split(b"\r\n")
    first = lines[0]
    request = _request_lines.get(first)
    if request is None:
        match = _REQUEST_LINE.fullmatch(first)
        if match is None or match[1] == b"CONNECT":
            return None
        request = (match[1], match[2])
        remember(_request_lines, first, request, len(first))
    headers: list[tuple[bytes, bytes]] = []
    fields = _fields
    hosts = 0
    for line in lines[1:]:
        field = fields.get(line)
        if field is None:
            match = _HEADER_FIELD.fullmatch(line)
            if match is None:
                return None  # a bare CR or LF, an obs-fold, or a malformed line: h11 decides
            name = match[1].lower()
            if name in _NOT_PLAIN:
                return None
            field = (name, match[2])
            remember(fields, line, field, len(line))
        hosts += field[0] == b"host"
        headers.append(field)
    if hosts != 1:
        return None
    return QuickHead(request[0], request[1], headers, end + 4)


def replay(conn: h11.Connection, head: QuickHead) -> None:
    """Put a fresh server-side ``conn`` where parsing ``head`` would have: the request
    and its (empty) body received, the response not begun."""
    request = h11.Request(
        method=head.method, target=head.target, headers=head.headers, http_version=head.http_version, _parsed=True
    )
    process = conn._process_event
    process(h11.CLIENT, request)
    process(h11.CLIENT, h11.EndOfMessage())
