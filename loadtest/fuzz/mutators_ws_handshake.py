"""WebSocket mutators of the opening handshake (RFC 6455 §4; MQTT over WebSockets,
MQTT-6.0.0-3): a key, version, ``Connection`` or ``Upgrade`` header wrong or missing,
another method, no ``Host``, another path, no subprotocol the listener speaks, an
origin not allowed. Each changes segment 0 and leaves the frames as they are; what a
server may answer to each: :mod:`.mutators_ws`. Pure.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from .segments import Segments

__all__ = [
    "ALLOWED_ORIGIN",
    "hs_connection",
    "hs_host",
    "hs_key",
    "hs_method",
    "hs_origin",
    "hs_path",
    "hs_subprotocol",
    "hs_upgrade",
    "hs_version",
]

_HEADER = re.compile(rb"(?im)^([A-Za-z-]+):[ \t]*([^\r\n]*)\r\n")


def _header(handshake: bytes, name: bytes) -> re.Match[bytes] | None:
    for m in _HEADER.finditer(handshake):
        if m.group(1).lower() == name:
            return m
    return None


def _without(handshake: bytes, name: bytes) -> bytes:
    m = _header(handshake, name)
    return handshake if m is None else handshake[: m.start()] + handshake[m.end() :]


def _with(handshake: bytes, line: bytes) -> bytes:
    """``line`` added as the handshake's last header."""
    return handshake[:-2] + line + b"\r\n\r\n"


def _set(handshake: bytes, name: bytes, line: bytes) -> bytes:
    return _with(_without(handshake, name), line)


def _handshake(segments: Sequence[bytes], change: bytes) -> Segments:
    out = list(segments)
    out[0] = change
    return out


def hs_key(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """``Sec-WebSocket-Key`` missing, not base64, not 16 bytes once decoded, or twice
    (RFC 6455 §4.2.1: the server MUST refuse; 400)."""
    hs = segments[0]
    bad = rng.choice((b"", b"abc", b"not base64!!", b"dGhlIHNhbXBsZQ==", b"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"))
    way = rng.randrange(3)
    if way == 0:
        return _handshake(segments, _without(hs, b"sec-websocket-key"))
    if way == 1:
        return _handshake(segments, _set(hs, b"sec-websocket-key", b"Sec-WebSocket-Key: " + bad))
    return _handshake(segments, _with(hs, b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="))


def hs_version(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """``Sec-WebSocket-Version`` other than 13, or missing (426 with the version spoken,
    or 400)."""
    version = rng.choice((b"8", b"12", b"14", b"13, 8", b"", None))
    hs = _without(segments[0], b"sec-websocket-version")
    return _handshake(segments, hs if version is None else _with(hs, b"Sec-WebSocket-Version: " + version))


def hs_connection(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """``Connection`` without the ``upgrade`` token, or missing (400)."""
    value = rng.choice((b"keep-alive", b"close", b"upgrades", None))
    hs = _without(segments[0], b"connection")
    return _handshake(segments, hs if value is None else _with(hs, b"Connection: " + value))


def hs_upgrade(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """``Upgrade`` missing or not ``websocket``: no WebSocket asked for (an HTTP server
    serves the request as a plain one; a WebSocket-only listener refuses it)."""
    value = rng.choice((b"h2c", b"websockets", None))
    hs = _without(segments[0], b"upgrade")
    return _handshake(segments, hs if value is None else _with(hs, b"Upgrade: " + value))


def hs_method(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Another method than GET, or HTTP/1.0 (RFC 6455 §4.1: GET, HTTP/1.1 or later; 400)."""
    hs = segments[0]
    line_end = hs.index(b"\r\n")
    method, target, version = hs[:line_end].split(b" ", 2)
    if rng.random() < 0.5:
        method = rng.choice((b"POST", b"PUT", b"HEAD", b"OPTIONS"))
        hs = _with(hs, b"Content-Length: 0") if method in (b"POST", b"PUT") else hs
    else:
        version = b"HTTP/1.0"
    return _handshake(segments, b" ".join((method, target, version)) + hs[line_end:])


def hs_host(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """No ``Host`` (HTTP/1.1 requires one; 400)."""
    return _handshake(segments, _without(segments[0], b"host"))


def hs_path(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Another path than the listener's (404)."""
    hs = segments[0]
    line_end = hs.index(b"\r\n")
    method, _, version = hs[:line_end].split(b" ", 2)
    target = rng.choice((b"/", b"/mqt", b"/mqtt/", b"/MQTT", b"/ws", b"/mqtt%00"))
    return _handshake(segments, b" ".join((method, target, version)) + hs[line_end:])


def hs_subprotocol(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """No subprotocol the listener speaks offered (MQTT-6.0.0-3; 400)."""
    value = rng.choice((b"mqttv5", b"MQTT", b"wamp, chat", b"", None))
    hs = _without(segments[0], b"sec-websocket-protocol")
    return _handshake(segments, hs if value is None else _with(hs, b"Sec-WebSocket-Protocol: " + value))


ALLOWED_ORIGIN = b"http://allowed.fuzz"
"""The one browser origin the fuzz run's MQTT listener lets in (``--ws-allowed-origins``)."""


def hs_origin(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A browser page from an origin not on the allow-list (cross-site WebSocket
    hijacking; 403)."""
    origin = rng.choice((b"http://evil.fuzz", b"null", ALLOWED_ORIGIN + b".evil", b"https://allowed.fuzz"))
    return _handshake(segments, _set(segments[0], b"origin", b"Origin: " + origin))
