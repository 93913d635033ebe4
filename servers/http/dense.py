"""The dense driver: HTTP/1.1 on idlekeeper's dense engine, no task per connection.

Each connection is an :class:`HttpProtocol`: the engine calls it with the bytes it
reads, it feeds them to h11, and a request head that comes complete is handed to an
:class:`~.exchange.Exchange` running in a task of its own, only while the app has the
request. An idle keep-alive connection is a socket, a transport and this object.

The deadlines are the transport's (the same keeper, wheel and guarantees as a watched
stream), set per phase as in the streams driver: ``idle_timeout`` between requests,
``send_timeout`` while a response is queued. The two that are answered 408 rather
than cut silently, the header timeout (absolute, from a head's first byte) and the
body timeout (between two reads, while the app waits for the body), are keeper timers
instead, since an expiry closes the socket at once: the timer writes the 408 and
starts a lingering close, and the transport's absolute deadline ends that linger.
"""

from __future__ import annotations

import socket

import h11
import trio

import idlekeeper

from ..ws.upgrade import is_upgrade
from .core import BACKGROUND_PER_CONNECTION, Phase, address
from .delivery import KERNEL_BACKLOG, DeliveryWatch, kernel_backlog
from .dense_channel import LINGER_LIMIT, DenseChannel
from .dense_server import DenseHttpServer, Runner
from .dense_ws import open_websocket
from .exchange import Exchange, Outcome
from .head import RequestHead, bad_head_status, head_refusal, header_list, make_scope
from .quickhead import QuickHead, quick_head, replay
from .websocket import WebSocketExchange
from .whole import HOOKS

__all__ = ["HttpProtocol", "run_dense"]

