"""An HTTP/1.1 server on h11 and trio, with nginx/HAProxy-grade timeouts kept by idlekeeper.

One connection is one plain loop over h11 events. Its deadlines change with the
phase, declared once per phase on the watched stream:

====================  ==========================================  =====================
phase                 deadline                                    on expiry
====================  ==========================================  =====================
waiting for request   ``keep_alive_timeout`` of idleness (also    close silently
                      from accept until the first byte)
request head          absolute: ``header_timeout`` from the       408, then close
                      head's first byte; trickling does not help
request body          ``body_timeout`` between two reads          408, then close
response              ``send_timeout`` without write progress     close
====================  ==========================================  =====================

``max_connection_age`` and ``max_requests`` end a connection politely: the next
response carries ``Connection: close``.

With ``config.tls`` the server speaks HTTPS: the TLS handshake comes before all of
the above, under ``tls.handshake_timeout`` from accept (see :mod:`idlekeeper.tls`),
and every phase's deadline then works as over plain TCP.

Requests whose framing is ambiguous (RFC 9112 §6.3: ``Content-Length`` beside
``Transfer-Encoding``, differing lengths, a last coding other than chunked) get 400,
any major version but 1 gets 505, and a malformed chunked body gets 400 whether or
not the app read it; each is logged on one line at INFO and closes its connection
only. ``Expect: 100-continue`` is answered when the app first reads the body.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from functools import partial

import h11
import trio

import idlekeeper
from idlekeeper import Reason

from ..config import WorkerConfig
from ..listeners import open_listeners, port_of
from ..prometheus import Families, Metric
from .app import App, BodyTooLarge, Request, Response
from .errors import send_error

__all__ = ["ClientGone", "HttpConfig", "HttpServer", "serve_http"]

logger = logging.getLogger("servers.http")

TIMEOUT_LINGER = 0.25
"""Seconds a connection cut for a header or body timeout lingers after its 408:
enough for the bytes in flight to drain, not enough to be worth attacking."""


class ClientGone(trio.BrokenResourceError):
    """The client reset or closed its connection while the app was reading the body.

    Raised through the app's body iterator so that the server can tell it from an
    error of the app's own (which is a 500 and a traceback); anywhere else it ends
    the connection quietly, as any broken stream does.
    """


@dataclass
class HttpConfig(WorkerConfig):
    """Timeouts and limits. The CLI fills it in; the README compares the defaults."""

    port: int = 8080
    keep_alive_timeout: float = 15.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    send_timeout: float = 30.0
    max_connection_age: float | None = None
    max_requests: int | None = None
    max_header_size: int = 16 * 1024
    max_body_size: int = 16 * 1024 * 1024
    max_connections: int = 16_000
    grace: float = 10.0


class _Phase:
    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    APP = "app"
    SEND = "send"


class _Conn:
    __slots__ = ("h11", "phase", "requests", "started", "stream")

    def __init__(self, stream: idlekeeper.WatchedStream, max_header: int) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=max_header)
        self.phase = _Phase.IDLE
        self.requests = 0
        self.started = trio.current_time()


class HttpServer:
    """Serves an :data:`~servers.http.app.App` on watched connections."""

    def __init__(self, app: App, config: HttpConfig, keeper: idlekeeper.Keeper) -> None:
        self.app = app
        self.config = config
        self.keeper = keeper
        self.connections: set[_Conn] = set()
        self.closing = False
        self.requests_total = 0
        self.refused_total = 0
        self.port = 0
        """The port it listens on (read it after ``nursery.start``)."""
        self.accepting = trio.CancelScope()
        """Cancelled to stop accepting new connections."""

    async def handle(self, stream: idlekeeper.WatchedStream) -> None:
        """One connection, from accept to close."""
        cfg = self.config
        if len(self.connections) >= cfg.max_connections or self.closing:
            self.refused_total += 1
            await send_error(stream, 503)
            return
        conn = _Conn(stream, cfg.max_header_size)
        self.connections.add(conn)
        try:
            await self._serve(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.connections.discard(conn)
            if (
                stream.expired
                and stream.reason in (Reason.ABSOLUTE, Reason.RECEIVE)
                and conn.phase
                in (
                    _Phase.HEAD,
                    _Phase.BODY,
                )
            ):
                # The client was too slow to send its request: answer 408, briefly,
                # from a shielded scope (the watch's own scope has been cancelled).
                # A short linger: a slowloris must not keep its socket a second longer.
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await send_error(stream, 408, linger_for=TIMEOUT_LINGER)

    async def _next(self, conn: _Conn) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        h = conn.h11
        stream = conn.stream
        while True:
            event = h.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await stream.receive_some(16384)
            h.receive_data(bytes(data))
            if data and conn.phase is _Phase.IDLE:
                conn.phase = _Phase.HEAD
                event = h.next_event()
                if event is not h11.NEED_DATA:
                    return event  # the whole head in one read: no head deadline needed
                # A head has begun and is not complete: from now on it has a deadline
                # that more (trickled) bytes do not extend.
                stream.idle_timeout = None
                stream.deadline = trio.current_time() + self.config.header_timeout

    async def _serve(self, conn: _Conn) -> None:
        cfg = self.config
        stream = conn.stream
        h = conn.h11
        # The send deadline only runs while a response is being written, so it is
        # set once; the other deadlines change with the phase.
        stream.send_timeout = cfg.send_timeout
        while True:
            conn.phase = _Phase.IDLE
            stream.idle_timeout = cfg.keep_alive_timeout
            try:
                event = await self._next(conn)
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                if status == 501 and "Transfer-Encoding" in str(exc):
                    # h11 answers 501 for any coding but a lone "chunked", before we can
                    # see the header. When chunked is not last, RFC 9112 §6.3 requires
                    # 400, and 400 (rather than 501) is also fine for "gzip, chunked":
                    # either way the body's length is unknown and the connection closes.
                    status = 400
                await _refuse(stream, status, f"bad request head: {exc}")
                return
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return
            if not isinstance(event, h11.Request):
                return
            if stream.deadline != math.inf:
                stream.deadline = None
            stream.idle_timeout = None
            if _head_size(event) > cfg.max_header_size:
                # h11 only bounds a head still arriving; one that came whole in a
                # single read is measured here.
                await send_error(stream, 431)
                return
            refusal = _refusal(event)
            if refusal is not None:
                await _refuse(stream, *refusal)
                return
            conn.requests += 1
            self.requests_total += 1
            length = _content_length(event.headers)
            if length is not None and length > cfg.max_body_size:
                await send_error(stream, 413)
                return
            conn.phase = _Phase.APP
            target, authority = _origin_form(event.target.decode("latin-1"))
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers]
            if authority:
                # RFC 9112 §3.2.2: with an absolute-form target the Host header is
                # ignored and the target's authority stands in for it.
                headers = [(k, authority if k == "host" else v) for k, v in headers]
            request = Request(
                method=event.method.decode("latin-1"),
                target=target,
                headers=headers,
                http_version=event.http_version.decode("latin-1"),
                _chunks=partial(self._body, conn),
            )
            try:
                response = await self.app(request)
            except BodyTooLarge:
                await send_error(stream, 413)
                return
            except h11.RemoteProtocolError as exc:
                await _refuse(stream, exc.error_status_hint, f"bad request body: {exc}")
                return
            except ClientGone:
                logger.info("http: client went away while %s %s read its body", request.method, target)
                return
            except Exception:
                logger.exception("http app raised on %s %s", request.method, request.target)
                response = Response(500, [("content-type", "text/plain")], b"internal server error\n")
            if h.they_are_waiting_for_100_continue:
                # The app did not want the body and the client has not sent it: answer
                # at once rather than invite a body only to discard it, and close, as
                # the client may send the body anyway (RFC 9110 §10.1.1).
                conn.phase = _Phase.SEND
                await self._respond(conn, response, head_only=request.method == "HEAD", close=True)
                return
            # Whatever body the app left unread is drained (bounded by the limits) so
            # the connection can carry the next request.
            try:
                async for _ in self._body(conn):
                    pass
            except BodyTooLarge:
                await send_error(stream, 413)
                return
            except h11.RemoteProtocolError as exc:
                await _refuse(stream, exc.error_status_hint, f"bad request body: {exc}")
                return
            conn.phase = _Phase.SEND
            await self._respond(conn, response, head_only=request.method == "HEAD")
            if h.our_state is h11.MUST_CLOSE or h.their_state is h11.MUST_CLOSE:
                return
            try:
                h.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _body(self, conn: _Conn) -> AsyncIterator[bytes]:
        # The body timeout runs only while the body is being read: an app that
        # takes its time between reads is not the client's fault.
        received = 0
        stream = conn.stream
        h = conn.h11
        while h.their_state is h11.SEND_BODY:
            event = h.next_event()
            if event is h11.NEED_DATA:
                try:
                    if h.they_are_waiting_for_100_continue:
                        # The client holds the body back until it hears 100 Continue (or
                        # its own timeout); without it both sides wait out body_timeout.
                        await stream.send_all(h.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
                    conn.phase = _Phase.BODY  # if the body timeout fires now, the answer is 408
                    stream.receive_timeout = self.config.body_timeout
                    event = await self._next(conn)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise ClientGone(f"client went away mid-body: {exc!r}") from exc
                stream.receive_timeout = None
                conn.phase = _Phase.APP
            if isinstance(event, h11.Data):
                received += len(event.data)
                if received > self.config.max_body_size:
                    raise BodyTooLarge
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return

    def _must_close(self, conn: _Conn) -> bool:
        cfg = self.config
        if self.closing:
            return True
        if cfg.max_requests is not None and conn.requests >= cfg.max_requests:
            return True
        return cfg.max_connection_age is not None and trio.current_time() - conn.started >= cfg.max_connection_age

    async def _respond(self, conn: _Conn, response: Response, *, head_only: bool = False, close: bool = False) -> None:
        h = conn.h11
        headers = [(k.lower(), v) for k, v in response.headers]
        body = response.body
        if isinstance(body, bytes | bytearray):
            headers.append(("content-length", str(len(body))))
        if close or self._must_close(conn):
            headers.append(("connection", "close"))
        head = h.send(h11.Response(status_code=response.status, headers=headers)) or b""
        if head_only:
            # A response to HEAD has the headers of the GET and no body (RFC 9110 §9.3.2);
            # h11 refuses body bytes for it, so a streamed body is never started.
            await conn.stream.send_all(head + (h.send(h11.EndOfMessage()) or b""))
            return
        if isinstance(body, bytes | bytearray):
            # One write for head, body and end: one system call per small response.
            out = head + (h.send(h11.Data(data=body)) or b"" if body else b"") + (h.send(h11.EndOfMessage()) or b"")
            await conn.stream.send_all(out)
            return
        await conn.stream.send_all(head)
        async for chunk in body:
            if chunk:
                await conn.stream.send_all(h.send(h11.Data(data=chunk)) or b"")
        await conn.stream.send_all(h.send(h11.EndOfMessage()) or b"")

    def figures(self) -> list[Metric]:
        """This server's live figures, as Prometheus families (see :mod:`servers.prometheus`)."""
        f = Families({"worker": str(self.config.worker)})
        f.gauge("http_connections", "Open connections.", len(self.connections))
        f.counter("http_requests_total", "Requests served.", self.requests_total)
        f.counter("http_refused_total", "Connections refused with 503.", self.refused_total)
        return f.families

    async def shutdown(self) -> None:
        """Graceful shutdown: stop accepting, close idle keep-alive connections now,
        let requests in flight finish (their responses say ``Connection: close``)
        for up to ``grace`` seconds, then close whatever is left."""
        self.closing = True
        self.accepting.cancel()
        with trio.move_on_after(self.config.grace):
            while self.connections:
                for conn in list(self.connections):
                    if conn.phase is _Phase.IDLE:
                        conn.stream.cancel_scope.cancel()
                await trio.sleep(0.01)
        for conn in list(self.connections):
            conn.stream.cancel_scope.cancel()


