"""Mutators for ``python -m loadtest fuzz``: a valid input in, a hostile variant out. Pure.

An input is a list of *segments*: the MQTT packets or the HTTP requests it is made
of, in the order they go on the wire. Keeping the boundaries lets a mutator lie
about one packet's length, duplicate or reorder whole packets, or rewrite one
request's ``Content-Length``; byte-level mutators work inside one segment, so
several can be stacked and still leave the others intact.

Every mutator takes a ``random.Random`` and the segments and returns new segments
(never changing its argument), so a case is a pure function of its seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

from servers.heartbeat.encoders import encode_remaining_length
from servers.heartbeat.packets import MAX_REMAINING_LENGTH

__all__ = [
    "GENERIC",
    "HTTP_MUTATORS",
    "INTERESTING",
    "MQTT_MUTATORS",
    "Mutator",
    "Segments",
    "bit_flip",
    "chunk_size_spans",
    "byte_set",
    "delete",
    "drop",
    "duplicate",
    "extend",
    "http_chunk_lie",
    "http_content_length_lie",
    "http_header_mangle",
    "http_request_line_mangle",
    "insert",
    "mqtt_huge_length",
    "mqtt_length_lie",
    "mqtt_string_length_lie",
    "mqtt_type_flags",
    "mqtt_varint_overflow",
    "random_bytes",
    "reorder",
    "split_mqtt",
    "truncate",
]

Segments = list[bytes]
"""An input as the packets (MQTT) or requests (HTTP) it is made of."""
Mutator = Callable[[random.Random, Sequence[bytes]], Segments]
"""``mutator(rng, segments) -> new segments``."""

INTERESTING = (0x00, 0x01, 0x02, 0x0A, 0x0D, 0x20, 0x3A, 0x7F, 0x80, 0xC0, 0xFE, 0xFF)
"""Bytes that sit on boundaries parsers care about: NUL, CR/LF, space, colon, the
varint continuation bit, UTF-8 lead bytes, the top of a byte."""


def _pick(rng: random.Random, segments: Sequence[bytes]) -> int:
    """Index of a non-empty segment (-1 if every one is empty)."""
    candidates = [i for i, s in enumerate(segments) if s]
    return rng.choice(candidates) if candidates else -1


def _replace(segments: Sequence[bytes], i: int, new: bytes) -> Segments:
    out = list(segments)
    out[i] = new
    return out


# -- generic: any protocol ---------------------------------------------------------------


def bit_flip(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Flip 1 to 4 distinct bits of one segment."""
    i = _pick(rng, segments)
    if i < 0:
        return list(segments)
    data = bytearray(segments[i])
    for bit in rng.sample(range(len(data) * 8), min(rng.randint(1, 4), len(data) * 8)):
        data[bit // 8] ^= 1 << (bit % 8)
    return _replace(segments, i, bytes(data))


def byte_set(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Set 1 to 4 bytes of one segment to an :data:`INTERESTING` or a random value."""
    i = _pick(rng, segments)
    if i < 0:
        return list(segments)
    data = bytearray(segments[i])
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.choice(INTERESTING) if rng.random() < 0.6 else rng.randrange(256)
    return _replace(segments, i, bytes(data))


def truncate(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Cut the whole input short, anywhere from its first byte to one before its last."""
    total = sum(len(s) for s in segments)
    if total < 2:
        return list(segments)
    cut = rng.randrange(1, total)
    out: Segments = []
    for s in segments:
        if cut <= 0:
            break
        out.append(s[:cut])
        cut -= len(s)
    return out


def extend(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Append 1 to 64 random bytes to one segment (trailing junk inside or after a packet)."""
    i = _pick(rng, segments)
    if i < 0:
        return [rng.randbytes(rng.randint(1, 64))]
    return _replace(segments, i, segments[i] + rng.randbytes(rng.randint(1, 64)))


def insert(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Insert 1 to 16 bytes (random or interesting) somewhere in one segment."""
    i = _pick(rng, segments)
    if i < 0:
        return list(segments)
    data = segments[i]
    at = rng.randrange(len(data) + 1)
    junk = bytes(rng.choice(INTERESTING) for _ in range(rng.randint(1, 4))) if rng.random() < 0.4 else b""
    junk += rng.randbytes(rng.randint(0 if junk else 1, 12))
    return _replace(segments, i, data[:at] + junk + data[at:])


def delete(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Delete 1 to 8 consecutive bytes from one segment."""
    i = _pick(rng, segments)
    if i < 0:
        return list(segments)
    data = segments[i]
    at = rng.randrange(len(data))
    return _replace(segments, i, data[:at] + data[at + rng.randint(1, 8) :])


def random_bytes(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Throw the input away: 1 to 512 random bytes, sometimes behind a plausible first byte."""
    junk = rng.randbytes(rng.randint(1, 512))
    if segments and segments[0] and rng.random() < 0.3:
        junk = segments[0][:1] + junk
    return [junk]


def duplicate(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Send one segment twice (a second CONNECT, a repeated request), right after itself or at the end."""
    if not segments:
        return []
    i = rng.randrange(len(segments))
    out = list(segments)
    out.insert(i + 1 if rng.random() < 0.5 else len(out), segments[i])
    return out


def reorder(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Swap two segments, or shuffle them all (CONNECT no longer first, say)."""
    out = list(segments)
    if len(out) < 2:
        return out
    if rng.random() < 0.5:
        a, b = rng.sample(range(len(out)), 2)
        out[a], out[b] = out[b], out[a]
    else:
        rng.shuffle(out)
    return out


def drop(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Leave one segment out (the CONNECT, a request's head...)."""
    out = list(segments)
    if len(out) < 2:
        return out
    del out[rng.randrange(len(out))]
    return out


# -- MQTT: one segment is one packet -----------------------------------------------------


def split_mqtt(packet: bytes) -> tuple[int, int, bytes] | None:
    """``(first byte, remaining length, body)`` of a well-framed packet, or None."""
    if len(packet) < 2:
        return None
    length, shift, i = 0, 0, 1
    while True:
        if i >= len(packet) or i > 4:
            return None
        byte = packet[i]
        length |= (byte & 0x7F) << shift
        shift += 7
        i += 1
        if not byte & 0x80:
            break
    body = packet[i:]
    return (packet[0], length, body) if len(body) == length else None


def _framed(rng: random.Random, segments: Sequence[bytes]) -> tuple[int, tuple[int, int, bytes]] | None:
    candidates = [(i, f) for i, s in enumerate(segments) if (f := split_mqtt(s)) is not None]
    return rng.choice(candidates) if candidates else None


def mqtt_length_lie(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Give one packet a remaining length other than its body's: a little off, zero, or far
    off (the reader then waits for bytes that never come, or takes the next packet as body)."""
    found = _framed(rng, segments)
    if found is None:
        return list(segments)
    i, (first, length, body) = found
    lie = length
    while lie == length:
        lie = rng.choice(
            (
                length + rng.randint(1, 3),
                max(0, length - rng.randint(1, 3)),
                0,
                rng.randint(0, 2 * length + 16),
                127,
                128,
                16_383,
                16_384,
            )
        )
    return _replace(segments, i, bytes((first,)) + encode_remaining_length(lie) + body)


def mqtt_varint_overflow(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """A remaining length with the continuation bit on its fourth byte (five or more bytes)."""
    found = _framed(rng, segments)
    if found is None:
        return list(segments)
    i, (first, _length, body) = found
    varint = b"\xff\xff\xff\xff\x7f" if rng.random() < 0.5 else b"\x80" * rng.randint(4, 12) + b"\x01"
    return _replace(segments, i, bytes((first,)) + varint + body)


def mqtt_huge_length(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Claim a body far larger than the server's packet limit (up to the 256 MiB the
    varint allows), and send only the first few bytes of it."""
    found = _framed(rng, segments)
    if found is None:
        return list(segments)
    i, (first, _length, body) = found
    huge = rng.choice((MAX_REMAINING_LENGTH, 256 * 1024 + 1, 1 << 21, rng.randint(1 << 18, MAX_REMAINING_LENGTH)))
    return _replace(segments, i, bytes((first,)) + encode_remaining_length(huge) + body)


def mqtt_type_flags(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Rewrite one packet's first byte: a server-only type (CONNACK, SUBACK...), a reserved
    type, wrong fixed-header flags, or QoS 3."""
    found = _framed(rng, segments)
    if found is None:
        return list(segments)
    i, (first, length, body) = found
    new = first
    while new == first:
        new = rng.choice(
            (
                rng.randrange(256),
                (first & 0xF0) | rng.randrange(16),  # the same type, other flags
                rng.choice((0x00, 0x20, 0x90, 0xB0, 0xD0, 0xF0)),  # reserved, or what only a server sends
                0x36,  # PUBLISH QoS 3
                0x38,  # DUP on QoS 0
            )
        )
    return _replace(segments, i, bytes((new,)) + encode_remaining_length(length) + body)


# Where the first length-prefixed field of each packet type starts, in its body.
_FIRST_STRING = {0x1: (0, 10), 0x3: (0,), 0x8: (2,), 0xA: (2,)}


def mqtt_string_length_lie(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Lie in a length prefix inside a packet (CONNECT's protocol name or client id, a
    topic, a filter): the field then runs past the packet's end or leaves bytes over."""
    candidates = []
    for i, s in enumerate(segments):
        f = split_mqtt(s)
        if f is not None and f[0] >> 4 in _FIRST_STRING:
            for at in _FIRST_STRING[f[0] >> 4]:
                if at + 2 <= len(f[2]):
                    candidates.append((i, f, at))
    if not candidates:
        return list(segments)
    i, (first, length, body), at = rng.choice(candidates)
    old = int.from_bytes(body[at : at + 2], "big")
    lie = old
    while lie == old:
        lie = rng.choice(((old + 1) & 0xFFFF, max(0, old - 1), 0, 0xFFFF, rng.randrange(0x10000)))
    body = body[:at] + lie.to_bytes(2, "big") + body[at + 2 :]
    return _replace(segments, i, bytes((first,)) + encode_remaining_length(length) + body)


# -- HTTP: one segment is one request ----------------------------------------------------

_CONTENT_LENGTH = re.compile(rb"(?im)^(content-length:[ \t]*)([^\r\n]*)")
_REQUEST_LINE = re.compile(rb"^([^ \r\n]*) ([^ \r\n]*) ([^\r\n]*)\r\n")


def http_content_length_lie(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Rewrite one request's ``Content-Length``: more or fewer bytes than sent (the server
    waits for a body that never comes, or reads the rest as the next request), huge,
    negative, not a number, a list, or a second header that disagrees."""
    candidates = [i for i, s in enumerate(segments) if _CONTENT_LENGTH.search(s)]
    if not candidates:
        # No body: claim one anyway.
        i = _pick(rng, segments)
        if i < 0 or b"\r\n" not in segments[i]:
            return list(segments)
        head, _, rest = segments[i].partition(b"\r\n")
        return _replace(
            segments, i, head + b"\r\nContent-Length: " + str(rng.randint(1, 100)).encode() + b"\r\n" + rest
        )
    i = rng.choice(candidates)
    m = _CONTENT_LENGTH.search(segments[i])
    assert m is not None
    try:
        n = int(m.group(2))
    except ValueError:
        n = 0
    lie = rng.choice(
        (
            str(n + rng.randint(1, 50)),
            str(max(0, n - rng.randint(1, 50))),
            "0",
            "99999999999999999999",
            str(1 << 63),
            "-1",
            "1e3",
            "0x10",
            "abc",
            f"{n}, {n}",
            f"{n}, {n + 1}",
            f" {n} ",
            f"+{n}",
        )
    ).encode()
    data = segments[i][: m.start(2)] + lie + segments[i][m.end(2) :]
    if rng.random() < 0.2:
        data = data[: m.start()] + b"Content-Length: " + str(n + 7).encode() + b"\r\n" + data[m.start() :]
    return _replace(segments, i, data)


def chunk_size_spans(request: bytes) -> list[tuple[int, int]]:
    """Where each chunk-size field of a request's chunked body is (start, end), walking
    the body as a server would; empty if the request is not a well-formed chunked one."""
    head_end = request.find(b"\r\n\r\n")
    if head_end < 0 or b"chunked" not in request[:head_end].lower():
        return []
    spans = []
    pos = head_end + 4
    while pos < len(request):
        line_end = request.find(b"\r\n", pos)
        if line_end < 0:
            return []
        size_end = pos
        while size_end < line_end and request[size_end : size_end + 1] not in (b";", b" "):
            size_end += 1
        try:
            size = int(request[pos:size_end], 16)
        except ValueError:
            return []
        spans.append((pos, size_end))
        if size == 0:
            return spans
        pos = line_end + 2 + size + 2
    return []


def http_chunk_lie(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Rewrite a chunk-size line of a chunked body: bigger or smaller than the chunk, huge,
    not hex, with a huge extension; or take away the last (zero) chunk."""
    candidates = [(i, spans) for i, s in enumerate(segments) if (spans := chunk_size_spans(s))]
    if not candidates:
        return list(segments)
    i, spans = rng.choice(candidates)
    data = segments[i]
    if rng.random() < 0.2 and data.endswith(b"0\r\n\r\n"):
        return _replace(segments, i, data[:-5])  # no last chunk: the body never ends
    start, end = rng.choice(spans)
    size = int(data[start:end], 16)
    lie = rng.choice(
        (
            f"{size + rng.randint(1, 20):x}",
            f"{max(0, size - rng.randint(1, 20)):x}",
            "f" * rng.randint(9, 40),
            "zz",
            "-1",
            f" {size:x}",
            f"{size:x};" + "e" * rng.randint(1, 3000),
            f"0x{size:x}",
        )
    ).encode()
    return _replace(segments, i, data[:start] + lie + data[end:])


_HEADER_MANGLES: tuple[Callable[[random.Random, bytes], bytes], ...] = (
    lambda rng, d: d.replace(b"\r\n", b"\n"),  # bare LF line ends
    lambda rng, d: d.replace(b"\r\n", b"\r\nX-Broken\r\n", 1),  # a header line without a colon
    lambda rng, d: d.replace(b"\r\nHost:", b"\r\nHost :", 1),  # whitespace before the colon
    lambda rng, d: d.replace(b"\r\n", b"\r\nX-Fold: a\r\n  continued\r\n", 1),  # obs-fold
    lambda rng, d: d.replace(b"\r\n", b"\r\nX-Nul: a\x00b\r\n", 1),
    lambda rng, d: d.replace(b"\r\n", b"\r\nX-Cr: a\rb\r\n", 1),
    lambda rng, d: d.replace(b"\r\n", b"\r\nX-Big: " + b"b" * rng.randint(8_000, 20_000) + b"\r\n", 1),
    lambda rng, d: d.replace(b"\r\n", b"\r\n" + b"".join(b"X-%d: v\r\n" % k for k in range(rng.randint(50, 400))), 1),
    lambda rng, d: d.replace(b"\r\n", b"\r\nHost: second.example\r\n", 1),
    lambda rng, d: d.replace(
        b"\r\n",
        b"\r\nTransfer-Encoding: "
        + rng.choice((b"gzip, chunked", b"chunked, gzip", b"identity", b"chunked", b"chunked\r\nTransfer-Encoding: x"))
        + b"\r\n",
        1,
    ),
    lambda rng, d: d.replace(b"\r\n", b"\r\nExpect: 100-continue\r\n", 1),
    lambda rng, d: d.replace(
        b"\r\n", b"\r\nConnection: " + rng.choice((b"close", b"upgrade", b"keep-alive, x")) + b"\r\n", 1
    ),
    lambda rng, d: d.replace(b"\r\n", b"\r\n\xff\xfe: \xc3\x28\r\n", 1),  # bytes outside any token
)


def http_header_mangle(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """One header-level fault in one request: bare LF, no colon, space before the colon,
    obs-fold, NUL or CR in a value, a huge header or hundreds of them, a second Host,
    a Transfer-Encoding to smuggle with, ``Expect: 100-continue``, bytes outside any token."""
    i = _pick(rng, segments)
    if i < 0:
        return list(segments)
    return _replace(segments, i, rng.choice(_HEADER_MANGLES)(rng, segments[i]))


def _mangled_line(rng: random.Random, method: bytes, target: bytes, version: bytes) -> bytes:
    part = rng.randrange(3)
    if part == 0:
        method = rng.choice((method.lower(), b"BREW", b"G\x00T", b"", b"X" * rng.randint(100, 20_000), b"CONNECT"))
    elif part == 1:
        target = rng.choice(
            (
                target.lstrip(b"/"),
                target + b" extra",
                target + b"%00",
                b"/" + b"a" * rng.randint(1_000, 20_000),
                b"http://fuzz.example" + target,
                b"*",
                b"",
                b"/\xff\xfe",
            )
        )
    else:
        version = rng.choice(
            (b"HTTP/2.0", b"HTTP/1.10", b"HTTP/0.9", b"", b"HTTP/1", b"http/1.1", b"HTTP/3.0", b"XTTP/1.1")
        )
    return method + b" " + target + (b" " + version if version else b"") + b"\r\n"


def http_request_line_mangle(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Break one request line: the method (lowercase, unknown, huge, empty), the target
    (no slash, spaces, NUL, huge, absolute-form), or the version (2.0, 1.10, 0.9, none)."""
    candidates = [i for i, s in enumerate(segments) if _REQUEST_LINE.match(s)]
    if not candidates:
        return list(segments)
    i = rng.choice(candidates)
    m = _REQUEST_LINE.match(segments[i])
    assert m is not None
    old = m.group()
    line = old
    for _ in range(8):  # some choices leave a line as it was (OPTIONS * has no slash to drop)
        line = _mangled_line(rng, m.group(1), m.group(2), m.group(3))
        if line != old:
            break
    return _replace(segments, i, line + segments[i][m.end() :])


GENERIC: dict[str, tuple[float, Mutator]] = {
    "bit-flip": (3.0, bit_flip),
    "byte-set": (3.0, byte_set),
    "truncate": (2.0, truncate),
    "extend": (1.5, extend),
    "insert": (1.5, insert),
    "delete": (1.5, delete),
    "random-bytes": (1.0, random_bytes),
    "duplicate": (1.5, duplicate),
    "reorder": (1.5, reorder),
    "drop": (1.0, drop),
}
"""Byte- and segment-level mutators, by name: (weight, mutator)."""

MQTT_MUTATORS: dict[str, tuple[float, Mutator]] = {
    **GENERIC,
    "length-lie": (2.5, mqtt_length_lie),
    "varint-overflow": (1.0, mqtt_varint_overflow),
    "huge-length": (1.0, mqtt_huge_length),
    "type-flags": (1.5, mqtt_type_flags),
    "string-length-lie": (2.0, mqtt_string_length_lie),
}
"""Every mutator an MQTT input may get, by name: (weight, mutator)."""

HTTP_MUTATORS: dict[str, tuple[float, Mutator]] = {
    **GENERIC,
    "content-length-lie": (2.5, http_content_length_lie),
    "chunk-lie": (2.0, http_chunk_lie),
    "header-mangle": (3.0, http_header_mangle),
    "request-line-mangle": (2.0, http_request_line_mangle),
}
"""Every mutator an HTTP input may get, by name: (weight, mutator)."""
