"""MQTT over WebSockets (MQTT 3.1.1 §6, 5.0 §6), sans-IO: the bytes a connection
receives in, the MQTT bytes they carry and the bytes to write back out.

MQTT rides in binary frames only (MQTT-6.0.0-1: a text frame ends the connection,
with close code 1003, where Mosquitto 2.0.11 went on serving one). A frame is
handed on as wsproto yields it, a piece at a time, never reassembled: MQTT packets
may span frames and a frame may hold several (MQTT-6.0.0-2), so the MQTT reader sees
one byte stream whatever the framing, and a frame of any declared size costs no
more memory than the piece that arrived. Pings are answered at once; a close is
answered and ends the connection, as do frames that break RFC 6455 (wsproto's close
1002, 1007). The opening handshake is checked as the HTTP server checks its own
(:mod:`.upgrade`: 400, or 426 for another version; 431 past :data:`MAX_HEAD`).
"""

from __future__ import annotations

from dataclasses import dataclass

import h11
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import (
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    Request,
    TextMessage,
)

from .handshake import Refusal, WsPolicy
from .session import quiet_events
from .upgrade import Offer, accept_head, denial_head, is_upgrade, read_offer

__all__ = ["MAX_HEAD", "MqttOverWs", "Step"]

UNSUPPORTED_DATA = 1003
"""The close code for a text frame: it carries no MQTT."""
ABNORMAL_CLOSURE = 1006
"""What wsproto reports for a connection that ended without a close frame."""
MAX_HEAD = 16 * 1024
"""The longest opening handshake read (h11's default limit for a request head): 431 past it."""


@dataclass(frozen=True, slots=True)
class Step:
    """What one :meth:`MqttOverWs.receive` made of the bytes it was given."""

    mqtt: bytes
    """MQTT bytes for the packet reader, in order (possibly part of a packet)."""
    out: bytes
    """Bytes to write to the peer (the handshake's answer, pongs, a close)."""
    ended: str | None
    """Why the connection is over (write ``out``, then close), or None."""


