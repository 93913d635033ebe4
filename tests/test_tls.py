"""TLS on the keeper's terms (idlekeeper.tls): the handshake under its own deadline,
every other deadline after it, over real loopback sockets under MockClock. The
handshake-phase rules run on the dense engine's TLS transport too (the rest of it is
tests/test_engine_tls.py)."""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trustme
from trio.testing import MockClock

import idlekeeper
import idlekeeper.tls
from idlekeeper import HandshakeFailure, Reason

Handler = Callable[[idlekeeper.WatchedStream], Awaitable[object]]


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_ctx(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(ctx)
    return ctx


@pytest.fixture
def client_ctx(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


@asynccontextmanager
async def tls_server(
    keeper: idlekeeper.Keeper, handler: Handler, ctx: ssl.SSLContext, **options: Any
) -> AsyncIterator[int]:
    """serve_tcp with TLS on a free loopback port; yields the port."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(idlekeeper.serve_tcp, handler, 0, host="127.0.0.1", keeper=keeper, ssl_context=ctx, **options)
        )
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


def requiring_certificates(ca: trustme.CA) -> ssl.SSLContext:
    """A server context that requires a client certificate from ``ca``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(ctx)
    ca.configure_trust(ctx)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_with_certificate(ca: trustme.CA, common_name: str) -> ssl.SSLContext:
    """A client context that trusts ``ca`` and presents a certificate it issued for ``common_name``."""
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    ca.issue_cert(f"{common_name}.example", common_name=common_name).configure_cert(ctx)
    return ctx


ENGINES = ["streams", "dense"]
"""Where the handshake-phase rules are tested: serve_tcp's SSLStream, and the dense
engine's TLS transport (idlekeeper.tls_transport); they must not differ."""


class _UpperProtocol(idlekeeper.Protocol):
    """The dense engine's echo_upper; notes each connection made."""

    def __init__(self, made: list[int]) -> None:
        self.made = made
        self.transport: idlekeeper.Transport | None = None

    def connection_made(self, transport: idlekeeper.Transport) -> None:
        self.made.append(1)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data.upper())


@asynccontextmanager
async def tls_port(
    keeper: idlekeeper.Keeper, ctx: ssl.SSLContext, engine: str, made: list[int], **options: Any
) -> AsyncIterator[int]:
    """An upper-casing echo over TLS on ``engine``; ``made`` gets an entry per
    connection its handler or protocol saw (after a handshake)."""
    if engine == "streams":

        async def handler(conn: idlekeeper.WatchedStream) -> None:
            made.append(1)
            await echo_upper(conn)

        async with tls_server(keeper, handler, ctx, **options) as port:
            yield port
        return
    async with trio.open_nursery() as nursery:
        serve = partial(idlekeeper.serve_protocol, lambda: _UpperProtocol(made), 0, keeper=keeper, host="127.0.0.1")
        engine_: idlekeeper.Engine = await nursery.start(partial(serve, ssl_context=ctx, **options))
        yield engine_.listeners[0].getsockname()[1]
        nursery.cancel_scope.cancel()


async def read_until_closed(stream: trio.abc.Stream) -> float:
    """Drain ``stream``; the (mock) time at which the server closed it (within a minute)."""
    with trio.fail_after(60):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
    return trio.current_time()


def client_hello(client_ctx: ssl.SSLContext) -> bytes:
    """The bytes of a real ClientHello, as a client would send them first."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


async def echo_upper(conn: idlekeeper.WatchedStream) -> None:
    while data := await conn.receive_some():
        await conn.send_all(data.upper())


async def test_handshake_completes_and_the_handler_reads_plaintext(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    seen: list[tuple[float, float | None]] = []

    async def handler(conn: idlekeeper.WatchedStream) -> None:
        # The handshake deadline is gone; max_age's absolute deadline is back.
        seen.append((conn.deadline, conn.idle_timeout))
        await echo_upper(conn)

    async with tls_server(keeper, handler, server_ctx, idle=30, max_age=100, handshake_timeout=5) as port:
        start = trio.current_time()
        client = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), client_ctx, server_hostname="localhost")
        await client.send_all(b"hello over tls")
        assert await client.receive_some() == b"HELLO OVER TLS"
        await client.aclose()
    deadline, idle = seen[0]
    assert deadline == pytest.approx(start + 100)
    assert idle == 30
    assert keeper.stats.handshakes == 1
    assert sum(keeper.stats.handshake_failures.values()) == 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("close", [True, False])
async def test_half_a_client_hello_is_cut_at_the_handshake_deadline(
    keeper: idlekeeper.Keeper,
    clock: MockClock,
    server_ctx: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    caplog: pytest.LogCaptureFixture,
    close: bool,
    engine: str,
) -> None:
    caplog.set_level(logging.INFO, logger="idlekeeper.tls")
    handled: list[int] = []
    hello = client_hello(client_ctx)
    # A short idle timeout must not matter: only the handshake deadline runs.
    options: dict[str, Any] = {"idle": 1, "handshake_timeout": 7}
    if engine == "streams":
        options["close"] = close  # the dense engine always closes at an expiry
    async with tls_port(keeper, server_ctx, engine, handled, **options) as port:
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        accepted = trio.current_time()
        await raw.send_all(hello[: len(hello) // 2])
        closed_at = await read_until_closed(raw)
    assert 7 <= closed_at - accepted <= 7 + keeper.tick
    assert handled == []
    assert keeper.stats.handshake_failures[HandshakeFailure.TIMEOUT] == 1
    assert keeper.stats.expired[Reason.ABSOLUTE] == 1
    assert keeper.stats.handshakes == 0
    assert any("TLS handshake with 127.0.0.1" in r.message and "(timeout)" in r.message for r in caplog.records)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_trickled_client_hello_does_not_extend_the_deadline(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, engine: str
) -> None:
    hello = client_hello(client_ctx)

    async def trickle(raw: trio.SocketStream) -> None:
        with trio.move_on_after(60):
            for byte in hello[:-1]:
                await trio.sleep(1)
                await raw.send_all(bytes([byte]))

    async with tls_port(keeper, server_ctx, engine, [], handshake_timeout=5) as port:
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        accepted = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle, raw)
            closed_at = await read_until_closed(raw)
            nursery.cancel_scope.cancel()
    assert 5 <= closed_at - accepted <= 5 + keeper.tick
    assert keeper.stats.handshake_failures[HandshakeFailure.TIMEOUT] == 1


@pytest.mark.parametrize("engine", ENGINES)
async def test_garbage_is_closed_at_once_with_a_logged_reason(
    keeper: idlekeeper.Keeper,
    clock: MockClock,
    server_ctx: ssl.SSLContext,
    caplog: pytest.LogCaptureFixture,
    engine: str,
) -> None:
    caplog.set_level(logging.INFO, logger="idlekeeper.tls")
    handled: list[int] = []
    async with tls_port(keeper, server_ctx, engine, handled, handshake_timeout=10) as port:
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        sent_at = trio.current_time()
        await raw.send_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")  # plain HTTP to a TLS port
        closed_at = await read_until_closed(raw)
    assert closed_at - sent_at < keeper.tick  # known at once: no waiting for the deadline
    assert handled == []
    assert keeper.stats.handshake_failures[HandshakeFailure.ERROR] == 1
    assert keeper.stats.expired[Reason.ABSOLUTE] == 0
    (line,) = [r.message for r in caplog.records if "TLS handshake" in r.message]
    assert "(error)" in line and "127.0.0.1" in line
    assert "HTTP_REQUEST" in line.upper() or "WRONG_VERSION" in line.upper()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_client_that_hangs_up_mid_handshake_is_counted_as_closed(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, engine: str
) -> None:
    hello = client_hello(client_ctx)
    async with tls_port(keeper, server_ctx, engine, []) as port:
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        await raw.send_all(hello[:10])
        await raw.aclose()
        await trio.sleep(1)
    assert keeper.stats.handshake_failures[HandshakeFailure.CLOSED] == 1
    assert keeper.stats.expired[Reason.ABSOLUTE] == 0


async def test_idle_counts_from_the_end_of_a_slow_handshake(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    """A handshake slower than the idle timeout still completes (only its own deadline
    runs), and idle then counts from its end."""
    ended: list[float] = []

    async def handler(conn: idlekeeper.WatchedStream) -> None:
        ended.append(trio.current_time())
        await conn.receive_some()

    async with tls_server(keeper, handler, server_ctx, idle=2, handshake_timeout=10) as port:
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        accepted = trio.current_time()
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = client_ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
        with trio.fail_after(30):
            while True:
                try:
                    obj.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await raw.send_all(outgoing.read())
                    incoming.write(await raw.receive_some())
            await trio.sleep(5)  # the client's Finished, held back: 5 s > idle
            await raw.send_all(outgoing.read())
            closed_at = await read_until_closed(raw)
    assert ended and ended[0] - accepted == pytest.approx(5, abs=keeper.tick)
    assert 2 <= closed_at - ended[0] <= 2 + keeper.tick
    assert keeper.stats.expired[Reason.IDLE] == 1
    assert keeper.stats.handshakes == 1


async def test_stall_safety_sees_kernel_bytes_under_tls(
    keeper: idlekeeper.Keeper, clock: MockClock, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext
) -> None:
    """A server too busy to read (here: sleeping) does not drop a TLS peer whose
    record arrived in time: the keeper finds it unread in the kernel."""
    got: list[bytes] = []

    async def busy(conn: idlekeeper.WatchedStream) -> None:
        await trio.sleep(10)  # stalled, with an idle timeout of 3
        got.append(bytes(await conn.receive_some()))
        await conn.send_all(b"ok")

    async with tls_server(keeper, busy, server_ctx, idle=3) as port:
        client = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), client_ctx, server_hostname="localhost")
        await client.do_handshake()
        await trio.sleep(1)
        await client.send_all(b"ping")
        assert await client.receive_some() == b"ok"
        await client.aclose()
    assert got == [b"ping"]
    assert keeper.stats.stall_saves >= 1
    assert keeper.stats.expired[Reason.IDLE] == 0


async def test_client_certificate_required_and_its_common_name(
    keeper: idlekeeper.Keeper, clock: MockClock, ca: trustme.CA, client_ctx: ssl.SSLContext
) -> None:
    ctx = requiring_certificates(ca)
    names: list[str | None] = []

    async def handler(conn: idlekeeper.WatchedStream) -> None:
        names.append(idlekeeper.peer_common_name(conn))
        await echo_upper(conn)

    with_cert = client_with_certificate(ca, "device-7")
    async with tls_server(keeper, handler, ctx) as port:
        client = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), with_cert, server_hostname="localhost")
        await client.send_all(b"hi")
        assert await client.receive_some() == b"HI"
        await client.aclose()
        # Without a certificate: refused at the handshake, before the handler.
        bare = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), client_ctx, server_hostname="localhost")
        with pytest.raises(trio.BrokenResourceError):
            await bare.do_handshake()  # TLS 1.2
            await bare.send_all(b"hi")
            await bare.receive_some()  # TLS 1.3: the server's alert arrives after the client's Finished
        await trio.sleep(1)
    assert names == ["device-7"]
    assert keeper.stats.handshake_failures[HandshakeFailure.ERROR] == 1
    assert keeper.stats.handshakes == 1


def test_peer_common_name_of_a_plain_stream_is_none() -> None:
    assert idlekeeper.peer_common_name(trio.testing.memory_stream_pair()[0]) is None


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
async def test_a_bad_handshake_timeout_is_refused_at_start_not_per_connection(
    clock: MockClock, server_ctx: ssl.SSLContext, seconds: float
) -> None:
    async with idlekeeper.open_keeper(tick=0.05) as keeper:
        serve = partial(idlekeeper.serve_tcp, echo_upper, 0, host="127.0.0.1", keeper=keeper, ssl_context=server_ctx)
        refused = pytest.RaisesGroup(
            pytest.RaisesExc(ValueError, match="handshake_timeout must be a positive number"), flatten_subgroups=True
        )
        with refused:
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(serve, handshake_timeout=seconds))


def test_the_first_common_name_is_the_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    # A subject "CN=bob, CN=alice" (two RDNs, as getpeercert() lists them): Mosquitto's
    # use_identity_as_username takes the first, and so does the server (issue 33).
    subject = ((("commonName", "bob"),), (("organizationName", "x"),), (("commonName", "alice"),))
    monkeypatch.setattr(idlekeeper.tls, "peer_certificate", lambda stream: {"subject": subject})
    assert idlekeeper.peer_common_name(trio.testing.memory_stream_pair()[0]) == "bob"
    monkeypatch.setattr(idlekeeper.tls, "peer_certificate", lambda stream: {"subject": ((("countryName", "FR"),),)})
    assert idlekeeper.peer_common_name(trio.testing.memory_stream_pair()[0]) is None
