"""TLS on the dense engine (idlekeeper.tls_transport): the protocol made after the
handshake and speaking plaintext, over real loopback sockets under
MockClock(autojump_threshold=0). The handshake's own deadline and failures are tested
on both engines in tests/test_tls.py; here, what is the engine's own: when the
timeouts start, records trickled after the handshake, close_notify, last words
sealed in a record, backpressure, client certificates on a transport."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, NamedTuple

import pytest
import trio
import trustme
from trio.testing import MockClock

import idlekeeper
from idlekeeper import Engine, ExpiredError, HandshakeFailure, Reason
from idlekeeper.tls_transport import TLSTransport

from .test_engine import Probe, collecting, lost
from .test_tls import ca, client_ctx, client_with_certificate, read_until_closed, requiring_certificates, server_ctx

__all__ = ["ca", "client_ctx", "server_ctx"]  # the fixtures test_tls.py makes, used here too

HOST = "127.0.0.1"


class Upper(Probe):
    """Echoes in upper case, and notes the deadlines it was made with."""

    def __init__(self) -> None:
        super().__init__()
        self.made_with: tuple[float, float | None, float | None] | None = None

    def connection_made(self, transport: idlekeeper.Transport) -> None:
        super().connection_made(transport)
        self.made_with = (transport.deadline, transport.idle_timeout, transport.receive_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.t.write(data.upper())


@asynccontextmanager
async def tls_engine(
    keeper: idlekeeper.Keeper,
    factory: Callable[[], idlekeeper.Protocol],
    ctx: ssl.SSLContext,
    **options: Any,
) -> AsyncIterator[tuple[Engine, int]]:
    """serve_protocol with TLS on a free loopback port; yields the engine and the port."""
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(
            partial(idlekeeper.serve_protocol, factory, 0, keeper=keeper, host=HOST, ssl_context=ctx, **options)
        )
        yield engine, engine.listeners[0].getsockname()[1]
        nursery.cancel_scope.cancel()


async def tls_client(port: int, ctx: ssl.SSLContext) -> trio.SSLStream[trio.SocketStream]:
    return trio.SSLStream(await trio.open_tcp_stream(HOST, port), ctx, server_hostname="localhost")


class ByHand(NamedTuple):
    """A client's SSLObject and its two BIOs, driven by the test."""

    obj: ssl.SSLObject
    incoming: ssl.MemoryBIO
    outgoing: ssl.MemoryBIO


