"""The streams driver: a task per connection over a watched trio stream.

The way trio code is written, and the one that speaks TLS (``trio.SSLStream``). Each
connection's task reads request heads, hands each request to an
:class:`~.exchange.Exchange` whose app runs in a task of its own, and acts on its
outcome once it has settled (the response complete: the app may go on); the deadlines
are the watched stream's, changed with the phase (see :mod:`.server`).
"""

from __future__ import annotations

import math

import h11
import trio

import idlekeeper
from idlekeeper import Reason

from ..listeners import port_of
from ..ws.upgrade import Offer, denial_head, is_upgrade, read_offer
from .asgi import ASGIApp, Scope
from .core import BACKGROUND_PER_CONNECTION, TIMEOUT_LINGER, HttpConfig, HttpServer, Phase, address
from .errors import log_refusal, send_error
from .exchange import ClientGone, Exchange, Outcome
from .head import bad_head_status, head_refusal, header_list, make_scope
from .lifespan import Lifespan
from .streams_ws import StreamPipe, run_websocket
from .websocket import WebSocketExchange, after_upgrade, websocket_scope

__all__ = ["StreamsHttpServer", "run_streams"]


class _StreamConn:
    """One connection of the streams driver, and the :class:`~.exchange.Channel` its
    exchanges read and write through."""

    __slots__ = ("h11", "phase", "requests", "started", "stream", "config", "ws", "background", "exchange")

    def __init__(self, stream: idlekeeper.WatchedStream, config: HttpConfig) -> None:
        self.stream = stream
        self.config = config
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=config.max_header_size)
        self.phase = Phase.IDLE
        self.requests = 0
        self.started = trio.current_time()
        self.ws: WebSocketExchange | None = None
        self.background = 0
        """App calls of this connection's that go on after their response."""
        self.exchange: Exchange | None = None
        """The request the connection serves now, if any."""

    def parser(self) -> h11.Connection:
        """h11 reads every request here (quick heads are the dense driver's)."""
        return self.h11

    async def more(self) -> None:
        """Read more of the request body, under the body timeout."""
        stream = self.stream
        self.phase = Phase.BODY  # if the body timeout fires now, the answer is 408
        stream.receive_timeout = self.config.body_timeout
        try:
            data = await stream.receive_some(16384)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone(f"client went away mid-body: {exc!r}") from exc
        finally:
            stream.receive_timeout = None
            self.phase = Phase.APP
        self.h11.receive_data(bytes(data))

    async def write(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone(repr(exc)) from exc

    def settled(self) -> None:
        """Nothing to do here: the connection's task awaits the exchange's settling."""

    async def disconnected(self) -> None:
        # Reading is the only way a stream hears of a disconnect; what is read (a
        # pipelined next request) waits in h11's buffer, up to a bound.
        h = self.h11
        try:
            while len(h.trailing_data[0]) < self.config.max_header_size:
                data = await self.stream.receive_some(16384)
                if not data:
                    return
                h.receive_data(bytes(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        await trio.sleep_forever()


class StreamsHttpServer(HttpServer):
    """The streams driver: a task per connection over a watched trio stream (and TLS)."""

    def __init__(
        self, app: ASGIApp, config: HttpConfig, keeper: idlekeeper.Keeper, lifespan: Lifespan | None = None
    ) -> None:
        super().__init__(app, config, keeper, lifespan)
        self.accepting = trio.CancelScope()
        """Cancelled to stop accepting new connections."""
        self.apps: trio.Nursery
        """Where the apps run, outside their connections' cancel scopes (set by
        :func:`run_streams`)."""
        self.calls: dict[trio.CancelScope, None] = {}
        """The scopes of the HTTP app calls running now (cut at the end of a shutdown)."""

    @property
    def engine(self) -> str:
        return "streams"

    def _stop_accepting(self) -> None:
        self.accepting.cancel()

    def _close_idle(self) -> None:
        for conn in list(self.connections):
            if conn.ws is not None:
                conn.ws.shut()  # close 1001: its app ends when the client answers
            elif conn.phase is Phase.IDLE:
                conn.stream.cancel_scope.cancel()

    def _busy(self) -> bool:
        return bool(self.connections)

    def _cut_all(self) -> None:
        for conn in list(self.connections):
            conn.stream.cancel_scope.cancel()
            if conn.ws is not None:
                conn.ws.cut()
        for scope in list(self.calls):
            scope.cancel()

    def _with_app(self, conn: _StreamConn) -> bool:
        return conn.phase is Phase.APP or conn.phase is Phase.BODY

    def _evict(self, conn: _StreamConn) -> None:
        conn.stream.cancel_scope.cancel()

    async def handle(self, stream: idlekeeper.WatchedStream) -> None:
        """One connection, from accept to close."""
        cfg = self.config
        if (len(self.connections) >= cfg.max_connections or self.closing) and not self.make_room():
            self.refused_total += 1
            await send_error(stream, 503)
            return
        conn = _StreamConn(stream, cfg)
        self.connections[conn] = None
        try:
            await self._serve(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ClientGone):
            pass
        finally:
            self.connections.pop(conn, None)
            exchange = conn.exchange
            if (
                stream.expired
                and stream.reason in (Reason.ABSOLUTE, Reason.RECEIVE)
                and conn.phase in (Phase.HEAD, Phase.BODY)
                and (exchange is None or not exchange.head_sent)  # else it would land inside the response
            ):
                # The client was too slow to send its request: answer 408, briefly,
                # from a shielded scope (the watch's own scope has been cancelled).
                # A short linger: a slowloris must not keep its socket a second longer.
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await send_error(stream, 408, linger_for=TIMEOUT_LINGER)

    async def _next(self, conn: _StreamConn) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        h = conn.h11
        stream = conn.stream
        while True:
            event = h.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await stream.receive_some(16384)
            h.receive_data(bytes(data))
            if data and conn.phase is Phase.IDLE:
                conn.phase = Phase.HEAD
                event = h.next_event()
                if event is not h11.NEED_DATA:
                    return event  # the whole head in one read: no head deadline needed
                # A head has begun and is not complete: from now on it has a deadline
                # that more (trickled) bytes do not extend.
                stream.idle_timeout = None
                stream.deadline = trio.current_time() + self.config.header_timeout

    async def _serve(self, conn: _StreamConn) -> None:
        cfg = self.config
        stream = conn.stream
        # The send deadline only runs while a response is being written, so it is
        # set once; the other deadlines change with the phase.
        stream.send_timeout = cfg.send_timeout
        client = address(stream.socket, "getpeername")
        local = address(stream.socket, "getsockname")
        while True:
            conn.phase = Phase.IDLE
            stream.idle_timeout = cfg.keep_alive_timeout
            try:
                event = await self._next(conn)
            except h11.RemoteProtocolError as exc:
                await _refuse(stream, bad_head_status(exc), f"bad request head: {exc}")
                return
            if not isinstance(event, h11.Request):
                return  # ConnectionClosed, or PAUSED after a protocol switch we do not do
            if stream.deadline != math.inf:
                stream.deadline = None
            stream.idle_timeout = None
            headers = header_list(event)
            refusal = head_refusal(event, headers, cfg.max_header_size, cfg.max_body_size, websockets=cfg.websockets)
            if refusal is not None:
                await _refuse(stream, *refusal)
                return
            conn.requests += 1
            conn.phase = Phase.APP
            scope = make_scope(event, headers, scheme=self.scheme, client=client, server=local, state=self.state)
            if cfg.websockets and is_upgrade(headers):
                await self._websocket(conn, event, headers, scope)
                return
            exchange = Exchange(
                conn,
                scope,
                max_body_size=cfg.max_body_size,
                must_close=lambda: self.must_close(conn.started, conn.requests),
            )
            conn.exchange = exchange
            outcome = await self._exchange(conn, exchange)
            conn.exchange = None
            if outcome is Outcome.REFUSE:
                await _refuse(stream, exchange.refusal, exchange.refusal_reason)
                return
            if outcome is not Outcome.NEXT:
                return

    async def _exchange(self, conn: _StreamConn, exchange: Exchange) -> Outcome:
        """Run ``exchange``'s app in a task of its own; once the exchange settles, the
        connection goes on (the rest of the body read, then the next request or the
        close) while the app may go on (a background task), within the bounds: past
        them, the connection waits for the app to return. An app the client left
        mid-request is cancelled after the grace."""
        self.exchange_started()
        scope = trio.CancelScope()
        self.apps.start_soon(self._call, conn, exchange, scope)
        try:
            await exchange.settle()
        finally:
            if not exchange.finished:
                # The connection's watch expired (a body or send timeout) or the server
                # is cut: the app's reads and writes on it end with it, as they did when
                # the app ran in this task.
                scope.cancel()
        if not exchange.returned:
            if not exchange.complete:
                self.keeper.call_later(self.config.grace, scope.cancel)
            if conn.background >= BACKGROUND_PER_CONNECTION or self.background >= self.config.max_background:
                self.background_waits += 1
                await exchange.app_returned()
            else:
                exchange.detached = True
                conn.background += 1
                self.background += 1
        return await exchange.finish()

    async def _call(self, conn: _StreamConn, exchange: Exchange, scope: trio.CancelScope) -> None:
        self.calls[scope] = None
        try:
            with scope:
                await exchange.call(self.app)
        finally:
            del self.calls[scope]
            self.exchange_ended()
            if exchange.detached:
                conn.background -= 1
                self.background -= 1

    async def _websocket(
        self, conn: _StreamConn, event: h11.Request, headers: list[tuple[bytes, bytes]], scope: Scope
    ) -> None:
        offer = read_offer(event.method, event.http_version, headers)
        stream = conn.stream
        if not isinstance(offer, Offer):
            status, why, extra = offer
            log_refusal(status, why)
            await stream.send_all(denial_head(status, extra, 0))
            return
        pipe = StreamPipe(stream)
        exchange = WebSocketExchange(
            pipe, websocket_scope(scope, offer), offer, self.config, self.keeper, after_upgrade(conn.h11)
        )
        conn.ws = exchange
        self.exchange_started()
        try:
            await run_websocket(exchange, pipe, self.app, self.apps)
        finally:
            self.exchange_ended()


async def _refuse(stream: idlekeeper.WatchedStream, status: int, why: str) -> None:
    log_refusal(status, why)
    await send_error(stream, status)


async def run_streams(
    server: StreamsHttpServer,
    listeners: list[trio.SocketListener],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``server``'s app on ``listeners`` with a task per connection until
    cancelled; ``nursery.start`` returns once it listens (``server.port`` is set)."""
    async with trio.open_nursery() as nursery:
        server.apps = nursery
        server.port = port_of(listeners)
        bound = listeners

        tls = server.config.tls
        # One context per worker: its session cache and loaded certificate are shared.
        ssl_context = None if tls is None else tls.context()

        async def accept() -> None:
            with server.accepting:
                await idlekeeper.serve_listeners(
                    server.handle,
                    bound,
                    keeper=server.keeper,
                    close=False,
                    handler_nursery=nursery,
                    ssl_context=ssl_context,
                    # HTTP frames its own messages, and clients often close without a
                    # close_notify: an EOF is an EOF (trio's advice for HTTPS).
                    https_compatible=True,
                    handshake_timeout=idlekeeper.DEFAULT_HANDSHAKE_TIMEOUT if tls is None else tls.handshake_timeout,
                )
            for listener in bound:
                await listener.aclose()

        nursery.start_soon(accept)
        task_status.started()