class HttpProtocol(DenseChannel):
    """One HTTP connection on the dense engine: the engine's callbacks, its request
    heads, and its exchanges, one after another (the exchange's side of it, and the
    server's own answers, are :class:`~.dense_channel.DenseChannel`'s)."""

    __slots__ = (
        "h11",
        "inbuf",
        "requests",
        "started",
        "runner",
        "peer",
        "local",
        "delivery",
        "clear",
        "cancel_armed",
        "background",
        "held",
        "ws",
    )

    def __init__(self, server: DenseHttpServer) -> None:
        self.server = server
        # h11 is made when a request needs it (see .quickhead); until then what came
        # and is not yet a request waits here.
        self.h11: h11.Connection | None = None if HOOKS else self._new_parser()
        self.inbuf = b""
        self.phase = Phase.IDLE
        self.requests = 0
        self.started = 0.0
        self.exchange: Exchange | None = None
        self.runner: Runner | None = None
        self.timer: idlekeeper.TimerHandle | None = None
        self.delivery: DeliveryWatch | None = None  # while the kernel holds too much (see _hold)
        self.written = 0  # bytes of responses given to the transport
        self.clear = 0  # bytes written when the kernel was last seen holding few
        self.peer: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.lingered = -1  # bytes dropped while lingering; -1: not lingering
        self.gone = False
        self.peer_eof = False  # the client half-closed while the app had its request
        self.cancel_armed = False
        self.background = 0
        """App calls of this connection's that go on after their response (see _move_on)."""
        self.held = False
        """The exchange settled at the bound of background calls: its connection waits for its app."""
        self.ws: WebSocketExchange | None = None
        """The WebSocket this connection switched to, if it did."""
        self._readable: trio.Event | None = None
        self._writable: trio.Event | None = None
        self._gone_event: trio.Event | None = None

    # -- the engine's callbacks ----------------------------------------------------------

    def connection_made(self, transport: idlekeeper.Transport) -> None:
        self.t = transport
        server = self.server
        self.started = trio.current_time()
        server.connections[self] = None
        if (len(server.connections) > server.config.max_connections or server.closing) and not server.make_room(self):
            server.refused_total += 1
            self.refuse(503, "", log=False)

    def data_received(self, data: bytes) -> None:
        if self.lingered >= 0:
            self.lingered += len(data)
            if self.lingered > LINGER_LIMIT:
                self.t.abort()
            return
        ws = self.ws
        if ws is not None:
            ws.feed(data)
            return
        h = self.h11
        if h is None:
            self.inbuf = self.inbuf + data if self.inbuf else data
        else:
            h.receive_data(data)
        exchange = self.exchange
        if exchange is None:
            if self.delivery is None:
                self._heads()
                return
        elif exchange.finished:
            self._move_on()  # the next request came while the app goes on after its response
        else:
            self._wake_reader()
        h = self.h11
        if len(self.inbuf if h is None else h.trailing_data[0]) > self.server.config.max_header_size:
            # Nobody has taken what came (a body the app is slow to read, requests
            # pipelined behind this one or behind a hold, see _hold): read no more
            # until it is.
            self.t.pause_reading()

    def eof_received(self) -> bool:
        if self.lingered >= 0:
            return False  # the client read the answer and closed: close too
        if self.ws is not None:
            self.ws.feed(b"")
            return True  # the exchange closes once its answer is out
        self.parser().receive_data(b"")
        if self.exchange is None:
            self._heads()
        else:
            # The client is done sending while the app has its request: as nginx (and
            # uvicorn) read it, the client gave up. The app hears http.disconnect, and
            # may still answer within the grace; then it is cancelled.
            self._wake_reader()
            self.peer_eof = True
            if self._gone_event is not None:
                self._gone_event.set()
            self._cancel_app_later()
            if self.exchange.finished:
                self._move_on()
        return True  # a response may still be on its way; we close when it is out

    def pause_writing(self) -> None:
        self._writable = trio.Event()

    def resume_writing(self) -> None:
        if self._writable is not None:
            self._writable.set()
            self._writable = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self.gone = True
        self.phase = Phase.DONE
        self._cancel_timer()
        if self.delivery is not None:
            self.delivery.cancel()
            self.delivery = None
        self.server.connections.pop(self, None)
        if self.ws is not None:
            self.ws.lost(exc.reason if isinstance(exc, idlekeeper.ExpiredError) else None)
        for event in (self._readable, self._writable, self._gone_event):
            if event is not None:
                event.set()
        # The app hears http.disconnect at once; one that goes on regardless is
        # cancelled after the grace a shutdown gives it.
        self._cancel_app_later()

    def last_words(self, reason: idlekeeper.Reason) -> bytes | None:
        """A WebSocket's close frame, just before a ping timeout cuts it."""
        return None if self.ws is None else self.ws.last_words(reason)

    def _cancel_app_later(self) -> None:
        runner, exchange = self.runner, self.exchange
        # An app whose response is complete runs on, whoever left: its work is its own
        # (a background task), as uvicorn lets it; a shutdown gives it the grace.
        if runner is not None and exchange is not None and not exchange.complete and not self.cancel_armed:
            self.cancel_armed = True
            self.server.keeper.call_later(self.server.config.grace, lambda: runner.cancel(exchange))

    # -- request heads ---------------------------------------------------------------------

    def _heads(self) -> None:
        """Between requests: parse what came; start an exchange for a complete head."""
        if self.h11 is None:
            buf = self.inbuf
            if not buf:
                return
            head = quick_head(buf)
            if head is not None:
                self.inbuf = buf[head.size :]
                self._request(head, head.headers, head)
                return
        # Not plain, not complete yet, or h11 has the connection already: h11 reads it.
        h = self.parser()
        try:
            event = h.next_event()
        except h11.RemoteProtocolError as exc:
            self.refuse(bad_head_status(exc), f"bad request head: {exc}")
            return
        t = self.t
        if event is h11.NEED_DATA:
            if self.phase is Phase.IDLE and h.trailing_data[0]:
                # A head has begun and is not complete: from now on it has a deadline
                # that more (trickled) bytes do not extend.
                self.phase = Phase.HEAD
                t.idle_timeout = None
                self.timer = self.server.keeper.call_later(self.server.config.header_timeout, self._too_slow)
            return
        if isinstance(event, h11.Request):
            self._request(event, header_list(event), None)
            return
        if isinstance(event, h11.ConnectionClosed):
            t.close()
        # PAUSED: a protocol switch we do not make; nothing more to read here.

    def _request(self, event: RequestHead, headers: list[tuple[bytes, bytes]], quick: QuickHead | None) -> None:
        server = self.server
        cfg = server.config
        self._cancel_timer()
        t = self.t
        if self.phase is Phase.IDLE:
            t.idle_timeout = None
        refusal = head_refusal(event, headers, cfg.max_header_size, cfg.max_body_size, websockets=cfg.websockets)
        if refusal is not None:
            self.refuse(*refusal)
            return
        self.phase = Phase.APP
        self.requests += 1
        if self.requests == 1:
            sock = t.socket
            self.peer = address(sock, "getpeername")
            self.local = address(sock, "getsockname")
        scope = make_scope(
            event, headers, scheme=server.scheme, client=self.peer, server=self.local, state=server.state
        )
        if quick is None and cfg.websockets and is_upgrade(headers):
            self.ws = open_websocket(self, event, headers, scope)
            if self.ws is not None:
                server.exchange_started()
                server.dispatch(self)
            return
        self.exchange = Exchange(self, scope, max_body_size=cfg.max_body_size, must_close=self._must_close, quick=quick)
        server.exchange_started()
        server.dispatch(self)

    def _new_parser(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self.server.config.max_header_size)

    def parser(self) -> h11.Connection:
        """This connection's h11 state, made on first need: told of the quick request
        the app has (if any), then given what came after it."""
        h = self.h11
        if h is None:
            h = self.h11 = self._new_parser()
            exchange = self.exchange
            if exchange is not None and exchange.quick is not None:
                replay(h, exchange.quick)
            if self.inbuf:
                h.receive_data(self.inbuf)
                self.inbuf = b""
        return h

    def _must_close(self) -> bool:
        return self.server.must_close(self.started, self.requests)

    async def run_exchange(self, runner: Runner) -> None:
        """Run the exchange just started, in ``runner``'s task, and go on with the
        connection as it says. A cancellation (the app outlived its client by the
        grace, or the server is cut) propagates: it ends the runner too."""
        server = self.server
        if self.ws is not None:
            try:
                await self.ws.run(server.app, runner.scope)
            finally:
                server.exchange_ended()
            return
        exchange = self.exchange
        assert exchange is not None
        self.runner = runner
        runner.exchange = exchange
        try:
            await exchange.call(server.app)
        finally:
            runner.exchange = None
            server.exchange_ended()
            if exchange.detached:
                self.background -= 1
                server.background -= 1
        if exchange.detached:
            return  # moved on meanwhile (see _move_on)
        # after_response's steps, inline: a frame and a call less on every request's path.
        try:
            after = await exchange.finish()
        finally:
            self.runner = None
            self.cancel_armed = self.held = False
            self.exchange = None
        self._go_on(exchange, after)

    def settled(self) -> None:
        """The exchange's response is complete, or cannot be (see
        :meth:`.exchange.Channel.settled`); the app may return now or go on (a
        background task). Most return at once, and the connection's steps follow in
        their runner (run_exchange), at no cost here. Where waiting for that would keep
        something waiting (a close to make, a request already read, a refusal or a cut
        to answer), the connection moves on now; else the next read moves it on, if
        the app is still running then."""
        exchange = self.exchange
        if exchange is None or self.gone:
            return
        h = self.h11
        if (
            not exchange.complete
            or exchange.closing
            or (h is not None and (h.our_state is h11.MUST_CLOSE or h.trailing_data[0]))
            or self.inbuf
            or self.peer_eof
        ):
            self._move_on()

    def _move_on(self) -> None:
        """The exchange has settled and its app goes on (a background task after its
        response, or work the client left behind): the connection moves on now, in a
        runner of its own, unless this connection or the server holds as many such
        calls as it may, when it waits for the app to return (as every connection
        did before). A call the client left mid-request is cancelled after the grace."""
        exchange, runner, server = self.exchange, self.runner, self.server
        if exchange is None or runner is None or self.gone or exchange.detached or exchange.returned:
            return
        if self.background >= BACKGROUND_PER_CONNECTION or server.background >= server.config.max_background:
            if not self.held:  # counted once an exchange
                self.held = True
                server.background_waits += 1
            return
        exchange.detached = True
        self.background += 1
        server.background += 1
        self.runner = None
        if not exchange.complete:
            server.keeper.call_later(server.config.grace, lambda: runner.cancel(exchange))
        server.dispatch(_AfterResponse(self, exchange))

    async def after_response(self, exchange: Exchange) -> None:
        """The connection's steps once ``exchange`` settled: the rest of the request
        body read, then the next request, or the close."""
        try:
            after = await exchange.finish()
        finally:
            self._released()
        self._go_on(exchange, after)

    def _released(self) -> None:
        self.runner = None
        self.cancel_armed = False
        self.held = False
        self.exchange = None

    def _go_on(self, exchange: Exchange, after: Outcome) -> None:
        """Act on ``exchange``'s outcome: take the next request, refuse, cut or close."""
        server = self.server
        if self.gone or self.lingered >= 0:
            return
        t = self.t
        if after is Outcome.NEXT and not server.closing:
            self.phase = Phase.IDLE
            h = self.h11
            if h is not None and HOOKS and h.trailing_data == (b"", False):
                self.h11 = None  # a new cycle with nothing buffered: quick heads again
            t.resume_reading()
            if not self._hold():
                t.idle_timeout = server.config.keep_alive_timeout
                self._heads()  # a request pipelined behind this one is already here
        elif after is Outcome.REFUSE:
            self.refuse(exchange.refusal, exchange.refusal_reason)
        elif after is Outcome.ABORT:
            t.abort()
        else:
            self.phase = Phase.DONE
            t.close()

    # -- responses the kernel holds -----------------------------------------------------

    def _hold(self) -> bool:
        """After a response: whether the kernel still holds too much of what was
        written for the next request to be taken. Then the connection is held: no
        request is parsed (pipelined ones wait, read up to a bound), and a
        :class:`~.delivery.DeliveryWatch` watches the delivery until the client catches
        up, or cuts the connection after a send timeout without progress (the
        transport's own timeout only sees its own queue)."""
        if self.written - self.clear <= KERNEL_BACKLOG:
            return False  # the kernel cannot hold more than was written since it held few
        backlog = kernel_backlog(self.t)
        if backlog <= KERNEL_BACKLOG:
            self.clear = self.written - backlog
            return False
        self.delivery = DeliveryWatch(self, backlog)
        self.t.idle_timeout = None  # sending, as far as the client is concerned
        return True

    def caught_up(self, acknowledged: int) -> None:
        """The delivery watch's release: the kernel holds little again
        (``acknowledged`` bytes delivered), so requests are taken again."""
        self.clear = acknowledged
        if self.exchange is None and self.phase is Phase.IDLE:
            self.t.idle_timeout = self.server.config.keep_alive_timeout
            self.t.resume_reading()
            self._heads()

