"""A dense HTTP connection as its exchange sees it, and the answers the server gives
on its own: :class:`DenseChannel` is the base of :class:`~.dense.HttpProtocol`.

The exchange (:class:`~.exchange.Exchange`, in its runner's task) reads the request
body and writes the response through the :class:`~.exchange.Channel` methods here:
``more`` waits for body bytes under the body timeout, ``write`` queues under the
transport's high-water mark, ``disconnected`` waits for the client to leave. The
server answers by itself when the client is too slow (408 after the header or body
timer) or asks for what is refused (:meth:`DenseChannel.refuse`), then closes with a
lingering close, so that the client reads the answer rather than a reset.
"""

from __future__ import annotations

import trio

import idlekeeper

from .core import TIMEOUT_LINGER, Phase
from .dense_server import DenseHttpServer
from .errors import error_response, log_refusal
from .exchange import ClientGone, Exchange

__all__ = ["LINGER_LIMIT", "DenseChannel"]

LINGER_LIMIT = 256 * 1024
"""Bytes a lingering close reads and drops before giving up on the client's EOF."""


class DenseChannel(idlekeeper.Protocol):
    """The exchange's side of one dense HTTP connection (its :class:`~.exchange.Channel`),
    and its refusals and timeouts. :class:`~.dense.HttpProtocol` sets every attribute."""

    __slots__ = (
        "server",
        "t",
        "phase",
        "exchange",
        "timer",
        "written",
        "lingered",
        "gone",
        "peer_eof",
        "_readable",
        "_writable",
        "_gone_event",
    )

    server: DenseHttpServer
    t: idlekeeper.Transport
    phase: str
    """One of :class:`~.core.Phase`'s."""
    exchange: Exchange | None
    timer: idlekeeper.TimerHandle | None
    written: int
    """Bytes of responses given to the transport."""
    lingered: int
    """Bytes dropped while lingering; -1: not lingering."""
    gone: bool
    peer_eof: bool
    """The client half-closed while the app had its request."""
    _readable: trio.Event | None
    _writable: trio.Event | None
    _gone_event: trio.Event | None

    # -- timeouts answered 408, and lingering closes ------------------------------------------

    def _too_slow(self) -> None:
        """The header or body timer: the client did not send its request in time."""
        timer, self.timer = self.timer, None
        keeper, sock = self.server.keeper, self.t.socket
        if timer is not None and sock is not None and keeper.late_with_unread(sock, timer.when):
            # We stalled past the deadline with the client's bytes unread: they may
            # have come in time, so the reader gets a tick to take them first.
            self.timer = keeper.call_later(keeper.tick, self._too_slow_after_all)
            return
        self._too_slow_after_all()

    def _too_slow_after_all(self) -> None:
        self.timer = None
        if self.phase in (Phase.HEAD, Phase.BODY) and not self.gone and self.lingered < 0:
            exchange = self.exchange
            if exchange is not None and exchange.head_sent:
                # The app's response has begun (it answers as the body comes): a 408
                # now would land inside it. Cut, as the streams driver does.
                log_refusal(408, "the request body stalled after the response began; cut")
                self.t.abort()
            else:
                self.refuse(408, "", log=False, linger=TIMEOUT_LINGER)
            self._wake_reader()

    def refuse(
        self, status: int, why: str, *, log: bool = True, linger: float = 1.0, response: bytes | None = None
    ) -> None:
        """Answer ``status`` past h11 and close, lingering so that the client reads the
        answer rather than a reset; the connection's other work stops."""
        if log:
            log_refusal(status, why)
        self._cancel_timer()
        self.phase = Phase.DONE
        self.lingered = 0
        t = self.t
        t.idle_timeout = None
        t.receive_timeout = None
        t.write(error_response(status) if response is None else response)
        t.write_eof()
        t.resume_reading()
        t.deadline = trio.current_time() + linger  # the linger's end, if the client never closes

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _wake_reader(self) -> None:
        if self._readable is not None:
            self._readable.set()
            self._readable = None

    # -- the exchange's channel --------------------------------------------------------------

    async def more(self) -> None:
        """Wait for more of the request body, under the body timeout."""
        if self.gone or self.lingered >= 0:
            raise ClientGone("the connection is closed")
        self.t.resume_reading()
        self.phase = Phase.BODY
        self.timer = self.server.keeper.call_later(self.server.config.body_timeout, self._too_slow)
        event = self._readable = trio.Event()
        try:
            await event.wait()
        finally:
            self._cancel_timer()
            if self.phase is Phase.BODY:
                self.phase = Phase.APP
        if self.gone or self.lingered >= 0:
            raise ClientGone("the connection closed while the body was awaited")

    async def write(self, data: bytes) -> None:
        """Queue ``data``; wait while more than the high-water mark is queued."""
        if self.gone or self.lingered >= 0:
            raise ClientGone("the connection is closed")
        self.t.write(data)
        self.written += len(data)
        await self.writable()

    async def writable(self) -> None:
        """Return once the transport's queue is below its high-water mark."""
        writable = self._writable
        if writable is not None:
            await writable.wait()
            if self.gone:
                raise ClientGone("the connection closed while a response was queued")

    async def disconnected(self) -> None:
        if self.gone or self.peer_eof:
            return
        if self._gone_event is None:
            self._gone_event = trio.Event()
        await self._gone_event.wait()
