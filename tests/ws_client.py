"""A WebSocket client for the tests, on trio and wsproto's client side: it does what
a test asks of it (answer pings or not, compress or not, send any frame) and reports
what the server did, byte for byte where that matters."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate


class Refused(Exception):
    """The server answered the handshake with another status than 101."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"refused: {status}")
        self.status = status
        self.body = body


class WsClient:
    """One client connection; :meth:`open` it, then send and receive messages."""

    def __init__(self, stream: trio.SocketStream, answer_pings: bool) -> None:
        self.stream = stream
        self.answer_pings = answer_pings
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.accepted: AcceptConnection | None = None
        self.pings = 0
        self.closed: CloseConnection | None = None
        self._events: list[Event] = []

    @classmethod
    async def open(
        cls,
        port: int,
        path: str = "/ws",
        *,
        subprotocols: Sequence[str] = (),
        deflate: bool = False,
        headers: Sequence[tuple[bytes, bytes]] = (),
        answer_pings: bool = True,
    ) -> WsClient:
        """Connect and complete the handshake; raises :class:`Refused` on a denial."""
        client = cls(await trio.open_tcp_stream("127.0.0.1", port), answer_pings)
        request = Request(
            host="127.0.0.1",
            target=path,
            subprotocols=list(subprotocols),
            extensions=[PerMessageDeflate()] if deflate else [],
            extra_headers=list(headers),
        )
        await client.stream.send_all(client.ws.send(request))
        status, body = 0, b""
        while client.accepted is None:
            for event in await client._read():
                if isinstance(event, AcceptConnection):
                    client.accepted = event
                elif isinstance(event, RejectConnection):
                    status = event.status_code
                    if not event.has_body:
                        raise Refused(status, b"")
                elif isinstance(event, RejectData):
                    body += event.data
                    if event.body_finished:
                        raise Refused(status, body)
                else:
                    client._events.append(event)
        return client

    async def _read(self) -> list[Event]:
        data = await self.stream.receive_some(65536)
        self.ws.receive_data(data or None)
        events = list(self.ws.events())
        for event in events:
            if isinstance(event, Ping):
                self.pings += 1
                if self.answer_pings:
                    await self.stream.send_all(self.ws.send(event.response()))
        if not data and self.accepted is None:
            raise Refused(0, b"")
        return events

    async def send(self, message: str | bytes) -> None:
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        await self.stream.send_all(self.ws.send(event))

    async def event(self) -> Event:
        """The next event that is not a ping (a whole message is several events if
        it was fragmented)."""
        while not self._events:
            self._events.extend(e for e in await self._read() if not isinstance(e, Ping))
        return self._events.pop(0)

    async def receive(self) -> str | bytes:
        """The next whole message; raises :class:`AssertionError` on a close."""
        parts: list[str | bytes] = []
        while True:
            event = await self.event()
            if isinstance(event, CloseConnection):
                self.closed = event
                raise AssertionError(f"closed by the server: {event.code} {event.reason}")
            if isinstance(event, Pong):
                continue
            assert isinstance(event, TextMessage | BytesMessage)
            parts.append(event.data if isinstance(event.data, str) else bytes(event.data))
            if event.message_finished:
                return "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)  # type: ignore[arg-type]

    async def until_closed(self) -> CloseConnection:
        """Read until the server's close frame (answered) or EOF (code 1006)."""
        while True:
            try:
                event = await self.event()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return CloseConnection(code=1006)
            if isinstance(event, CloseConnection):
                self.closed = event
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await self.stream.send_all(self.ws.send(event.response()))
                return event

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.stream.send_all(self.ws.send(CloseConnection(code=code, reason=reason)))
