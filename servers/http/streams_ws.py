"""A WebSocket on the streams driver (and over TLS): the :class:`~.websocket.WsPipe`
over a watched stream, and the connection's tasks.

The connection's own task reads and feeds the exchange; a writer task sends what
is queued (pongs go out while the app is busy, and the app's ``send`` only queues);
the app runs in the server's nursery, outside the watch's cancel scope, so that an
expiry tells it ``websocket.disconnect`` rather than cancelling it, as on the dense
driver.
"""

from __future__ import annotations

import contextlib

import trio

import idlekeeper
from idlekeeper import Reason

from .asgi import ASGIApp
from .websocket import SEND_HIGH_WATER, WebSocketExchange

__all__ = ["StreamPipe", "run_websocket"]

_FAREWELL_TIMEOUT = 0.25


class StreamPipe:
    """:class:`~.websocket.WsPipe` over a watched stream, with a writer task."""

    __slots__ = ("stream", "buffer", "sending", "finished", "paused", "_wake", "_room", "_resume")

    def __init__(self, stream: idlekeeper.WatchedStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.sending = False
        self.finished = False
        self.paused = False
        self._wake = trio.Event()
        self._room = trio.Event()
        self._resume = trio.Event()

    @property
    def watch(self) -> idlekeeper.Watch:
        return self.stream

    def put(self, data: bytes) -> None:
        self.buffer += data
        self._wake.set()

    def queued(self) -> int:
        return len(self.buffer)

    async def drain(self) -> None:
        while len(self.buffer) > SEND_HIGH_WATER and not self.finished:
            self._room = trio.Event()
            await self._room.wait()

    def reading(self, on: bool) -> None:
        self.paused = not on
        if on:
            self._resume.set()

    def finish(self) -> None:
        self.finished = True
        for event in (self._wake, self._resume, self._room):
            event.set()

    async def write_all(self) -> None:
        """Send what is queued until :meth:`finish` and an empty queue."""
        while True:
            if not self.buffer:
                if self.finished:
                    return
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            # A cancellation already pending (an expiry in the same reaper pass as a
            # ping) is taken here, while nothing of the data has gone: the close frame
            # the expiry earns may still be written whole.
            await trio.lowlevel.checkpoint_if_cancelled()
            data, self.buffer = bytes(self.buffer), bytearray()
            self._room.set()
            self.sending = True
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.sending = False
                self.finish()  # the client is gone (a reset): nothing more can go
                return
            self.sending = False

    async def read_all(self, exchange: WebSocketExchange) -> None:
        """Feed the exchange what comes, until the client's EOF or :meth:`finish`."""
        while not self.finished:
            if self.paused:
                self._resume = trio.Event()
                await self._resume.wait()
                continue
            try:
                data = await self.stream.receive_some(16384)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""  # a reset: as an EOF
            exchange.feed(bytes(data))
            if not data:
                return
        await trio.sleep_forever()  # the writer ends the connection once its queue is out


async def run_websocket(exchange: WebSocketExchange, pipe: StreamPipe, app: ASGIApp, apps: trio.Nursery) -> None:
    """Serve one WebSocket from its connection's task; return when it is over and
    its app has ended (at most a grace after the connection)."""
    app_done = trio.Event()

    async def run_app() -> None:
        try:
            await exchange.run(app)
        finally:
            app_done.set()

    apps.start_soon(run_app)
    stream = pipe.stream
    try:
        async with trio.open_nursery() as io:

            async def writer() -> None:
                await pipe.write_all()
                io.cancel_scope.cancel()

            io.start_soon(writer)
            await pipe.read_all(exchange)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        reason = stream.reason if stream.expired else None
        with trio.CancelScope(shield=True):
            if reason is not None and not pipe.sending:
                # The watch serves with close=False: the close frame a ping timeout
                # earns is this task's to send, briefly.
                words = exchange.last_words(reason)
                if words:
                    with trio.move_on_after(_FAREWELL_TIMEOUT):
                        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                            await stream.send_all(words)
            exchange.lost(reason if reason in (Reason.RECEIVE, Reason.SEND) else None)
            pipe.finish()  # an app waiting for room to send hears of it
            # The socket closes now, not when the app has heard and returned: with many
            # peers dying at once, those wake-ups would make the close late.
            with trio.move_on_after(_FAREWELL_TIMEOUT):
                await stream.aclose()
            await app_done.wait()
