"""One WebSocket between a client and an ASGI app (ASGI WebSocket spec 2.4), on
either driver.

:class:`WebSocketExchange` is to a WebSocket what :class:`~.exchange.Exchange` is to
a request: it gives the app its ``receive`` and ``send``, turns what the app sends
into bytes (the ``101``, frames, a denial response) and what the client sends into
ASGI messages, and never touches a socket. A driver hands it a :class:`WsPipe`
(the dense engine's transport, or a watched stream with a writer task), feeds it
every byte read with :meth:`~WebSocketExchange.feed`, and tells it when the
connection is lost.

Every deadline is the connection's watch, so the keeper holds them all:

====================  ==========================================  =====================
phase                 deadline                                    on expiry
====================  ==========================================  =====================
upgrade request       the request head's (``header_timeout``)     408
open                  ``receive_timeout`` = ping interval + ping  close 1011 (written
                      timeout: a ping goes out every interval,    just before the cut),
                      so a peer that answers always reads in      app hears 1011
                      time; bytes waiting in the kernel spare it
sending               ``send_timeout`` without write progress     cut, app hears 1008,
                      (``send`` waits while more than a bound     one log line
                      is queued)
closing               absolute: ``ws_close_timeout`` from the     cut
                      close sent, for the peer's answer
====================  ==========================================  =====================

On the dense driver the connection holds no task of its own: the app's (the ASGI
app awaits ``receive`` for as long as the socket is open) is the only one.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Protocol

import h11
import trio

import idlekeeper
from idlekeeper import Reason

from ..ws.session import Closed, WsSession
from ..ws.upgrade import Offer, accept_head, denial_head, take_deflate
from .asgi import WEBSOCKET_ASGI_VERSION, ASGIApp, Message, Scope
from .core import HttpConfig
from .exchange import ClientDisconnected, ClientGone

__all__ = [
    "PING_TIMEOUT",
    "SEND_HIGH_WATER",
    "STOPPED_READING",
    "WebSocketExchange",
    "WsPipe",
    "after_upgrade",
    "websocket_scope",
]

logger = logging.getLogger("servers.http")

PING_TIMEOUT = 1011
"""The close code of a peer that left a ping unanswered (as the ``websockets`` library's)."""
STOPPED_READING = 1008
"""The code the app hears for a peer that stopped reading what it was sent."""
GOING_AWAY = 1001
_ABNORMAL = 1006

SEND_HIGH_WATER = 64 * 1024
"""Bytes queued for the client beyond which the app's ``send`` waits for the pipe to drain."""


class WsPipe(Protocol):
    """What a :class:`WebSocketExchange` needs of its driver."""

    @property
    def watch(self) -> idlekeeper.Watch:
        """The connection's deadlines (a dense transport, or a watched stream)."""
        ...

    def put(self, data: bytes) -> None:
        """Queue ``data`` for the client, without waiting."""
        ...

    def queued(self) -> int:
        """Bytes queued and not yet handed to the kernel."""
        ...

    async def drain(self) -> None:
        """Wait until the queue has room (:func:`queued` is below the high-water mark
        or the connection is gone)."""
        ...

    def reading(self, on: bool) -> None:
        """Pause or resume reading from the client."""
        ...

    def finish(self) -> None:
        """Close the connection once the queue is sent."""
        ...


def after_upgrade(h: h11.Connection) -> bytes:
    """What came behind an upgrade request's head (the WebSocket's first frames):
    h11 is walked past the request's end, where it pauses for the switch."""
    if isinstance(h.next_event(), h11.EndOfMessage):  # an upgrade request has no body
        h.next_event()  # PAUSED
    return bytes(h.trailing_data[0])


def websocket_scope(http_scope: Scope, offer: Offer) -> Scope:
    """The ASGI ``websocket`` scope for an upgrade request's ``http`` scope."""
    scope = dict(http_scope)
    scope["type"] = "websocket"
    scope["asgi"] = WEBSOCKET_ASGI_VERSION
    scope["scheme"] = "wss" if http_scope["scheme"] == "https" else "ws"
    scope["subprotocols"] = offer.subprotocols
    scope["extensions"] = {"websocket.http.response": {}}
    del scope["method"]
    return scope


class WebSocketExchange:
    """One WebSocket's ASGI cycle on ``pipe``: :meth:`run` the app in a task, feed
    it the bytes read, and tell it of the connection's end with :meth:`lost`."""

    __slots__ = (
        "pipe",
        "scope",
        "offer",
        "config",
        "keeper",
        "session",
        "inbox",
        "held",
        "ended",
        "pinger",
        "connected",
        "denial",
        "early",
        "eof",
        "_reader",
        "_app_done",
        "cancel",
    )

    def __init__(
        self, pipe: WsPipe, scope: Scope, offer: Offer, config: HttpConfig, keeper: idlekeeper.Keeper, early: bytes
    ) -> None:
        self.pipe = pipe
        self.scope = scope
        self.offer = offer
        self.config = config
        self.keeper = keeper
        self.session: WsSession | None = None
        """The open WebSocket, once the app accepted it."""
        # Made when a message waits, dropped when none does: an idle WebSocket
        # holds no queue (a deque is 0.6 KiB empty).
        self.inbox: deque[str | bytes] | None = None
        self.held = 0
        """Bytes of messages waiting for the app's ``receive``."""
        self.ended: Closed | None = None
        """How the connection ended, once it has (the app's ``websocket.disconnect``)."""
        self.pinger: idlekeeper.TimerHandle | None = None
        self.connected = False  # websocket.connect handed to the app
        self.denial: tuple[int, list[tuple[bytes, bytes]], bytearray] | None = None
        self.early = bytearray(early)  # frames that came before the app accepted
        self.eof = False  # and the client's EOF behind them
        self._reader: trio.lowlevel.Task | None = None  # the app's task, parked in receive()
        self._app_done = False
        self.cancel: trio.CancelScope | None = None
        """The app's scope, cancelled a grace after the connection is lost."""

    # -- the driver's side --------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Bytes read from the client (``b""`` at its EOF)."""
        session = self.session
        if session is None:
            if data:
                self.early += data
                if len(self.early) > self.config.ws_max_size:
                    self.pipe.reading(False)  # the app has not accepted yet: read no further
            else:
                # The client is done sending before the app answered: what it sent is
                # read once the app accepts (a close frame among it, say), and the
                # connection ends then; or with the app's refusal.
                self.eof = True
                self._wake()
            return
        got = session.receive(data)
        if got.out:
            self.pipe.put(got.out)
        if got.messages:
            inbox = self.inbox
            if inbox is None:
                inbox = self.inbox = deque()
            for message in got.messages:
                inbox.append(message)
                self.held += len(message)
            if self.held > self.config.ws_max_size:
                self.pipe.reading(False)  # the app is slow to receive: read on when it has
            self._wake()
        if got.closed is not None:
            if not got.closed.by_peer:
                logger.info("websocket closed (%d): %s", got.closed.code, got.closed.reason)
            self._end(got.closed)
            self.pipe.finish()

    def lost(self, reason: Reason | None) -> None:
        """The connection is gone (``reason``: the deadline that expired, if one did)."""
        if reason is Reason.SEND:
            logger.info("websocket client stopped reading: nothing sent for %.0f s; closed", self.config.send_timeout)
            self._end(Closed(STOPPED_READING, "the client stopped reading", by_peer=False))
        elif reason is Reason.RECEIVE:
            self._end(Closed(PING_TIMEOUT, "keepalive ping timeout", by_peer=False))
        else:
            self._end(Closed(_ABNORMAL, "", by_peer=True))
        self._stop_pinging()
        if not self._app_done and self.cancel is not None:
            # The app hears websocket.disconnect now; one that goes on regardless is
            # cancelled after the grace a shutdown gives it.
            self.keeper.call_later(self.config.grace, self.cut)

    def last_words(self, reason: Reason) -> bytes | None:
        """The close frame written just before a ping timeout cuts the connection."""
        session = self.session
        if reason is Reason.RECEIVE and session is not None:
            return session.close(PING_TIMEOUT, "keepalive ping timeout")
        return None

    def shut(self) -> None:
        """A graceful shutdown: close 1001 (Going Away), or refuse a handshake not
        yet accepted."""
        session = self.session
        if session is not None:
            self._close(session, GOING_AWAY, "server shutting down")

    def cut(self) -> None:
        """Cancel the app now, if it is still running (on the dense engine its scope
        is its runner's, which goes on to other exchanges once this one is over)."""
        if not self._app_done and self.cancel is not None:
            self.cancel.cancel()

    def _end(self, closed: Closed) -> None:
        if self.ended is None:
            self.ended = closed
        self._wake()

    def _wake(self) -> None:
        # The app parks its own task rather than waiting on a trio.Event: an Event and
        # its parking lot for every idle WebSocket would cost more than the rest of it.
        reader = self._reader
        if reader is not None:
            self._reader = None
            trio.lowlevel.reschedule(reader)

    def _stop_pinging(self) -> None:
        if self.pinger is not None:
            self.pinger.cancel()
            self.pinger = None

    # -- the app's side -------------------------------------------------------------

    async def run(self, app: ASGIApp, scope: trio.CancelScope | None = None) -> None:
        """Run ``app`` on this WebSocket, and end the handshake or the connection
        as it leaves them. ``scope``, if given, is the one cancelled when the app
        outlives its connection (a dense runner's own, which a second would only
        duplicate); otherwise the app gets one of its own."""
        try:
            if scope is not None:
                self.cancel = scope
                await app(self.scope, self.receive, self.send)
            else:
                with trio.CancelScope() as self.cancel:
                    await app(self.scope, self.receive, self.send)
        except ClientDisconnected:
            self._after_app(1000, "")  # ASGI: an app that does not catch it simply ends
        except Exception:
            logger.exception("websocket app %s raised", self.scope.get("path"))
            self._after_app(1011, "internal error")
        else:
            self._after_app(1000, "")
        finally:
            self._app_done = True
            self._stop_pinging()

    def _after_app(self, code: int, reason: str) -> None:
        session = self.session
        if session is not None:
            if self.ended is None:
                self._close(session, code, reason)
        elif self.ended is None:
            if self.denial is not None:
                self.pipe.finish()  # a denial the app began and did not end: cut short
            else:
                logger.info("websocket app %s returned without accepting: 500", self.scope.get("path"))
                self._deny(500, [], b"")

    async def receive(self) -> Message:
        """The ASGI ``receive``: ``websocket.connect``, then the client's messages,
        then ``websocket.disconnect``."""
        if not self.connected:
            self.connected = True
            return {"type": "websocket.connect"}
        while True:
            inbox = self.inbox
            if inbox:
                message = inbox.popleft()
                if not inbox:
                    self.inbox = None
                self.held -= len(message)
                if self.held <= self.config.ws_max_size and self.ended is None:
                    self.pipe.reading(True)
                if isinstance(message, str):
                    return {"type": "websocket.receive", "text": message}
                return {"type": "websocket.receive", "bytes": message}
            if self.ended is not None:
                return {"type": "websocket.disconnect", "code": self.ended.code, "reason": self.ended.reason}
            if self.eof and self.session is None:
                return {"type": "websocket.disconnect", "code": _ABNORMAL, "reason": ""}
            if self._reader is not None:
                raise RuntimeError("receive() called from two tasks at once")
            self._reader = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abandon)

    def _abandon(self, _: object) -> trio.lowlevel.Abort:
        self._reader = None  # cancelled while parked
        return trio.lowlevel.Abort.SUCCEEDED

    async def send(self, message: Message) -> None:
        """The ASGI ``send``. Raises :class:`~.exchange.ClientDisconnected` once the
        connection is closed, as ASGI asks."""
        kind = message["type"]
        if self.ended is not None:
            raise ClientDisconnected(f"websocket closed ({self.ended.code})")
        session = self.session
        if session is None:
            self._handshake(kind, message)
            return
        if kind == "websocket.send":
            text, data = message.get("text"), message.get("bytes")
            if (text is None) == (data is None):
                raise RuntimeError("websocket.send takes one of 'text' and 'bytes'")
            frame = session.send(str(text) if text is not None else bytes(data or b""))
            if not frame:
                raise ClientDisconnected("websocket closing")
            self.pipe.put(frame)
            if self.pipe.queued() > SEND_HIGH_WATER:
                try:
                    await self.pipe.drain()
                except ClientGone as exc:
                    raise ClientDisconnected(str(exc)) from exc
                if self.ended is not None:
                    raise ClientDisconnected(f"websocket closed ({self.ended.code}) while the message was queued")
        elif kind == "websocket.close":
            self._close(session, int(message.get("code") or 1000), str(message.get("reason") or ""))
        else:
            raise RuntimeError(f"{kind!r} cannot be sent on an open websocket")

    def _handshake(self, kind: str, message: Message) -> None:
        if self.denial is not None:
            if kind != "websocket.http.response.body":
                raise RuntimeError(f"{kind!r} during a denial response")
            status, headers, body = self.denial
            body += message.get("body", b"")
            if not message.get("more_body", False):
                self.denial = None
                self._deny(status, headers, bytes(body))
            return
        if kind == "websocket.accept":
            self._accept(message)
        elif kind == "websocket.close":
            self._deny(403, [], b"")  # ASGI: a close before the accept is a 403
        elif kind == "websocket.http.response.start":
            self.denial = (int(message["status"]), list(message.get("headers", [])), bytearray())
        else:
            raise RuntimeError(f"{kind!r} before the websocket is accepted")

    def _accept(self, message: Message) -> None:
        cfg = self.config
        subprotocol = message.get("subprotocol")
        if subprotocol is not None and subprotocol not in self.offer.subprotocols:
            raise RuntimeError(f"subprotocol {subprotocol!r} was not offered")
        deflate = take_deflate(self.offer, max_size=cfg.ws_max_size) if cfg.ws_per_message_deflate else None
        extension, answer = deflate if deflate is not None else (None, None)
        head = accept_head(self.offer, subprotocol=subprotocol, headers=message.get("headers", ()), extension=answer)
        self.session = WsSession(max_size=cfg.ws_max_size, extensions=[extension] if extension else None)
        self.pipe.put(head)
        watch = self.pipe.watch
        watch.deadline = None
        watch.idle_timeout = None
        if cfg.ws_ping_interval is not None:
            # A ping every interval: a peer that answers within the timeout always
            # reads before this deadline, and one that does not is cut at it.
            timeout = cfg.ws_ping_interval + (cfg.ws_ping_timeout or 0.0)
            # Counted from the client's last byte (its handshake, or frames that came
            # with it), not from when the app got round to accepting.
            watch.receive_timeout_since(timeout, -math.inf)
            self.pinger = self.keeper.call_every(cfg.ws_ping_interval, self._ping)
        early, self.early = bytes(self.early), bytearray()
        self.pipe.reading(True)
        if early:
            self.feed(early)
        if self.eof:
            self.feed(b"")

    def _ping(self) -> None:
        session = self.session
        if session is not None and session.open and self.ended is None:
            self.pipe.put(session.ping())

    def _close(self, session: WsSession, code: int, reason: str) -> None:
        frame = session.close(code, reason)
        if frame:
            self.pipe.put(frame)
            # The peer's answer must come within the close timeout.
            self.pipe.watch.deadline = trio.current_time() + self.config.ws_close_timeout
            self._stop_pinging()

    def _deny(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.pipe.put(denial_head(status, headers, len(body)) + body)
        self._end(Closed(_ABNORMAL, "", by_peer=False))
        self.pipe.finish()
