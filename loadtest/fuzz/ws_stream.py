"""A well-behaved WebSocket client on trio and wsproto's client side, for the fuzz
run's canary: whole messages in and out (an echo client), or the bytes of binary
messages as a ``trio.abc.Stream`` (an MQTT client over WebSockets). It answers every
ping as it reads, and the server's close with its own.
"""

from __future__ import annotations

import collections
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
    RejectConnection,
    Request,
    TextMessage,
)

__all__ = ["WsClientStream"]

_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


class WsClientStream(trio.abc.Stream):
    """One client WebSocket: :meth:`connect` it, then send and receive messages."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.messages: collections.deque[str | bytes] = collections.deque()
        self.close_code: int | None = None
        """The server's close code, once it closed."""
        self._parts: list[str | bytes] = []
        self._buffer = bytearray()
        self._sending = trio.StrictFIFOLock()  # pongs from the reader, messages from the writer

    @property
    def socket(self) -> trio.socket.SocketType:
        """The TCP socket underneath (its address is the connection's name in the server's logs)."""
        return self.stream.socket

    @classmethod
    async def connect(cls, port: int, path: str, subprotocols: Sequence[str] = ()) -> WsClientStream:
        """Connect to ``127.0.0.1:port`` and complete the opening handshake; raises
        ``trio.BrokenResourceError`` if the server refuses or closes."""
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        request = Request(host="127.0.0.1", target=path, subprotocols=list(subprotocols))
        try:
            await client.stream.send_all(client.ws.send(request))
            while client.ws.state is ConnectionState.CONNECTING:
                for event in await client._read():
                    if isinstance(event, RejectConnection):
                        raise trio.BrokenResourceError(f"the handshake was refused ({event.status_code})")
                    if not isinstance(event, AcceptConnection):
                        await client._handle(event)  # frames right behind the 101
        except BaseException:
            await client.stream.aclose()
            raise
        return client

    async def _read(self) -> list[Event]:
        data = await self.stream.receive_some(65536)
        if not data and self.ws.state is ConnectionState.CONNECTING:
            raise trio.BrokenResourceError("closed during the handshake")
        self.ws.receive_data(data or None)
        return list(self.ws.events())

    async def _handle(self, event: Event) -> None:
        if isinstance(event, Ping):
            await self._send(self.ws.send(event.response()))
        elif isinstance(event, TextMessage | BytesMessage):
            data = event.data
            self._parts.append(data if isinstance(data, str) else bytes(data))
            if event.message_finished:
                parts, self._parts = self._parts, []
                whole = "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)  # type: ignore[arg-type]
                self.messages.append(whole)
        elif isinstance(event, CloseConnection):
            self.close_code = int(event.code)
            if self.ws.state is ConnectionState.REMOTE_CLOSING:
                with contextlib.suppress(*_GONE):
                    await self._send(self.ws.send(event.response()))

    async def _send(self, data: bytes) -> None:
        async with self._sending:
            await self.stream.send_all(data)

    async def receive_message(self) -> str | bytes | None:
        """The next whole message; None once the connection is closed."""
        while not self.messages:
            if self.close_code is not None:
                return None
            for event in await self._read():
                await self._handle(event)
        return self.messages.popleft()

    async def send_message(self, message: str | bytes) -> None:
        """One message, text or binary as its type says (``trio.ClosedResourceError`` once
        a close was sent or received)."""
        if self.ws.state is not ConnectionState.OPEN:
            raise trio.ClosedResourceError(f"the WebSocket is closing ({self.ws.state.name})")
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        await self._send(self.ws.send(event))

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """The bytes of the binary messages, as one stream; b"" once closed."""
        while not self._buffer:
            message = await self.receive_message()
            if message is None:
                return b""
            self._buffer += message if isinstance(message, bytes) else message.encode()
        n = len(self._buffer) if max_bytes is None else max_bytes
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """``data`` as one binary message."""
        await self.send_message(bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        """Pass through to the TCP stream."""
        await self.stream.wait_send_all_might_not_block()

    async def close_handshake(self, code: int = 1000) -> None:
        """Send a close and read until the server's answer (:attr:`close_code`) or its EOF."""
        await self._send(self.ws.send(CloseConnection(code=code)))
        while self.close_code is None:
            events = await self._read()
            if not events and self.ws.state is ConnectionState.CLOSED:
                return
            for event in events:
                await self._handle(event)

    async def aclose(self, code: int = 1000) -> None:
        """Send a close (if the connection is still open), then close the socket."""
        if self.ws.state is ConnectionState.OPEN:
            with contextlib.suppress(*_GONE):
                await self._send(self.ws.send(CloseConnection(code=code)))
        await self.stream.aclose()
