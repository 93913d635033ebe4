"""A WebSocket that carries MQTT, as the ``trio.abc.Stream`` of MQTT bytes a
connection loop reads and writes (:class:`WsMqttStream`).

``receive_some`` reads the socket until the frames give MQTT bytes, answering the
opening handshake and pings on the way; ``send_all`` writes MQTT bytes as one
binary frame. A lock keeps those answers and a writer task's frames from
interleaving (trio refuses two ``send_all`` at once on one stream). A WebSocket
ending in a way MQTT calls a violation (a text frame, a broken frame, a refused
handshake) raises :class:`~servers.heartbeat.mqtt.packets.ProtocolError`, so it is logged
and counted as one; a close from the peer is an EOF.

Wrapped by the keeper's watch like any stream, so the deadlines count MQTT bytes
(MQTT's keep-alive is about MQTT packets, and a WebSocket ping proves nothing about
the client on top), while the stall check still finds the socket underneath.
"""

from __future__ import annotations

import contextlib

import trio

from ...ws.mqtt_transport import MqttOverWs
from ..mqtt.packets import ProtocolError

__all__ = ["WsMqttStream"]


class WsMqttStream(trio.abc.Stream):
    """MQTT bytes over the WebSocket on ``transport_stream`` (a TCP or TLS stream)."""

    def __init__(self, transport_stream: trio.abc.Stream, ws: MqttOverWs) -> None:
        self.transport_stream = transport_stream
        """The stream the frames travel on (its socket is the one watched)."""
        self.ws = ws
        self._sending = trio.StrictFIFOLock()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """The next MQTT bytes; b"" once the WebSocket is closed by its peer."""
        while self.ws.ended is None:
            data = await self.transport_stream.receive_some(max_bytes)
            step = self.ws.receive(bytes(data))
            if step.out:
                await self._send(step.out)
            if step.mqtt:
                return step.mqtt  # an ending behind them is found by the next call
            if step.ended is not None:
                break
        if self.ws.by_peer:
            return b""
        raise ProtocolError("websocket", detail=self.ws.ended or "")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """``data`` (MQTT bytes) as one binary frame; dropped once the WebSocket is closing."""
        frame = self.ws.send(bytes(data))
        if frame:
            await self._send(frame)

    async def _send(self, data: bytes) -> None:
        async with self._sending:
            await self.transport_stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        """Pass through to the transport."""
        await self.transport_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Close the WebSocket (a close frame, if it can go at once), then the transport."""
        frame = self.ws.close(1000)
        if frame and not self._sending.locked():
            gone = (trio.BrokenResourceError, trio.ClosedResourceError)
            with trio.CancelScope(shield=True), trio.move_on_after(0.25), contextlib.suppress(*gone):
                await self.transport_stream.send_all(frame)
        await self.transport_stream.aclose()
