"""One request and its response, between an h11 connection and an ASGI app.

:class:`Exchange` takes the ASGI scope of a parsed request head (see :mod:`.head`),
gives the app its ``receive`` and ``send``, and turns what the app sends into h11
events and bytes. It never touches a socket: a driver hands it a :class:`Channel`,
which feeds h11 more of the request and writes bytes out (the dense engine's callbacks
in :mod:`.dense`, a trio stream in :mod:`.streams`). So both drivers, and the native
interface through :func:`~servers.http.asgi.native_asgi`, share one request cycle.

What the exchange decides, and the drivers act on (:class:`Outcome`): whether the
connection may carry another request, must close once the response is out, or must
be cut (a response the app started and never finished), and which error answer to
give when the request body was malformed (400) or too large (413) before any
response began.

**An exchange's life is its response's, not the app call's.** ASGI apps go on after
their last ``send()``: Starlette's and FastAPI's background tasks run inside the app
call, after the body is out. So the exchange is *settled* (:attr:`Exchange.finished`)
once the response is complete, or cannot be (the client left, the request was
refused), and the driver moves the connection on then (the next request, or the
close) while :meth:`Exchange.call` goes on to the app's end. A ``receive()`` that waits
for a disconnect is answered ``http.disconnect`` at that moment, as ASGI asks.
"""

from __future__ import annotations

import contextlib
import enum
import http
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import h11
import trio
from h11 import Connection as _Connection

from ..httpdate import http_date
from .asgi import ASGIApp, Message, Scope
from .quickhead import QuickHead
from .whole import whole_bytes, whole_response

__all__ = ["Channel", "ClientDisconnected", "ClientGone", "Exchange", "Outcome"]

logger = logging.getLogger("servers.http")

# "HTTP/1.1 200 OK" rather than h11's bare "200": some clients log the phrase.
_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_NO_BODY_STATUSES = frozenset({204, 304})
_DISCONNECT: Message = {"type": "http.disconnect"}


class ClientGone(ConnectionError):
    """The client reset or closed its connection (or it timed out) while the exchange
    was reading the request or writing the response."""


class ClientDisconnected(OSError):
    """Raised by ``send()`` once the client is gone, as ASGI asks of a server (an
    ``OSError``); an app that does not catch it simply ends."""


class Outcome(enum.Enum):
    """What the connection does once an exchange is over."""

    NEXT = "next"
    """The response is out and the request read: the connection carries the next one."""
    CLOSE = "close"
    """The response is out; close politely (``Connection: close`` was sent)."""
    ABORT = "abort"
    """Cut the connection: the response was started and cannot be completed."""
    REFUSE = "refuse"
    """Nothing was sent; answer :attr:`Exchange.refusal` and close."""


class Channel(Protocol):
    """What an exchange needs from the driver of its connection."""

    @property
    def h11(self) -> _Connection | None:
        """The connection's h11 state; None while only quick requests have come (see
        :mod:`.quickhead`)."""
        ...

    def parser(self) -> _Connection:
        """The connection's h11 state, made on first need (and told of the quick request
        in progress, if any)."""
        ...

    async def more(self) -> None:
        """Feed h11 more of the request; return once some came (or the end of input).
        Raises :class:`ClientGone` if the client went away or the body timed out."""
        ...

    async def write(self, data: bytes) -> None:
        """Write ``data``, waiting while too much is queued for the client.
        Raises :class:`ClientGone` if it is gone."""
        ...

    async def disconnected(self) -> None:
        """Return once the client has gone away (for an app listening for it)."""
        ...

    def settled(self) -> None:
        """The exchange has settled (see :attr:`Exchange.finished`): the response is
        complete or cannot be, whatever the app does next. Called once, from the app's
        task (in ``send()``, or as the app returns)."""
        ...


