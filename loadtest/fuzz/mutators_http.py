"""Mutators for an HTTP fuzz input, where one segment is one request: lies in the
``Content-Length`` or a chunk size, broken headers, and broken request lines. Pure.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

from .segments import Segments, pick_segment, replace_segment

__all__ = [
    "chunk_size_spans",
    "http_chunk_lie",
    "http_content_length_lie",
    "http_header_mangle",
    "http_request_line_mangle",
]

_CONTENT_LENGTH = re.compile(rb"(?im)^(content-length:[ \t]*)([^\r\n]*)")
_REQUEST_LINE = re.compile(rb"^([^ \r\n]*) ([^ \r\n]*) ([^\r\n]*)\r\n")


def http_content_length_lie(rng: random.Random, segments: Sequence[bytes]) -> Segments:
    """Rewrite one request's ``Content-Length``: more or fewer bytes than sent (the server
    waits for a body that never comes, or reads the rest as the next request), huge,
    negative, not a number, a list, or a second header that disagrees."""
    candidates = [i for i, s in enumerate(segments) if _CONTENT_LENGTH.search(s)]
    if not candidates:
        # No body: claim one anyway.
        i = pick_segment(rng, segments)
        if i < 0 or b"\r\n" not in segments[i]:
            return list(segments)
        head, _, rest = segments[i].partition(b"\r\n")
        return replace_segment(
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
    return replace_segment(segments, i, data)


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
        return replace_segment(segments, i, data[:-5])  # no last chunk: the body never ends
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
    return replace_segment(segments, i, data[:start] + lie + data[end:])


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
    i = pick_segment(rng, segments)
    if i < 0:
        return list(segments)
    return replace_segment(segments, i, rng.choice(_HEADER_MANGLES)(rng, segments[i]))


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
    return replace_segment(segments, i, line + segments[i][m.end() :])
