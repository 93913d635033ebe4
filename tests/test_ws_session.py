"""The WebSocket frame layer, sans-IO: fragments joined whatever the split, the size
bound before and while inflating (a decompression bomb never inflates past it), and
what is answered to pings and closes."""

from __future__ import annotations

import tracemalloc
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage
from wsproto.extensions import PerMessageDeflate

from servers.ws.deflate import BoundedDeflate
from servers.ws.session import MESSAGE_TOO_BIG, WsSession
from servers.ws.upgrade import Offer, accept_head, is_upgrade, read_offer, take_deflate


def client() -> Connection:
    return Connection(ConnectionType.CLIENT)


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(st.one_of(st.text(max_size=300), st.binary(max_size=300)), min_size=1, max_size=6),
    frame=st.integers(1, 64),
    split=st.integers(1, 97),
)
def test_messages_come_whole_however_fragmented_and_read(messages: list[str | bytes], frame: int, split: int) -> None:
    peer = client()
    wire = b""
    for message in messages:
        pieces = [message[i : i + frame] for i in range(0, len(message), frame)] or [message]
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            event = (
                TextMessage(data=piece, message_finished=last)
                if isinstance(piece, str)
                else BytesMessage(data=piece, message_finished=last)
            )
            wire += peer.send(event)
    session = WsSession(max_size=10_000)
    got: list[str | bytes] = []
    for i in range(0, len(wire), split):
        received = session.receive(wire[i : i + split])
        assert received.closed is None and received.out == b""
        got.extend(received.messages)
    assert got == messages


def test_a_message_one_byte_over_the_bound_closes_1009_before_it_is_held_whole() -> None:
    peer = client()
    session = WsSession(max_size=100)
    assert session.receive(peer.send(BytesMessage(data=b"a" * 100))).messages == [b"a" * 100]
    got = session.receive(peer.send(BytesMessage(data=b"a" * 60, message_finished=False)))
    assert got.messages == [] and got.closed is None
    got = session.receive(peer.send(BytesMessage(data=b"a" * 41, message_finished=False)))
    assert got.closed is not None and got.closed.code == MESSAGE_TOO_BIG and not got.closed.by_peer
    peer.receive_data(got.out)
    assert next(e for e in peer.events() if isinstance(e, CloseConnection)).code == MESSAGE_TOO_BIG


def bomb(size: int) -> bytes:
    """A compressed binary frame, masked with a zero key, inflating to ``size`` zero bytes."""
    squeeze = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = squeeze.compress(b"\x00" * size) + squeeze.flush(zlib.Z_SYNC_FLUSH)[:-4]
    return bytes([0xC2, 0x80 | 127]) + len(payload).to_bytes(8, "big") + b"\x00" * 4 + payload


def test_a_decompression_bomb_inflates_no_further_than_the_bound() -> None:
    frame = bomb(200_000_000)  # ~200 KB on the wire, 200 MB inflated
    extension = BoundedDeflate(max_size=1_000_000)
    assert extension.accept("permessage-deflate") is not None
    session = WsSession(max_size=1_000_000, extensions=[extension])
    tracemalloc.start()
    try:
        got = session.receive(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.closed is not None and got.closed.code == MESSAGE_TOO_BIG
    assert peak < 4_000_000, peak  # the 1 MB bound and its copies, not 200 MB


def test_compressed_messages_within_the_bound_read_and_write() -> None:
    offer = read_offer(
        b"GET",
        b"1.1",
        [
            (b"upgrade", b"websocket"),
            (b"connection", b"Upgrade"),
            (b"sec-websocket-version", b"13"),
            (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="),
            (b"sec-websocket-extensions", b"permessage-deflate; client_max_window_bits"),
        ],
    )
    assert isinstance(offer, Offer)
    taken = take_deflate(offer, max_size=1 << 20)
    assert taken is not None
    extension, answer = taken
    assert answer.startswith(b"permessage-deflate") and b"server_no_context_takeover" in answer
    head = accept_head(offer, subprotocol=None, extension=answer)
    assert head.startswith(b"HTTP/1.1 101 ") and b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in head
    peer_deflate = PerMessageDeflate()
    peer_deflate.finalize(answer.decode())
    peer = Connection(ConnectionType.CLIENT, [peer_deflate])
    session = WsSession(max_size=1 << 20, extensions=[extension])
    text = "presence " * 10_000
    wire = peer.send(TextMessage(data=text))
    assert len(wire) < len(text) // 20
    assert session.receive(wire).messages == [text]
    peer.receive_data(session.send(text))
    assert [e.data for e in peer.events() if isinstance(e, TextMessage)] == [text]
    assert extension._compressor is None  # no compressor kept between messages


def test_pings_are_answered_and_a_close_is_returned() -> None:
    peer = client()
    session = WsSession(max_size=100)
    got = session.receive(peer.send(Ping(payload=b"p1")))
    peer.receive_data(got.out)
    assert [e.payload for e in peer.events() if isinstance(e, Pong)] == [b"p1"]
    got = session.receive(peer.send(CloseConnection(code=4005, reason="later")))
    assert got.closed is not None and (got.closed.code, got.closed.reason, got.closed.by_peer) == (4005, "later", True)
    peer.receive_data(got.out)
    assert [e.code for e in peer.events() if isinstance(e, CloseConnection)] == [4005]
    assert session.send("after") == b""


def test_upgrade_heads_are_told_apart() -> None:
    assert is_upgrade([(b"upgrade", b"WebSocket")])
    assert is_upgrade([(b"upgrade", b"h2c, websocket")])
    assert not is_upgrade([(b"upgrade", b"h2c")])
    refused = read_offer(b"GET", b"1.0", [])
    assert not isinstance(refused, Offer) and refused[0] == 400


def test_an_eof_ends_the_session_1006_whatever_holds_wsprotos_events() -> None:
    peer = client()
    session = WsSession(max_size=100)
    assert session.receive(peer.send(TextMessage(data="a"))).messages == ["a"]
    got = session.receive(b"")
    assert got.closed is not None and (got.closed.code, got.closed.by_peer) == (1006, True)
    assert got.out == b"" and session.receive(b"x").closed == got.closed
