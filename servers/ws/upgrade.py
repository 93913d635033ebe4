"""The WebSocket opening handshake of an HTTP server (RFC 6455 §4.2), on a request
head another parser has read.

``servers.http`` reads every request head with h11 (or its quick parser), so the
upgrade request is already parsed when it is seen to be one; wsproto's own
handshake would parse it again from the raw bytes. Here, pure functions: whether a
head asks for a WebSocket, whether the request is a valid one (and the answer if
not), the ``101`` that accepts it with the app's subprotocol and headers, and the
``permessage-deflate`` offer taken (RFC 7692), bounded by :mod:`.deflate`.
"""

from __future__ import annotations

import base64
import binascii
import http
from collections.abc import Iterable
from dataclasses import dataclass

from wsproto.utilities import generate_accept_token

from ..httpdate import http_date
from .deflate import BoundedDeflate

__all__ = [
    "Offer",
    "Refused",
    "accept_head",
    "denial_head",
    "is_upgrade",
    "names_websocket",
    "read_offer",
    "subprotocols_of",
]

Headers = Iterable[tuple[bytes, bytes]]


def _tokens(value: bytes) -> list[bytes]:
    return [token.strip().lower() for token in value.split(b",")]


def names_websocket(upgrade: bytes) -> bool:
    """Whether an ``Upgrade`` header's value names WebSocket (among other protocols, maybe)."""
    return b"websocket" in _tokens(upgrade)


def is_upgrade(headers: Headers) -> bool:
    """Whether a request head asks to switch to WebSocket (``Upgrade: websocket``)."""
    return any(name == b"upgrade" and names_websocket(value) for name, value in headers)


@dataclass(frozen=True, slots=True)
class Offer:
    """A valid opening handshake: what the client offered."""

    key: bytes
    """``Sec-WebSocket-Key``, answered in ``Sec-WebSocket-Accept``."""
    subprotocols: list[str]
    """``Sec-WebSocket-Protocol``, in the client's order (the ASGI scope's ``subprotocols``)."""
    extensions: list[bytes]
    """``Sec-WebSocket-Extensions`` offers, one per comma-separated item."""


def subprotocols_of(headers: Headers) -> list[str]:
    """The subprotocols a handshake offers, in its order."""
    found: list[str] = []
    for name, value in headers:
        if name == b"sec-websocket-protocol":
            found.extend(token.strip().decode("latin-1") for token in value.split(b",") if token.strip())
    return found


Refused = tuple[int, str, list[tuple[bytes, bytes]]]
"""A handshake turned down: the status, the reason to log, and headers to answer with."""


def read_offer(method: bytes, http_version: bytes, headers: Headers) -> Offer | Refused:
    """The :class:`Offer` of a valid upgrade request, else ``(status, reason,
    headers)`` to answer: 426 with the version spoken for another
    ``Sec-WebSocket-Version`` (RFC 6455 §4.4), 400 for the rest."""
    headers = list(headers)
    if method != b"GET" or http_version != b"1.1":
        return 400, f"a WebSocket opens with GET over HTTP/1.1, not {method[:16]!r} HTTP/{http_version[:8]!r}", []
    connection = [t for name, value in headers if name == b"connection" for t in _tokens(value)]
    if b"upgrade" not in connection:
        return 400, "Upgrade: websocket without Connection: upgrade", []
    versions = [value.strip() for name, value in headers if name == b"sec-websocket-version"]
    if versions != [b"13"]:
        said = b", ".join(versions)[:32].decode("latin-1") or "none"
        return 426, f"Sec-WebSocket-Version {said} (spoken: 13)", [(b"sec-websocket-version", b"13")]
    keys = [value.strip() for name, value in headers if name == b"sec-websocket-key"]
    if len(keys) != 1 or not _valid_key(keys[0]):
        return 400, "missing or malformed Sec-WebSocket-Key", []
    extensions = [
        item.strip() for name, value in headers if name == b"sec-websocket-extensions" for item in value.split(b",")
    ]
    return Offer(keys[0], subprotocols_of(headers), [e for e in extensions if e])


