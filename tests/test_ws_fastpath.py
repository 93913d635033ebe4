"""The WebSocket fast path (servers/ws/fastpath.py) against wsproto, its reference: what
a session reads and answers is the same with it as without it, however the peer's
frames are made and the bytes cut; and each kind of frame it must not take, it leaves."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

from servers.ws import session as session_module
from servers.ws.fastpath import frame_message, read_whole_frames
from servers.ws.session import WsSession

MASK = b"\x0f\xf0\x55\xaa"


def client() -> Connection:
    from wsproto.connection import ConnectionState

    peer = Connection(ConnectionType.CLIENT)
    assert peer.state is ConnectionState.OPEN
    return peer


def masked(first: int, payload: bytes, length: bytes | None = None) -> bytes:
    if length is None:
        n = len(payload)
        length = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    body = bytes(b ^ MASK[i % 4] for i, b in enumerate(payload))
    return bytes([first]) + length + MASK + body


def run(data: list[bytes], *, fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[object], bytes, object]:
    if not fast:
        monkeypatch.setattr(session_module, "wsproto_idle", lambda ws: False)
    session = WsSession(max_size=300)
    messages: list[object] = []
    out = b""
    for piece in data:
        got = session.receive(piece)
        messages += got.messages
        out += got.out
        if got.closed is not None:
            break
    monkeypatch.undo()
    return messages, out, session.closed


frames = st.one_of(
    st.text(max_size=40).map(lambda t: ("text", t)),
    st.binary(max_size=400).map(lambda b: ("bytes", b)),
    st.binary(max_size=20).map(lambda b: ("ping", b)),
    st.tuples(st.text(max_size=10), st.integers(1, 3)).map(lambda t: ("fragmented", t)),
    st.binary(min_size=1, max_size=8).map(lambda b: ("garbage", b)),
)


def encode(kind: str, value: object, peer: Connection) -> bytes:
    if kind == "text":
        return peer.send(TextMessage(data=str(value)))
    if kind == "fragmented":
        assert isinstance(value, tuple)
        text, parts = str(value[0]), int(value[1])
        return b"".join(peer.send(TextMessage(data=text, message_finished=i == parts - 1)) for i in range(parts))
    assert isinstance(value, bytes)
    if kind == "bytes":
        return peer.send(BytesMessage(data=value))
    if kind == "ping":
        return peer.send(Ping(payload=value))
    return value


@settings(max_examples=300)
@given(st.lists(frames, max_size=8), st.lists(st.integers(1, 50), max_size=10), st.data())
def test_a_session_reads_and_answers_the_same_with_the_fast_path_as_without(
    made: list[tuple[str, object]], cuts: list[int], data: st.DataObject
) -> None:
    peer = client()
    stream = b"".join(encode(kind, value, peer) for kind, value in made)
    if data.draw(st.booleans()):
        stream += peer.send(CloseConnection(code=1000))
    pieces, pos = [], 0
    for cut in cuts:
        pieces.append(stream[pos : pos + cut])
        pos += cut
    pieces.append(stream[pos:])
    pieces = [p for p in pieces if p]
    with pytest.MonkeyPatch.context() as mp:
        fast = run(pieces, fast=True, monkeypatch=mp)
    with pytest.MonkeyPatch.context() as mp:
        slow = run(pieces, fast=False, monkeypatch=mp)
    assert fast == slow


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (masked(0x82, b"x", length=bytes([0x80 | 126]) + (1).to_bytes(2, "big")), "length not in its shortest form"),
        (masked(0x82, b"x" * 200, length=bytes([0x80 | 127]) + (200).to_bytes(8, "big")), "a 64-bit length"),
        (bytes([0x82, 0x01]) + b"x", "not masked"),
        (masked(0xC2, b"x"), "RSV1 set"),
        (masked(0x02, b"x"), "not final"),
        (masked(0x89, b"hi"), "a ping"),
        (masked(0x88, struct.pack("!H", 1000)), "a close"),
        (masked(0x81, b"\xff\xfe"), "text that is not UTF-8"),
        (masked(0x82, b"x" * 301), "over max_size"),
        (masked(0x82, b"x" * 10)[:-1], "not all there"),
        (masked(0x83, b"x"), "a reserved opcode"),
    ],
)
def test_what_is_not_a_whole_plain_data_frame_is_left_to_wsproto(frame: bytes, why: str) -> None:
    out: list[str | bytes] = []
    good = masked(0x81, "héllo".encode())
    assert read_whole_frames(good + frame, 300, out) == len(good), why
    assert out == ["héllo"]


@pytest.mark.parametrize("message", ["", "hi", "é" * 70, b"", b"\x00" * 125, b"x" * 126, b"y" * 70_000])
def test_what_the_fast_path_writes_wsproto_reads_as_the_message(message: str | bytes) -> None:
    peer = client()
    peer.receive_data(frame_message(message))
    [event] = list(peer.events())
    assert isinstance(event, TextMessage if isinstance(message, str) else BytesMessage)
    assert event.data == message and event.message_finished