async def _refuse(stream: idlekeeper.WatchedStream, status: int, why: str) -> None:
    # One INFO line, no traceback: bad input is the client's doing, not a server fault,
    # and a client sending it in bulk must not be able to flood the log with stacks.
    # h11's messages quote the offending bytes (escaped by repr): cut to keep lines short.
    logger.info("http: %d for %s", status, why if len(why) <= 200 else why[:200] + "...")
    await send_error(stream, status)


def _refusal(request: h11.Request) -> tuple[int, str] | None:
    """(status, reason) for a parsed head that must not be served, or None."""
    if not request.http_version.startswith(b"1."):
        # h11 parses any "HTTP/d.d" as if it were 1.1; another major version is
        # another protocol, whose framing we cannot assume (RFC 9110 §15.6.6).
        return 505, f"HTTP/{request.http_version.decode()}"
    names = {name for name, _ in request.headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        # h11 lets chunked win, as RFC 9112 §6.3 allows; but a front end that went
        # by Content-Length would see a different request boundary (smuggling), so
        # the request is refused and its connection closed instead.
        return 400, "Content-Length with Transfer-Encoding"
    return None


def _origin_form(target: str) -> tuple[str, str | None]:
    """``(origin-form target, authority)``: an absolute-form target
    (``http://host/path?q``, RFC 9112 §3.2.2) is routed by its path and query;
    any other target is returned as is, with no authority."""
    if target.startswith("/"):
        return target, None  # the usual case, decided without parsing
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return target, None  # asterisk-form, authority-form, or not a URI we serve
    end = len(rest)
    for delimiter in "/?#":
        found = rest.find(delimiter)
        if found != -1:
            end = min(end, found)
    authority = rest[:end].rpartition("@")[2]  # userinfo is not part of the host
    path = rest[end:].partition("#")[0]
    return (path if path.startswith("/") else "/" + path), authority


def _head_size(request: h11.Request) -> int:
    line = len(request.method) + len(request.target) + 12
    return line + sum(len(k) + len(v) + 4 for k, v in request.headers) + 2


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for key, value in headers:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def serve_http(
    app: App,
    config: HttpConfig,
    *,
    listeners: list[trio.SocketListener] | None = None,
    keeper: idlekeeper.Keeper | None = None,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``nursery.start`` returns the :class:`HttpServer`.

    Its connections are watched by ``keeper`` if one is given (a server that runs
    beside others in one worker shares that worker's keeper and reaper), otherwise
    by a keeper of its own with ``config.tick``. ``await server.shutdown()`` first
    for a graceful stop; cancelling alone is abrupt.
    """
    if keeper is None:
        async with idlekeeper.open_keeper(tick=config.tick, lookahead=config.lookahead) as own:
            await _serve(app, config, listeners, own, task_status)
    else:
        await _serve(app, config, listeners, keeper, task_status)


async def _serve(
    app: App,
    config: HttpConfig,
    listeners: list[trio.SocketListener] | None,
    keeper: idlekeeper.Keeper,
    task_status: trio.TaskStatus[HttpServer],
) -> None:
    async with trio.open_nursery() as nursery:
        server = HttpServer(app, config, keeper)
        if listeners is None:
            listeners = open_listeners(config.host, config.port)
        server.port = port_of(listeners)
        bound = listeners

        tls = config.tls
        # One context per worker: its session cache and loaded certificate are shared.
        ssl_context = None if tls is None else tls.context()

        async def accept() -> None:
            with server.accepting:
                await idlekeeper.serve_listeners(
                    server.handle,
                    bound,
                    keeper=keeper,
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
        task_status.started(server)