class _AfterResponse:
    """A connection's steps after a response whose app goes on, for a runner to take."""

    __slots__ = ("conn", "exchange")

    def __init__(self, conn: HttpProtocol, exchange: Exchange) -> None:
        self.conn = conn
        self.exchange = exchange

    async def run_exchange(self, runner: Runner) -> None:
        await self.conn.after_response(self.exchange)


async def run_dense(
    server: DenseHttpServer,
    listeners: list[trio.SocketListener],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``server``'s app on ``listeners`` with a dense engine until cancelled;
    ``nursery.start`` returns once it listens (``server.port`` is set)."""
    config = server.config
    # Each request is a task's: the engine is rarely alone in trio's batch, so its own
    # waits would seldom serve, and their instrument costs every pass of trio's loop.
    opening = idlekeeper.open_engine(server.keeper, direct_wait=False)
    async with opening as engine, trio.open_nursery() as exchanges:
        server.listening = engine
        server.exchanges = exchanges
        tls = config.tls
        socks = engine.serve(
            listeners,
            lambda: HttpProtocol(server),
            idle=config.keep_alive_timeout,
            send=config.send_timeout,
            # HTTPS: the handshake first, under its own deadline; the request's follow.
            ssl_context=None if tls is None else tls.context(),
            handshake_timeout=idlekeeper.DEFAULT_HANDSHAKE_TIMEOUT if tls is None else tls.handshake_timeout,
        )
        server.port = socks[0].getsockname()[1] if socks and socks[0].family != socket.AF_UNIX else 0
        task_status.started()
        await trio.sleep_forever()
