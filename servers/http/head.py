"""A parsed request head, from either parser: whether it may reach the app, and its
ASGI scope.

Both drivers read heads (h11's ``Request``, or the dense driver's
:class:`~.quickhead.QuickHead`) and ask the same questions of them here before an
:class:`~.exchange.Exchange` begins: is it refused, and if not, what scope does the
app get.
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import unquote_to_bytes

import h11

from ..ws.upgrade import names_websocket
from .asgi import ASGI_VERSION, Scope

__all__ = ["RequestHead", "bad_head_status", "head_refusal", "header_list", "make_scope", "origin_form"]


class RequestHead(Protocol):
    """A parsed request line: an ``h11.Request``, or a :class:`~.quickhead.QuickHead`."""

    @property
    def method(self) -> bytes: ...

    @property
    def target(self) -> bytes: ...

    @property
    def http_version(self) -> bytes: ...


def origin_form(target: str) -> tuple[str, str | None]:
    """``(origin-form target, authority)``: an absolute-form target
    (``http://host/path?q``, RFC 9112 §3.2.2) is routed by its path and query;
    any other target is returned as is, with no authority."""
    if target.startswith("/"):
        return target, None  # the usual case, decided without parsing
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return target, None  # asterisk-form, authority-form, or not a URI we serve
    end = len(rest)
    for delimiter in "/?#":
        found = rest.find(delimiter)
        if found != -1:
            end = min(end, found)
    authority = rest[:end].rpartition("@")[2]  # userinfo is not part of the host
    path = rest[end:].partition("#")[0]
    return (path if path.startswith("/") else "/" + path), authority


def header_list(request: h11.Request) -> list[tuple[bytes, bytes]]:
    """The request's headers as ``(lowercase name, value)`` pairs, ASGI's form."""
    items = getattr(request.headers, "_full_items", None)
    if items is None:  # pragma: no cover - another h11 layout
        return list(request.headers)
    # h11 keeps (raw name, lowercase name, value) triples; iterating its Headers goes
    # through Sequence.__getitem__ one pair at a time, several times slower.
    return [(name, value) for _, name, value in items]


def head_refusal(
    request: RequestHead,
    headers: list[tuple[bytes, bytes]],
    max_header_size: int,
    max_body_size: int,
    *,
    websockets: bool = False,
) -> tuple[int, str] | None:
    """``(status, reason)`` for a parsed head that must not reach the app, or None.

    431 for a head over the limit (h11 only bounds one still arriving; one that came
    whole in a single read is measured here), 505 for another major version, 400 for
    ambiguous framing (RFC 9112 §6.3), 413 for a declared body over the limit; for a
    WebSocket upgrade, 404 unless ``websockets`` are served, and 400 if it has a body.
    """
    size = len(request.method) + len(request.target) + 14
    length: bytes | None = None
    chunked = upgrade = False
    for name, value in headers:
        size += len(name) + len(value) + 4
        if name == b"content-length":
            length = value
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"upgrade" and names_websocket(value):
            upgrade = True
    if size > max_header_size:
        return 431, "request head too large"
    if not request.http_version.startswith(b"1."):
        # h11 parses any "HTTP/d.d" as if it were 1.1; another major version is
        # another protocol, whose framing we cannot assume (RFC 9110 §15.6.6).
        return 505, f"HTTP/{request.http_version.decode()}"
    if length is not None and chunked:
        # h11 lets chunked win, as RFC 9112 §6.3 allows; but a front end that went
        # by Content-Length would see a different request boundary (smuggling), so
        # the request is refused and its connection closed instead.
        return 400, "Content-Length with Transfer-Encoding"
    if length is not None and length.isdigit() and int(length) > max_body_size:
        return 413, "declared request body too large"
    if upgrade:
        if not websockets:
            return 404, "WebSocket is not served"
        if chunked or (length is not None and length != b"0"):
            return 400, "a WebSocket upgrade request with a body"
    return None


def bad_head_status(exc: h11.RemoteProtocolError) -> int:
    """The answer to a head h11 could not parse."""
    status = exc.error_status_hint
    if status == 501 and "Transfer-Encoding" in str(exc):
        # h11 answers 501 for any coding but a lone "chunked", before we can see the
        # header. When chunked is not last, RFC 9112 §6.3 requires 400, and 400 (rather
        # than 501) is also fine for "gzip, chunked": either way the body's length is
        # unknown and the connection closes.
        return 400
    return status


def make_scope(
    request: RequestHead,
    headers: list[tuple[bytes, bytes]],
    *,
    scheme: str,
    client: tuple[str, int] | None,
    server: tuple[str, int] | None,
    state: dict[str, Any] | None,
) -> Scope:
    """The ASGI ``http`` scope of a parsed request head."""
    target = request.target.decode("latin-1")
    if not target.startswith("/"):
        target, authority = origin_form(target)
        if authority:
            # RFC 9112 §3.2.2: with an absolute-form target the Host header is
            # ignored and the target's authority stands in for it.
            headers = [(k, authority.encode("latin-1") if k == b"host" else v) for k, v in headers]
    raw_path, _, query = target.encode("latin-1").partition(b"?")
    scope: Scope = {
        "type": "http",
        "asgi": ASGI_VERSION,
        "http_version": request.http_version.decode("latin-1"),
        "method": request.method.decode("latin-1"),
        "scheme": scheme,
        "path": unquote_to_bytes(raw_path).decode("utf-8", "replace") if b"%" in raw_path else raw_path.decode(),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": server,
    }
    if state is not None:
        scope["state"] = dict(state)
    return scope
