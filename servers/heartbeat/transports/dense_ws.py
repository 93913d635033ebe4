"""MQTT over WebSockets on the dense engine: no task per connection, as over TCP.

A :class:`WsDenseConnection` is a :class:`~.dense.DenseConnection` whose bytes pass
through :class:`~servers.ws.mqtt_transport.MqttOverWs` first: what the engine reads
is unframed before the MQTT reader sees it, and every MQTT write goes out as a
binary frame. The handshake's answer, pongs and close frames are written as they
are. The CONNECT deadline, which starts at accept, covers the opening handshake;
the keep-alive and the stall check are the transport's, as over TCP (any byte the
client sends refreshes them there, a WebSocket ping included: it proves the
connection alive; the streams engine counts MQTT bytes only).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import idlekeeper

from ...ws.handshake import WsPolicy
from ...ws.mqtt_transport import MqttOverWs
from ..mqtt.packets import ProtocolError
from ..server.doors import Door
from ..server.lifecycle import HeartbeatServer
from ..server.sys_tree import count_out
from .dense import DenseConnection, T

__all__ = ["WsDenseConnection", "serve_websockets_dense"]


class WsDenseConnection(DenseConnection):
    """One MQTT-over-WebSocket client served by the dense engine's callbacks."""

    __slots__ = ("ws", "later")
    ANSWERS_IN_ENGINE = False  # the transport's bytes are WebSocket frames, not MQTT's

    def __init__(self, server: HeartbeatServer, door: Door, policy: WsPolicy) -> None:
        super().__init__(server, door)
        self.ws = MqttOverWs(policy)
        self.later: str | None = None
        """How the WebSocket ended, while packets before the end wait for a password
        check or a session lookup: acted on once they are handled."""

    def data_received(self, data: bytes) -> None:
        """Unframe what arrived; hand its MQTT bytes on."""
        step = self.ws.receive(data)
        if step.out:
            self.stream.write(step.out)
        if step.mqtt:
            self.server.counters["bytes_in"] += len(step.mqtt)  # MQTT's bytes, as Mosquitto counts them
            self._received(step.mqtt)
        ended = step.ended
        if ended is not None:
            if self.waiting is not None:
                self.later = ended  # the CONNECT before it is still being vetted
            else:
                self._ended(ended)

    def _ended(self, ended: str) -> None:
        if self.stream.is_closing():
            return
        if self.ws.by_peer:
            self.stream.close()  # as an EOF over TCP
        else:
            self._violation(ProtocolError("websocket", detail=ended))

    async def _resume_after(self, work: Callable[[T], Awaitable[bool]], arg: T) -> None:
        await super()._resume_after(work, arg)
        later, self.later = self.later, None
        if later is not None and not self.finished:
            self._ended(later)

    def eof_received(self) -> bool | None:
        """The client's EOF is the WebSocket's end, as over TCP."""
        self.ws.receive(b"")
        return None

    def write(self, data: bytes) -> None:
        """MQTT bytes as one binary frame (nothing once the WebSocket is closing)."""
        count_out(self.server.counters, data)
        frame = self.ws.send(data)
        if frame:
            self.stream.write(frame)

    def close(self) -> None:
        """A close frame, then the close once the queue is out."""
        frame = self.ws.close(1000)
        if frame:
            self.stream.write(frame)
        self.stream.close()

    def last_words(self, reason: idlekeeper.Reason) -> bytes | None:
        """An MQTT 5 client's DISCONNECT (0x8D) in a frame, and the close frame."""
        said = super().last_words(reason)
        if said is None:
            return None
        return self.ws.send(said) + self.ws.close(1000)


def serve_websockets_dense(server: HeartbeatServer, engine: idlekeeper.Engine, door: Door) -> None:
    """MQTT over WebSockets on ``door`` (one without TLS), on the engine that serves the
    TCP listeners: the engine's closer (``server.closers``) closes them all at once."""
    config = server.config
    policy = WsPolicy(config.ws_path, allowed_origins=config.ws_allowed_origins)
    engine.serve(door.sockets, lambda: WsDenseConnection(server, door, policy))