async def handshake_by_hand(raw: trio.SocketStream, client_ctx: ssl.SSLContext) -> ByHand:
    """A client handshake over ``raw`` whose last flight (its Finished) is left unsent
    in the outgoing BIO."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    while True:
        try:
            obj.do_handshake()
            return ByHand(obj, incoming, outgoing)
        except ssl.SSLWantReadError:
            await raw.send_all(outgoing.read())
            incoming.write(await raw.receive_some())


# -- the handshake ---------------------------------------------------------------------


async def test_the_protocol_is_made_after_the_handshake_and_speaks_plaintext(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    probes, factory = collecting(Upper)
    async with tls_engine(keeper, factory, server_ctx, idle=30, receive=20, max_age=100, handshake_timeout=5) as (
        engine,
        port,
    ):
        start = trio.current_time()
        client = await tls_client(port, client_ctx)
        await client.send_all(b"hello over tls")
        assert await client.receive_some() == b"HELLO OVER TLS"
        (probe,) = probes
        transport = probe.t
        assert isinstance(transport, TLSTransport) and transport.handshake_done
        assert isinstance(transport.get_extra_info("ssl_object"), ssl.SSLObject)
        assert transport.get_extra_info("cipher") is not None
        assert transport.get_extra_info("peercert") is None  # no client certificate asked for
        assert transport.get_extra_info("peername")[0] == HOST  # type: ignore[index]
        assert len(engine) == 1
        await client.aclose()
        await lost(probe)
    # The handshake's deadline is gone; max_age's is back, and the timeouts run.
    assert isinstance(probe, Upper)
    assert probe.made_with is not None
    deadline, idle, receive = probe.made_with
    assert deadline == pytest.approx(start + 100) and (idle, receive) == (30, 20)
    assert probe.events == ["made", "data", "eof", "lost"]
    assert probe.lost_once[1] is None
    assert keeper.stats.handshakes == 1
    assert sum(keeper.stats.handshake_failures.values()) == 0


async def test_a_protocol_that_raises_on_plaintext_closes_its_connection_only_and_names_its_peer(
    keeper: idlekeeper.Keeper,
    clock: MockClock,
    server_ctx: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Fragile(Upper):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if b"boom" in data:
                raise RuntimeError("a protocol bug under TLS")

    probes, factory = collecting(Fragile)
    async with tls_engine(keeper, factory, server_ctx) as (engine, port):
        victim = await tls_client(port, client_ctx)
        bystander = await tls_client(port, client_ctx)
        await victim.send_all(b"boom")
        assert await victim.receive_some() == b"BOOM"  # the reply went out before the raise
        await read_until_closed(victim)
        await bystander.send_all(b"fine")
        assert await bystander.receive_some() == b"FINE"
        assert engine.callback_errors == 1 and len(engine) == 1
        (broken,) = [p for p in probes if b"boom" in p.received]
        await lost(broken)
        assert isinstance(broken.lost_once[1], RuntimeError)  # the protocol hears why
        host, port_ = victim.transport_stream.socket.getsockname()[:2]
        assert f"raised on the connection from {host}:{port_}; closing it" in caplog.text
        assert "a protocol bug under TLS" in caplog.text
        await bystander.aclose()


async def test_idle_counts_from_the_end_of_a_slow_handshake(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    """A handshake slower than the idle timeout still completes (only its own deadline
    runs), and idle then counts from its end."""
    probes, factory = collecting()
    async with tls_engine(keeper, factory, server_ctx, idle=2, handshake_timeout=10) as (_, port):
        raw = await trio.open_tcp_stream(HOST, port)
        accepted = trio.current_time()
        with trio.fail_after(30):
            _, _, outgoing = await handshake_by_hand(raw, client_ctx)
            await trio.sleep(5)  # the client's Finished, held back: 5 s > idle
            await raw.send_all(outgoing.read())
            await read_until_closed(raw)
    (probe,) = probes
    assert probe.made_at - accepted == pytest.approx(5, abs=keeper.tick)
    lost_at, exc = probe.lost_once
    assert isinstance(exc, ExpiredError) and exc.reason is Reason.IDLE
    assert 2 <= lost_at - probe.made_at <= 2 + keeper.tick
    assert keeper.stats.handshakes == 1


async def test_a_record_trickled_after_the_handshake_is_not_activity(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    """Bytes of a record that never comes whole refresh nothing: a slowloris under TLS is
    cut at its receive deadline, as over TCP, though the kernel hears from it all along."""
    probes, factory = collecting()
    async with tls_engine(keeper, factory, server_ctx, receive=3) as (_, port):
        raw = await trio.open_tcp_stream(HOST, port)
        obj, _, outgoing = await handshake_by_hand(raw, client_ctx)
        await raw.send_all(outgoing.read())  # the Finished: the handshake is done
        obj.write(b"x" * 100)
        record = outgoing.read()

        async def trickle() -> None:
            with trio.move_on_after(60):
                for byte in record[:-1]:
                    # Off the tick's beat: a byte sent as the deadline is checked would sit
                    # in the kernel then, and rightly save the connection that once.
                    await trio.sleep(0.7)
                    await raw.send_all(bytes([byte]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            await until_events(probes[0], "lost")
            nursery.cancel_scope.cancel()
    (probe,) = probes
    lost_at, exc = probe.lost_once
    assert isinstance(exc, ExpiredError) and exc.reason is Reason.RECEIVE
    assert 3 <= lost_at - probe.made_at <= 3 + keeper.tick
    assert probe.received == b""


async def test_a_whole_record_is_activity_and_reaches_the_protocol_in_one_call(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    """Records that arrive together are opened together: one data_received with them all."""
    probes, factory = collecting()
    async with tls_engine(keeper, factory, server_ctx, receive=3) as (_, port):
        raw = await trio.open_tcp_stream(HOST, port)
        obj, _, outgoing = await handshake_by_hand(raw, client_ctx)
        await raw.send_all(outgoing.read())
        await trio.sleep(2)
        for part in (b"one ", b"two ", b"three"):
            obj.write(part)  # three records
        await raw.send_all(outgoing.read())
        await trio.sleep(2)  # 4 s after the handshake: alive, since the records came at 2
        (probe,) = probes
        assert probe.received == b"one two three" and not probe.lost
        assert probe.last_rx_at - probe.made_at == pytest.approx(2, abs=keeper.tick)
        assert probe.t.silent_for() == pytest.approx(2, abs=keeper.tick)
        await raw.aclose()
        await lost(probe)


class Paused(Probe):
    """Pauses reading as it is made (say, to look its peer up first); the test resumes it."""

    def connection_made(self, transport: idlekeeper.Transport) -> None:
        super().connection_made(transport)
        transport.pause_reading()


async def test_a_protocol_paused_as_it_is_made_gets_nothing_until_it_resumes(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    """The client's first records come in the read that completes the handshake. A
    protocol that pauses reading in connection_made gets them when it resumes, in order,
    at the end of the engine's pass, and a close_notify in the same read after them;
    as a plaintext transport, which would not have read them, would give them.
    (Before, data_received came right after connection_made, paused or not.)"""
    probes, factory = collecting(Paused)
    async with tls_engine(keeper, factory, server_ctx, receive=10) as (_, port):
        raw = await trio.open_tcp_stream(HOST, port)
        obj, _, outgoing = await handshake_by_hand(raw, client_ctx)
        obj.write(b"first ")
        obj.write(b"second")
        await raw.send_all(outgoing.read())  # the Finished and two records, in one read
        await trio.sleep(1)
        (probe,) = probes
        assert probe.events == ["made"] and probe.received == b""
        assert probe.last_rx_at == -1.0 and probe.t.silent_for() == pytest.approx(1, abs=keeper.tick)  # read: activity
        obj.write(b" more")  # while paused: left in the kernel, read after the held records
        await raw.send_all(outgoing.read())
        await trio.sleep(1)
        assert probe.received == b""
        probe.t.resume_reading()  # outside a pass: the engine is woken for it
        assert probe.received == b""  # never inside resume_reading
        await trio.testing.wait_all_tasks_blocked()
        assert probe.received == b"first second more" and probe.events == ["made", "data"]
        probe.t.pause_reading()
        obj.write(b" third")
        await raw.send_all(outgoing.read())
        await trio.sleep(1)
        assert probe.received == b"first second more"  # paused again: left in the kernel
        probe.t.resume_reading()
        await trio.sleep(1)
        assert probe.received == b"first second more third" and not probe.lost

        # The peer's close_notify in that first read too: its end comes after the records.
        raw2 = await trio.open_tcp_stream(HOST, port)
        obj, _, outgoing = await handshake_by_hand(raw2, client_ctx)
        obj.write(b"only")
        with pytest.raises(ssl.SSLWantReadError):
            obj.unwrap()  # close_notify, then it would wait for the server's
        await raw2.send_all(outgoing.read())
        await trio.sleep(1)
        second = probes[1]
        assert second.events == ["made"]
        second.t.resume_reading()
        await lost(second)

        # A TCP end read after the resume, in the pass before its end: after the records too.
        raw3 = await trio.open_tcp_stream(HOST, port)
        obj, _, outgoing = await handshake_by_hand(raw3, client_ctx)
        obj.write(b"last")
        await raw3.send_all(outgoing.read())
        await trio.sleep(1)
        await raw3.send_eof()
        await trio.sleep(1)
        third = probes[2]
        assert third.events == ["made"]
        third.t.resume_reading()
        await lost(third)
    assert second.received == b"only"
    assert second.events == ["made", "data", "eof", "lost"] and second.lost_once[1] is None
    assert third.received == b"last"
    assert third.events == ["made", "data", "eof", "lost"] and third.lost_once[1] is None


# -- writing and closing ---------------------------------------------------------------


class Goodbye(Probe):
    """Writes ``words`` and closes as soon as it is made."""

    def __init__(self, words: bytes) -> None:
        super().__init__()
        self.words = words

    def connection_made(self, transport: idlekeeper.Transport) -> None:
        super().connection_made(transport)
        transport.write(self.words)
        transport.close()


@pytest.mark.parametrize("size", [5, 16 * 1024 * 1024])
async def test_close_sends_close_notify_after_the_queue(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, size: int
) -> None:
    """The client reads everything, then a clean end (a client that is not
    https-compatible raises on an end without close_notify). 16 MiB is more than
    the kernel takes at once: the writer is paused and resumed, and nothing is lost."""
    words = bytes(i % 251 for i in range(size))
    probes, factory = collecting(lambda: Goodbye(words))
    async with tls_engine(keeper, factory, server_ctx, high_water=256 * 1024) as (_, port):
        client = await tls_client(port, client_ctx)
        got = bytearray()
        with trio.fail_after(60):
            while chunk := await client.receive_some(1 << 16):
                got += chunk
        assert got == words
        await lost(probes[0])
        await client.aclose()
    assert probes[0].lost_once[1] is None
    if size > 256 * 1024:
        assert "pause" in probes[0].events and "resume" in probes[0].events


async def test_the_peers_close_notify_is_its_eof(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    probes, factory = collecting(lambda: Probe(keep_open_on_eof=True))
    async with tls_engine(keeper, factory, server_ctx) as (_, port):
        raw = await trio.open_tcp_stream(HOST, port)
        obj, incoming, outgoing = await handshake_by_hand(raw, client_ctx)
        obj.write(b"last")
        with pytest.raises(ssl.SSLWantReadError):
            obj.unwrap()  # close_notify, with the TCP connection left open
        await raw.send_all(outgoing.read())
        (probe,) = probes
        await until_events(probe, "eof")
        assert probe.received == b"last" and probe.events == ["made", "data", "eof"]
        probe.t.write(b"still writing")  # eof_received said: keep writing
        probe.t.close()
        with trio.fail_after(10):
            while chunk := await raw.receive_some():
                incoming.write(chunk)
        plain = b""
        with pytest.raises(ssl.SSLZeroReturnError):  # the server's close_notify, after its words
            while True:
                plain += obj.read()
        assert plain.endswith(b"still writing")
        await lost(probe)
    assert probe.lost_once[1] is None


async def until_events(probe: Probe, event: str) -> None:
    """Wait, letting the mock clock move (up to a minute), for ``event``."""
    for _ in range(6000):
        if event in probe.events:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"never happened: {event}")


class LastWords(Probe):
    def last_words(self, reason: Reason) -> bytes | None:
        return f"expired: {reason.value}".encode()


async def test_last_words_go_out_sealed_in_a_record(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    """The reaper's goodbye (MQTT 5's DISCONNECT 0x8D, say) is readable by a TLS peer:
    the transport seals it, synchronously, where a stream would need its task."""
    probes, factory = collecting(LastWords)
    async with tls_engine(keeper, factory, server_ctx, receive=4) as (_, port):
        client = await tls_client(port, client_ctx)
        await client.do_handshake()
        got = bytearray()
        with trio.fail_after(60):
            try:
                while chunk := await client.receive_some():
                    got += chunk
            except trio.BrokenResourceError:
                pass  # cut without close_notify: an expiry is an abort
        await lost(probes[0])
    assert got == b"expired: receive"
    assert isinstance(probes[0].lost_once[1], ExpiredError)


# -- certificates ------------------------------------------------------------------------


async def test_client_certificate_required_and_its_common_name(
    keeper: idlekeeper.Keeper, clock: MockClock, ca: trustme.CA, client_ctx: ssl.SSLContext
) -> None:
    ctx = requiring_certificates(ca)
    names: list[str | None] = []

    class Named(Upper):
        def connection_made(self, transport: idlekeeper.Transport) -> None:
            super().connection_made(transport)
            names.append(idlekeeper.peer_common_name(transport))

    with_cert = client_with_certificate(ca, "device-7")
    probes, factory = collecting(Named)
    async with tls_engine(keeper, factory, ctx) as (_, port):
        client = await tls_client(port, with_cert)
        await client.send_all(b"hi")
        assert await client.receive_some() == b"HI"
        await client.aclose()
        # Without a certificate: refused at the handshake, with an alert, before the protocol.
        bare = await tls_client(port, client_ctx)
        with pytest.raises(trio.BrokenResourceError) as refused:
            await bare.do_handshake()  # TLS 1.2
            await bare.send_all(b"hi")
            await bare.receive_some()  # TLS 1.3: the server's alert arrives after the client's Finished
        assert "CERTIFICATE_REQUIRED" in repr(refused.value.__cause__).upper()
        await trio.sleep(1)
    assert names == ["device-7"]
    assert probes[1].events == []
    assert keeper.stats.handshake_failures[HandshakeFailure.ERROR] == 1
    assert keeper.stats.handshakes == 1


def test_a_plain_transport_has_no_common_name() -> None:
    assert idlekeeper.peer_common_name(trio.testing.memory_stream_pair()[0]) is None


async def test_a_bad_handshake_timeout_is_refused_when_served(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext
) -> None:
    async with idlekeeper.open_engine(keeper) as engine:
        with pytest.raises(ValueError, match="handshake_timeout must be a positive number"):
            engine.serve([socket_listener()], Probe, ssl_context=server_ctx, handshake_timeout=0)
        assert engine.listeners == []


def socket_listener() -> Any:
    import socket

    return socket.create_server((HOST, 0))
