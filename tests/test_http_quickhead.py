"""The plain-head reader against h11: every head it accepts, h11 reads the same way.

Heads are built from a grammar that mixes the usual with what smuggling and parser
differentials are made of: bare CR and LF, obs-fold, control bytes, obs-text, OWS,
duplicate or missing Host, framing and switch headers, other versions and target
forms, and bytes after the head.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servers.http import linememo, quickhead
from servers.http.quickhead import QuickHead, quick_head, replay

METHODS = [b"GET", b"HEAD", b"POST", b"DELETE", b"OPTIONS", b"CONNECT", b"get", b"G ET", b"GET\t", b"", b"M-SEARCH"]
TARGETS = [b"/", b"/a?b=c&d", b"/%2e%2e/", b"*", b"http://h/p", b"/\x7f", b"/\xc3\xa9", b"/a b", b"//x", b"/\x00"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"http/1.1", b"HTTP/1.1 ", b"HTTP/1.10"]
NAMES = [
    b"Host",
    b"host",
    b"HOST",
    b"Accept",
    b"X-Custom_1",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Connection",
    b"Expect",
    b"Upgrade",
    b"Te",
    b"",
    b"Bad Name",
    b"Bad\x00",
    b"caf\xc3\xa9",
]
VALUES = [
    b"example.com",
    b"",
    b"0",
    b"5",
    b"chunked",
    b"close",
    b"keep-alive",
    b"100-continue",
    b"websocket",
    b"a b\tc",
    b"\x80\xff obs-text",
    b"ctl\x01\x7f",
    b"vt\x0bff\x0c",
    b"nul\x00",
    b"  padded\t ",
]
EOLS = [b"\r\n"] * 8 + [b"\n", b"\r", b"\r\r\n", b"\n\r"]


PLAIN_NAMES = [b"Accept", b"user-agent", b"X-Custom_1", b"Te", b"ACCEPT-ENCODING"]
PLAIN_VALUES = [b"example.com", b"", b"*/*", b"a b\tc", b"\x80\xff obs-text", b"ctl\x01\x7f", b"  padded\t "]


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """A plain head (as clients send), often with one or more of the things that are not."""
    lines = [b"%s %s HTTP/1.1" % (draw(st.sampled_from([b"GET", b"HEAD", b"DELETE", b"M-SEARCH"])), b"/p?q=1")]
    fields = [(draw(st.sampled_from([b"Host", b"host", b"HOST"])), draw(st.sampled_from([b"example.com", b"h:80"])))]
    for _ in range(draw(st.integers(0, 4))):
        fields.append((draw(st.sampled_from(PLAIN_NAMES)), draw(st.sampled_from(PLAIN_VALUES))))
    fields = draw(st.permutations(fields))
    ows = draw(st.lists(st.sampled_from([b"", b" ", b"\t", b"  "]), min_size=2, max_size=2))
    lines += [name + b":" + ows[0] + value + ows[1] for name, value in fields]
    eols = [b"\r\n"] * (len(lines) + 1)
    lead = b""
    for _ in range(draw(st.integers(0, 2))):  # what is not plain, anywhere in the head
        kind = draw(st.integers(0, 7))
        at = draw(st.integers(0, len(lines) - 1))
        if kind == 0:
            lines[0] = b" ".join(
                [draw(st.sampled_from(METHODS)), draw(st.sampled_from(TARGETS)), draw(st.sampled_from(VERSIONS))]
            )
        elif kind == 1:
            lines.insert(
                draw(st.integers(1, len(lines))), draw(st.sampled_from(NAMES)) + b": " + draw(st.sampled_from(VALUES))
            )
            eols.append(b"\r\n")
        elif kind == 2:
            eols[at] = draw(st.sampled_from(EOLS[8:]))
        elif kind == 3:
            lines.insert(draw(st.integers(1, len(lines))), draw(st.sampled_from([b" folded", b"\tfolded"])))
            eols.append(b"\r\n")
        elif kind == 4:
            lines[at] = lines[at].replace(b":", draw(st.sampled_from([b" :", b"", b"::"])), 1)
        elif kind == 5:
            lead = draw(st.sampled_from([b"\r\n", b"\n", b" "]))
        elif kind == 6:
            lines = [line for line in lines if not line.lower().startswith(b"host")] or lines
        else:
            pos = draw(st.integers(0, len(lines[at])))
            lines[at] = (
                lines[at][:pos] + draw(st.sampled_from([b"\x00", b"\r", b"\n", b"\x0b", b" "])) + lines[at][pos:]
            )
    head = lead + b"".join(line + eol for line, eol in zip(lines, eols, strict=False)) + eols[-1]
    return head + draw(st.sampled_from([b"", b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", b"garbage", b"\r\n"]))


def _h11_reads(buf: bytes, head: QuickHead) -> None:
    h = h11.Connection(h11.SERVER)
    h.receive_data(buf)
    event = h.next_event()
    assert isinstance(event, h11.Request), event
    assert (event.method, event.target, event.http_version) == (head.method, head.target, head.http_version)
    assert [(name, value) for name, value in event.headers] == head.headers
    assert isinstance(h.next_event(), h11.EndOfMessage)
    assert h.their_state is h11.DONE and h.our_state is h11.SEND_RESPONSE
    assert h._cstate.keep_alive and not h.they_are_waiting_for_100_continue
    assert bytes(h.trailing_data[0]) == buf[head.size :]
    told = h11.Connection(h11.SERVER)
    replay(told, head)
    assert told.states == h.states and told.their_http_version == h.their_http_version
    assert told._cstate.keep_alive and not told.they_are_waiting_for_100_continue


@settings(max_examples=3000, deadline=None)
@given(heads())
def test_every_quick_head_is_read_by_h11_the_same_way(buf: bytes) -> None:
    head = quick_head(buf)
    if head is not None:
        _h11_reads(buf, head)
    # Read again, its lines now remembered: the memo answers as the grammar did.
    assert quick_head(buf) == head


def test_the_line_memo_is_bounded_and_never_keeps_a_refused_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linememo, "LINES", 8)
    quickhead._fields.clear()
    for i in range(50):
        assert quick_head(b"GET / HTTP/1.1\r\nHost: a\r\nX-N: %d\r\n\r\n" % i) is not None
        assert len(quickhead._fields) <= 8
    long_line = b"X-Long: " + b"v" * linememo.LINE_BYTES
    assert quick_head(b"GET / HTTP/1.1\r\nHost: a\r\n" + long_line + b"\r\n\r\n") is not None
    assert long_line not in quickhead._fields
    # A line that makes a head h11's (a body's length) is never remembered as plain.
    for _ in range(2):
        assert quick_head(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n") is None
    assert b"Content-Length: 0" not in quickhead._fields


def test_what_clients_send_is_quick() -> None:
    for buf in (
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n",  # wrk
        b"GET /x?y=1 HTTP/1.1\r\nHost: localhost:8080\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
        b"User-Agent: python-httpx/0.28.1\r\n\r\n",
        b"HEAD /h HTTP/1.1\r\nhost: a\r\nX-Empty:\r\n\r\nGET / HTTP/1.1\r\n",
    ):
        head = quick_head(buf)
        assert head is not None, buf
        _h11_reads(buf, head)


def test_heads_with_a_body_a_close_or_doubt_are_left_to_h11() -> None:
    for buf in (
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n\r\n",
        b"CONNECT /x HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.0\r\nHost: a\r\n\r\n",
        b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
        b"GET / HTTP/1.1\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\n",  # not complete yet
        b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    ):
        assert quick_head(buf) is None, buf