def _valid_key(key: bytes) -> bool:
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except (binascii.Error, ValueError):
        return False


def take_deflate(offer: Offer, *, max_size: int) -> tuple[BoundedDeflate, bytes] | None:
    """The ``permessage-deflate`` extension for the first offer of it that can be
    taken, and the ``Sec-WebSocket-Extensions`` value that accepts it; None if
    none can."""
    for item in offer.extensions:
        name, _, _ = item.partition(b";")
        if name.strip().lower() != b"permessage-deflate":
            continue
        if not _valid_deflate_offer(item):
            continue  # RFC 7692 §7: decline it, and try the client's next offer
        extension = BoundedDeflate(max_size=max_size)
        try:
            answer = extension.accept(item.decode("latin-1"))
        except (ValueError, IndexError):
            continue
        if isinstance(answer, str):
            return extension, b"; ".join([b"permessage-deflate"] + ([answer.encode("latin-1")] if answer else []))
    return None


_FLAGS = frozenset({b"server_no_context_takeover", b"client_no_context_takeover"})


def _valid_deflate_offer(item: bytes) -> bool:
    """Whether a ``permessage-deflate`` offer is one RFC 7692 §7 lets a server take:
    known parameters, each once, the flags without a value, window bits 9-15 (8 is
    declined: zlib cannot compress within a 256-byte window)."""
    seen: set[bytes] = set()
    for param in item.split(b";")[1:]:
        name, eq, value = (part.strip() for part in param.partition(b"="))
        name = name.lower()
        if name in seen:
            return False
        seen.add(name)
        if name in _FLAGS:
            if eq:
                return False
        elif name in (b"server_max_window_bits", b"client_max_window_bits"):
            value = value.strip(b'"')
            if not eq and name == b"client_max_window_bits":
                continue  # the client lets the server choose
            if not value.isdigit() or not 9 <= int(value) <= 15:
                return False
        else:
            return False
    return True


def accept_head(
    offer: Offer,
    *,
    subprotocol: str | None,
    headers: Iterable[tuple[bytes, bytes]] = (),
    extension: bytes | None = None,
) -> bytes:
    """The ``101 Switching Protocols`` that accepts ``offer``, with the app's
    ``subprotocol`` and extra ``headers`` (those the handshake itself sets are
    dropped from them)."""
    lines = [
        b"HTTP/1.1 101 Switching Protocols",
        b"Upgrade: websocket",
        b"Connection: Upgrade",
        b"Sec-WebSocket-Accept: " + generate_accept_token(offer.key),
    ]
    if subprotocol is not None:
        lines.append(b"Sec-WebSocket-Protocol: " + subprotocol.encode("latin-1"))
    if extension is not None:
        lines.append(b"Sec-WebSocket-Extensions: " + extension)
    for name, value in headers:
        if name.lower() not in _HANDSHAKE_HEADERS:
            lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n"


_HANDSHAKE_HEADERS = frozenset(
    {
        b"upgrade",
        b"connection",
        b"sec-websocket-accept",
        b"sec-websocket-protocol",
        b"sec-websocket-extensions",
        b"content-length",
        b"transfer-encoding",
    }
)


def denial_head(status: int, headers: Iterable[tuple[bytes, bytes]], length: int) -> bytes:
    """The head of a response that turns a handshake down (an app's
    ``websocket.http.response``, or the server's own refusal): ``length`` bytes of
    body follow, then the connection closes. It carries a ``Date`` (RFC 9110 §6.6.1)
    unless the app's headers have one."""
    phrase = _PHRASES.get(status, b"")
    lines = [b"HTTP/1.1 %d %s" % (status, phrase)]
    dated = False
    for name, value in headers:
        lowered = name.lower()
        if lowered not in (b"content-length", b"connection"):
            lines.append(name + b": " + value)
            dated = dated or lowered == b"date"
    if not dated:
        lines.append(b"Date: " + http_date())
    lines.append(b"Content-Length: %d" % length)
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}