class _Refused(Exception):
    """An opening handshake turned down: the status, why, and headers to answer with."""

    def __init__(self, status: int, why: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(why)
        self.status = status
        self.why = why
        self.headers = headers or []


class MqttOverWs:
    """One WebSocket connection that carries MQTT, from its opening handshake on.

    The handshake is read and answered here (:mod:`.upgrade`, the checks the HTTP
    server makes of its own upgrades, then the listener's :class:`~.handshake.WsPolicy`);
    only then is wsproto's frame layer made. Nothing of the handshake outlives it: a
    device held for days keeps the frame layer alone (wsproto's own server handshake
    kept its h11 connection and two empty event queues, 3.5 KiB of a device's 6.4).
    """

    __slots__ = ("policy", "subprotocol", "pongs", "ended", "by_peer", "_ws", "_head")

    def __init__(self, policy: WsPolicy) -> None:
        self.policy = policy
        self.subprotocol: str | None = None
        """The subprotocol the handshake chose (``mqtt``), once accepted."""
        self.pongs = 0
        """Pongs received: each answers a ping the server sent (a liveness deadline's proof)."""
        self.ended: str | None = None
        self.by_peer = False
        """Whether the peer ended it, by a close frame or an EOF (an EOF to the MQTT
        reader); else :attr:`ended` is a violation."""
        self._ws: Connection | None = None
        self._head: bytearray | None = bytearray()  # the opening handshake, as it arrives

    @property
    def open(self) -> bool:
        """Whether the handshake was accepted and the connection is not closing."""
        return self._ws is not None and self._ws.state is ConnectionState.OPEN and self.ended is None

    def receive(self, data: bytes) -> Step:
        """Take bytes from the peer (b"" at EOF)."""
        if self.ended is not None:
            return Step(b"", b"", self.ended)
        mqtt: list[bytes] = []
        out: list[bytes] = []
        frames: bytes | None = data
        if self._ws is None:
            frames = self._handshake(data, out)
        ws = self._ws
        if ws is not None and frames is not None and (frames or not data):
            ws.receive_data(frames or None)
            for event in ws.events():
                # One event at a time, each handled before the next frame is parsed: a
                # close parsed early would change the state a pong is answered in.
                if self._handle(event, ws, mqtt, out):
                    break
        if not data and self.ended is None:
            self.ended = "the peer closed its side"
            self.by_peer = True
        return Step(b"".join(mqtt), b"".join(out), self.ended)

    def _handle(self, event: Event, ws: Connection, mqtt: list[bytes], out: list[bytes]) -> bool:
        """Act on one frame-layer event; True once the connection is over."""
        if isinstance(event, BytesMessage):
            mqtt.append(bytes(event.data))
        elif isinstance(event, TextMessage):
            out.append(self.close(UNSUPPORTED_DATA, "text frames carry no MQTT"))
            self.ended = "a text frame (MQTT-6.0.0-1)"
            return True
        elif isinstance(event, Ping):
            if ws.state is ConnectionState.OPEN:
                out.append(ws.send(event.response()))
        elif isinstance(event, Pong):
            self.pongs += 1
        elif isinstance(event, CloseConnection):
            code = int(event.code)
            said = f": {event.reason}" if event.reason else ""
            if code == ABNORMAL_CLOSURE:
                self.ended = "the peer closed its side"  # EOF, no close frame
                self.by_peer = True
            elif ws.state is ConnectionState.OPEN:
                # wsproto reports a frame it could not parse as a close event and
                # stays open: the close is ours to send, with its code.
                out.append(self.close(code, event.reason or ""))
                self.ended = f"bad frame ({code}{said})"
            else:
                if ws.state is ConnectionState.REMOTE_CLOSING:
                    out.append(ws.send(event.response()))
                self.ended = f"closed by the peer ({code}{said})"
                self.by_peer = True
            return True
        return False

    def _handshake(self, data: bytes, out: list[bytes]) -> bytes | None:
        """Gather the opening handshake and answer it; the bytes behind it (a client may
        send its first frames without waiting for the 101), or None while it is not
        complete or was refused."""
        head = self._head
        assert head is not None
        head += data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > MAX_HEAD:
                self._refuse(out, _Refused(431, f"bad handshake: a request head over {MAX_HEAD} bytes"))
            return None
        request, rest = bytes(head[: end + 4]), bytes(head[end + 4 :])
        self._head = None
        try:
            offer, subprotocol = self._decide(request)
        except _Refused as refused:
            self._refuse(out, refused)
            return None
        self.subprotocol = subprotocol
        out.append(accept_head(offer, subprotocol=subprotocol))
        self._ws = Connection(ConnectionType.SERVER)
        quiet_events(self._ws)
        return rest

    def _decide(self, head: bytes) -> tuple[Offer, str]:
        # RFC 6455 §4.2.1 first (as the HTTP server asks of its own upgrades), then
        # the listener's rules (path, origin, subprotocol).
        parser = h11.Connection(h11.SERVER)
        parser.receive_data(head)
        try:
            request = parser.next_event()
        except h11.RemoteProtocolError as exc:
            raise _Refused(exc.error_status_hint, f"bad handshake: {exc}") from None
        if not isinstance(request, h11.Request):  # pragma: no cover - a whole head was given
            raise _Refused(400, "bad handshake: no request head")
        headers = [(bytes(name), bytes(value)) for name, value in request.headers]
        if not is_upgrade(headers):
            raise _Refused(400, "bad handshake: not a WebSocket upgrade (no Upgrade: websocket)")
        offer = read_offer(request.method, request.http_version, headers)
        if not isinstance(offer, Offer):
            status, why, extra = offer
            raise _Refused(status, f"bad handshake: {why}", extra)
        try:
            host = next((value for name, value in headers if name == b"host"), b"").decode("ascii")
            target = bytes(request.target).decode("ascii")
        except UnicodeDecodeError:
            raise _Refused(400, "bad handshake: a header value that is not ASCII") from None
        wanted = Request(host=host, target=target, subprotocols=offer.subprotocols, extra_headers=headers)
        decision = self.policy.decide(wanted)
        if isinstance(decision, Refusal):
            response = decision.response
            raise _Refused(response.status_code, f"handshake refused ({response.status_code}): {decision.reason}")
        assert decision.subprotocol is not None  # the policy accepts with one of its own
        return offer, decision.subprotocol

    def _refuse(self, out: list[bytes], refused: _Refused) -> None:
        out.append(denial_head(refused.status, refused.headers, 0))
        self.ended = refused.why
        self._head = None

    def send(self, mqtt: bytes) -> bytes:
        """MQTT bytes (one packet or several) as one binary frame; b"" once closing."""
        if self._ws is None or not self.open:
            return b""
        return self._ws.send(BytesMessage(data=mqtt))

    def ping(self, payload: bytes = b"") -> bytes:
        """A ping to prove the peer is there (its pong counts in :attr:`pongs`)."""
        if self._ws is None or not self.open:
            return b""
        return self._ws.send(Ping(payload=payload))

    def close(self, code: int = 1000, reason: str = "") -> bytes:
        """The close frame that ends the connection from this side (b"" if one was sent)."""
        if self._ws is None or self._ws.state is not ConnectionState.OPEN:
            return b""
        return self._ws.send(CloseConnection(code=code, reason=reason))