class Exchange:
    """One request's ASGI cycle on ``channel``; :meth:`run` it in a task of its own
    (or in the connection's task), then act on the :class:`Outcome` it returns.

    ``must_close()`` is asked when the response head is built: true adds
    ``Connection: close`` (a graceful shutdown, ``--max-requests``, a connection's age).
    """

    __slots__ = (
        "channel",
        "scope",
        "head_only",
        "max_body_size",
        "must_close",
        "received",
        "body_done",
        "gone",
        "started",
        "head_sent",
        "complete",
        "status",
        "headers",
        "refusal",
        "refusal_reason",
        "closing",
        "quick",
        "finished",
        "returned",
        "detached",
        "_settled",
        "_returned",
        "_waiting",
        "_waiter_left",
    )

    def __init__(
        self,
        channel: Channel,
        scope: Scope,
        *,
        max_body_size: int,
        must_close: Callable[[], bool],
        quick: QuickHead | None = None,
    ) -> None:
        self.channel = channel
        self.scope = scope
        self.head_only = scope["method"] == "HEAD"
        self.max_body_size = max_body_size
        self.must_close = must_close
        self.received = 0
        self.body_done = False
        self.gone = False
        self.started = False
        self.head_sent = False
        self.complete = False
        self.status = 0
        self.headers: Sequence[tuple[bytes, bytes]] = ()
        """The response's headers as the app sent them."""
        self.refusal = 0
        """The error status to answer instead of the app's response (400, 413), if any."""
        self.refusal_reason = ""
        self.closing = False
        self.quick = quick
        """The request's head if it was read past h11 (then it has no body, and h11 hears
        of it only if the response needs h11)."""
        self.finished = False
        """Settled: the response is complete, or cannot be (the client went, the request
        was refused); the connection may move on, whatever the app does next."""
        self.returned = False
        """The app call has returned (or raised)."""
        self.detached = False
        """The driver moved the connection on while the app went on (its background work)."""
        self._settled: trio.Event | None = None
        self._returned: trio.Event | None = None
        self._waiting: trio.CancelScope | None = None
        self._waiter_left: trio.Event | None = None

    # -- the app's side ------------------------------------------------------------

    async def receive(self) -> Message:
        """ASGI ``receive``: the request body in pieces, then ``http.disconnect`` once
        the client has gone or the response is complete."""
        if self.gone or self.finished:
            return dict(_DISCONNECT)
        if self.body_done:
            # Nothing more to read: wait for the client to go (Starlette's streaming
            # responses listen for it) or for the response to end (see _settle).
            scope = self._waiting = trio.CancelScope()
            left = self._waiter_left = trio.Event()
            try:
                with scope:
                    await self.channel.disconnected()
                    self.gone = True
                    self._settle()
            finally:
                self._waiting = None
                left.set()
            return dict(_DISCONNECT)
        return await self._body()

    async def _body(self) -> Message:
        """The next piece of the request body (``http.disconnect`` if it cannot come)."""
        if self.quick is not None:
            self.body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        h = self.channel.parser()
        chunks: list[bytes] = []
        while True:
            try:
                event = h.next_event()
            except h11.RemoteProtocolError as exc:
                self._refuse(exc.error_status_hint, f"bad request body: {exc}")
                return {"type": "http.disconnect"}
            if isinstance(event, h11.Data):
                self.received += len(event.data)
                if self.received > self.max_body_size:
                    self._refuse(413, "request body too large")
                    return {"type": "http.disconnect"}
                chunks.append(bytes(event.data))
                continue
            if isinstance(event, h11.EndOfMessage):
                self.body_done = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            if event is h11.NEED_DATA:
                if chunks:
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": True}
                try:
                    if h.they_are_waiting_for_100_continue:
                        # The client holds the body back until it hears this (or its own
                        # timeout): answered when the app first asks for the body.
                        await self.channel.write(h.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
                    await self.channel.more()
                except ClientGone:
                    self.gone = True
                    logger.info(
                        "http: client went away while %s %s read its body",
                        self.scope["method"],
                        self.scope["raw_path"].decode("latin-1"),
                    )
                    return {"type": "http.disconnect"}
                continue
            # ConnectionClosed (the client half-closed mid-body) or PAUSED.
            self.gone = True
            return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        """ASGI ``send``: ``http.response.start``, then ``http.response.body`` pieces."""
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = int(message["status"])
            headers = message.get("headers", ())
            # Kept as the app gave them (a list or tuple: read twice if h11 takes the
            # response); normalized only on h11's path (see _head).
            self.headers = headers if headers.__class__ in (list, tuple) else list(headers)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started:
            raise RuntimeError("http.response.body before http.response.start")
        if self.complete:
            raise RuntimeError("http.response.body after the response was complete")
        if self.gone and not self.refusal:
            raise ClientDisconnected("the client went away")
        if self.refusal:
            return  # the request was refused (400, 413): its answer replaces the app's
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        h = self.channel.h11
        waiting = h is not None and h.they_are_waiting_for_100_continue
        if not self.head_sent and not more and not self.body_done and not waiting:
            # A whole response to a request whose body is still coming: read the rest of
            # it first (bounded by the limits and the body timeout), as the native
            # interface always did, so that a malformed or oversized body gets its 400 or
            # 413 rather than this answer, and the connection can carry the next request.
            while not self.body_done and not self.gone:
                await self._body()
            if self.refusal:
                return  # run() answers the refusal instead
        if self.gone:
            raise ClientDisconnected("the client went away")
        out = b""
        if not self.head_sent:
            self.head_sent = True
            if not more:
                whole = self._whole(body)
                if whole is not None:
                    self.complete = True
                    await self._write(whole)
                    self._settle()
                    return
            out = self.channel.parser().send(self._head(len(body) if not more else None)) or b""
        h = self.channel.parser()
        if body and not self.head_only and self.status not in _NO_BODY_STATUSES:
            out += h.send(h11.Data(data=body)) or b""
        if not more:
            out += h.send(h11.EndOfMessage()) or b""
            self.complete = True
        if out:
            await self._write(out)
        if self.complete:
            self._settle()

    async def _write(self, data: bytes) -> None:
        try:
            await self.channel.write(data)
        except ClientGone:
            self.gone = True
            self._settle()
            raise ClientDisconnected("the client went away") from None

    def _whole(self, body: bytes) -> bytes | None:
        """A complete response in one message, written past h11 when it allows (see
        :mod:`.whole`)."""
        h = self.channel.h11
        if (h is not None and h.they_are_waiting_for_100_continue) or self.must_close():
            return None  # closing: h11's path, which also says so
        headers, status, date = self.headers, self.status, http_date()
        reason = _PHRASES.get(status, b"")
        if h is None:
            # A quick request: h11 never needs to hear of it.
            return whole_bytes(status, reason, headers, body, send_body=not self.head_only, date=date)
        return whole_response(h, status, reason, headers, body, send_body=not self.head_only, date=date)

    def _head(self, length: int | None) -> h11.Response:
        headers = [(bytes(k).lower(), bytes(v)) for k, v in self.headers]
        names = {name for name, _ in headers}
        if (
            length is not None
            and b"content-length" not in names
            and b"transfer-encoding" not in names
            and self.status not in _NO_BODY_STATUSES
            and self.status >= 200
        ):
            headers.append((b"content-length", str(length).encode()))
        if self.channel.parser().they_are_waiting_for_100_continue:
            # The app answered without reading the body, and the client has not sent it:
            # do not invite it only to discard it, and close, as the client may send it
            # anyway (RFC 9110 §10.1.1).
            self.closing = True
        elif self.must_close():
            self.closing = True
        if b"date" not in names:
            headers.append((b"date", http_date()))
        if self.closing and b"connection" not in names:
            headers.append((b"connection", b"close"))
        return h11.Response(status_code=self.status, headers=headers, reason=_PHRASES.get(self.status, b""))

    def _refuse(self, status: int, why: str) -> None:
        self.gone = True  # for the app, the request is over
        if not self.refusal:
            self.refusal = status
            self.refusal_reason = why
        self._settle()

    def _settle(self) -> None:
        """The response is complete or cannot be: a receive() waiting for a disconnect
        is answered now, and the driver may move the connection on."""
        if self.finished:
            return
        self.finished = True
        if self._waiting is not None:
            self._waiting.cancel()
        if self._settled is not None:
            self._settled.set()
        self.channel.settled()

    # -- the driver's side ---------------------------------------------------------

    async def call(self, app: ASGIApp) -> None:
        """Call the app, answering for it where it fails (500 before a response began);
        returns when the app does, which may be long after the exchange settled."""
        try:
            await app(self.scope, self.receive, self.send)
        except ClientDisconnected:
            pass  # the app did not catch it: nothing more to send
        except Exception as exc:
            target = self._target()
            if self.gone and not self.refusal:
                # Raised because the client left (Starlette's ClientDisconnect from a
                # send that failed, say): the client's doing, worth a line, not a stack.
                logger.info("http: the app raised after the client left %s %s: %r", *target, exc)
            else:
                logger.exception("http: the app raised on %s %s", *target)
                if not self.head_sent and not self.refusal:
                    await self._internal_error()
        else:
            if self.complete:
                pass  # the usual end: checked first, as every request comes this way
            elif not self.started and not self.refusal and not self.gone:
                logger.error("http: the app returned without a response to %s %s", *self._target())
                await self._internal_error()
            elif self.started and not self.refusal and not self.gone:
                # uvicorn's words for it. Nothing out yet: a 500 says so; else the cut does.
                logger.error("http: ASGI callable returned without completing response to %s %s", *self._target())
                if not self.head_sent:
                    await self._internal_error()
        finally:
            self.returned = True
            if not self.finished:
                self._settle()
            if self._returned is not None:
                self._returned.set()

    def _target(self) -> tuple[str, str]:
        """The request's method and target, for a log line."""
        return self.scope["method"], self.scope["raw_path"].decode("latin-1")

    async def settle(self) -> None:
        """Return once the exchange has settled (see :attr:`finished`) and a receive()
        that waited for a disconnect has left (it may have been reading the connection)."""
        if not self.finished:
            if self._settled is None:
                self._settled = trio.Event()
            await self._settled.wait()
        if self._waiter_left is not None:
            await self._waiter_left.wait()

    async def app_returned(self) -> None:
        """Return once the app call has returned."""
        if not self.returned:
            if self._returned is None:
                self._returned = trio.Event()
            await self._returned.wait()

    async def finish(self) -> Outcome:
        """Once settled: read what is left of the request body, so the connection can
        carry the next one. Returns what to do next."""
        if self.refusal and not self.head_sent:
            return Outcome.REFUSE
        if not self.complete or self.gone:
            return Outcome.ABORT
        h = self.channel.h11
        if h is None:
            # A quick request answered whole: both sides are done, and the connection
            # is kept (a close would have taken h11's path).
            return Outcome.NEXT
        if self.closing or h.our_state is h11.MUST_CLOSE:
            return Outcome.CLOSE
        # Whatever body the app left unread is read and dropped (bounded by the limits),
        # so the connection can carry the next request.
        while not self.body_done and not self.gone:
            message = await self._body()
            if message["type"] == "http.disconnect":
                if self.refusal:
                    logger.info("http: closing after the response: %s", self.refusal_reason[:200])
                return Outcome.CLOSE
        if h.their_state is h11.MUST_CLOSE or h.our_state is not h11.DONE or h.their_state is not h11.DONE:
            return Outcome.CLOSE
        h.start_next_cycle()
        return Outcome.NEXT

    async def _internal_error(self) -> None:
        """Answer 500 in the app's place (the client may have gone meanwhile)."""
        self.started = True
        self.status = 500
        self.headers = [(b"content-type", b"text/plain")]
        with contextlib.suppress(ClientDisconnected):
            await self.send({"type": "http.response.body", "body": b"internal server error\n"})

