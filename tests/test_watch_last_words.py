"""``WatchedStream.last_words``: a handler's goodbye (MQTT 5's DISCONNECT 0x8D) is
written by the reaper just before an expiry closes the socket, as the dense engine's
``Protocol.last_words`` is; never into a send under way, never with ``close=False``,
never as plaintext under TLS, and a raising one is logged while the close goes on."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from trio.testing import MockClock

import idlekeeper
from idlekeeper import Reason


async def pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def read_all(stream: trio.SocketStream) -> bytes:
    data = b""
    with trio.fail_after(60):
        while chunk := await stream.receive_some():
            data += chunk
    return data


async def test_the_last_words_reach_the_peer_before_the_close(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    ours, peer = await pair()
    asked: list[Reason] = []

    def words(reason: Reason) -> bytes:
        asked.append(reason)
        return b"bye:" + reason.value.encode()

    with keeper.watch(ours, receive=3) as conn:
        assert isinstance(conn, idlekeeper.WatchedStream)
        conn.last_words = words
        await trio.sleep_forever()
    assert conn.expired and asked == [Reason.RECEIVE]
    assert await read_all(peer) == b"bye:receive"  # then EOF: the reaper closed it


async def test_none_without_close_or_with_nothing_to_say(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    ours, peer = await pair()
    with keeper.watch(ours, idle=2, close=False) as conn:
        conn.stream.last_words = lambda reason: b"never"  # the handler says goodbye itself
        await trio.sleep_forever()
    assert conn.expired
    await ours.aclose()
    assert await read_all(peer) == b""
    ours, peer = await pair()
    with keeper.watch(ours, idle=2) as conn:
        conn.stream.last_words = lambda reason: None
        await trio.sleep_forever()
    assert await read_all(peer) == b""


async def test_none_into_a_send_under_way(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    ours, peer = await pair()
    with keeper.watch(ours, send=2) as conn:
        conn.stream.last_words = lambda reason: b"CUT-IN"
        await conn.stream.send_all(b"x" * (8 << 20))  # never read: it stalls, and expires
    assert conn.reason is Reason.SEND
    assert b"CUT-IN" not in await read_all(peer)


async def test_not_under_tls_and_a_raising_one_is_logged(
    keeper: idlekeeper.Keeper, clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    left, _right = trio.testing.memory_stream_pair()  # not a SocketStream: as under TLS, never written raw
    asked: list[Reason] = []
    ours, peer = await pair()
    with keeper.watch(left, idle=1, socket=ours.socket) as conn:
        conn.stream.last_words = lambda reason: asked.append(reason) or b"plaintext"  # type: ignore[func-returns-value]
        await trio.sleep_forever()
    assert conn.expired and asked == []
    assert await read_all(peer) == b""

    def broken(reason: Reason) -> bytes:
        raise RuntimeError("broken goodbye")

    ours, peer = await pair()
    with keeper.watch(ours, idle=1) as conn:
        conn.stream.last_words = broken
        await trio.sleep_forever()
    assert conn.expired and await read_all(peer) == b""
    assert "broken goodbye" in caplog.text
