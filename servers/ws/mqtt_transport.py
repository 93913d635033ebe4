"""MQTT over WebSockets (MQTT 3.1.1 §6, 5.0 §6), sans-IO: the bytes a connection
receives in, the MQTT bytes they carry and the bytes to write back out.

MQTT rides in binary frames only (MQTT-6.0.0-1: a text frame ends the connection,
with close code 1003, where Mosquitto 2.0.11 went on serving one). A frame is
handed on as wsproto yields it, a piece at a time, never reassembled: MQTT packets
may span frames and a frame may hold several (MQTT-6.0.0-2), so the MQTT reader sees
one byte stream whatever the framing, and a frame of any declared size costs no
more memory than the piece that arrived. Pings are answered at once; a close is
answered and ends the connection, as do frames that break RFC 6455 (wsproto's close
1002, 1007).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

from .handshake import Refusal, WsPolicy
from .upgrade import Offer, denial_head, read_offer

__all__ = ["MqttOverWs", "Step"]

UNSUPPORTED_DATA = 1003
"""The close code for a text frame: it carries no MQTT."""
ABNORMAL_CLOSURE = 1006
"""What wsproto reports for a connection that ended without a close frame."""


@dataclass(frozen=True, slots=True)
class Step:
    """What one :meth:`MqttOverWs.receive` made of the bytes it was given."""

    mqtt: bytes
    """MQTT bytes for the packet reader, in order (possibly part of a packet)."""
    out: bytes
    """Bytes to write to the peer (the handshake's answer, pongs, a close)."""
    ended: str | None
    """Why the connection is over (write ``out``, then close), or None."""


class MqttOverWs:
    """One WebSocket connection that carries MQTT, from its opening handshake on."""

    __slots__ = ("policy", "subprotocol", "pongs", "ended", "by_peer", "_ws", "_early")

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
        self._ws = WSConnection(ConnectionType.SERVER)
        # What came before the handshake was answered. wsproto's server side drops the
        # bytes that follow the request in the same read (its client side keeps them),
        # and a client may send its first frames without waiting for the answer.
        self._early: bytearray | None = bytearray()

    @property
    def open(self) -> bool:
        """Whether the handshake was accepted and the connection is not closing."""
        return self._ws.state is ConnectionState.OPEN and self.ended is None

    def receive(self, data: bytes) -> Step:
        """Take bytes from the peer (b"" at EOF)."""
        ws = self._ws
        mqtt: list[bytes] = []
        out: list[bytes] = []
        if self.ended is not None:
            return Step(b"", b"", self.ended)
        if self._early is not None:
            self._early += data
        try:
            ws.receive_data(data or None)
            for event in self._events():
                if isinstance(event, BytesMessage):
                    mqtt.append(bytes(event.data))
                elif isinstance(event, Request):
                    decision = self._check(event)
                    if isinstance(decision, AcceptConnection):
                        self.subprotocol = decision.subprotocol
                        out.append(ws.send(decision))
                        self._after_request()
                    else:
                        out.append(ws.send(decision.response))
                        self.ended = f"handshake refused ({decision.response.status_code}): {decision.reason}"
                        self._early = None
                        break
                elif isinstance(event, TextMessage):
                    out.append(self.close(UNSUPPORTED_DATA, "text frames carry no MQTT"))
                    self.ended = "a text frame (MQTT-6.0.0-1)"
                    break
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
                        # wsproto reports a frame it could not parse as a close event
                        # and stays open: the close is ours to send, with its code.
                        out.append(self.close(code, event.reason or ""))
                        self.ended = f"bad frame ({code}{said})"
                    else:
                        if ws.state is ConnectionState.REMOTE_CLOSING:
                            out.append(ws.send(event.response()))
                        self.ended = f"closed by the peer ({code}{said})"
                        self.by_peer = True
                    break
        except RemoteProtocolError as exc:
            if exc.event_hint is not None and ws.state is ConnectionState.CONNECTING:
                out.append(ws.send(exc.event_hint))
            self.ended = f"bad handshake: {exc}"
            self._early = None
        except UnicodeDecodeError:
            # wsproto decodes some handshake headers as ASCII and lets the error out.
            out.append(denial_head(400, [], 0))
            self.ended = "bad handshake: a header value that is not ASCII"
            self._early = None
        if not data and self.ended is None:
            self.ended = "the peer closed its side"
            self.by_peer = True
        return Step(b"".join(mqtt), b"".join(out), self.ended)

    def _after_request(self) -> None:
        early, self._early = self._early, None
        if early:
            # An upgrade request has no body: the frames start after its blank line.
            trailing = bytes(early[early.index(b"\r\n\r\n") + 4 :])
            if trailing:
                self._ws.receive_data(trailing)

    def _events(self) -> Iterator[Event]:
        # One event at a time, each handled before the next frame is parsed: a close
        # parsed early would change the state a pong before it is answered in. Bytes
        # that came behind the opening handshake are read as frames only once it is
        # answered: ask again until a pass yields nothing.
        while True:
            found = False
            for event in self._ws.events():
                found = True
                yield event
            if not found:
                return

    def _check(self, request: Request) -> AcceptConnection | Refusal:
        # wsproto's server handshake checks the version and that a key is there; RFC
        # 6455 §4.2.1 asks more (a 16-byte key, one of it, GET over HTTP/1.1), which
        # the HTTP server's own check (servers.ws.upgrade) already asks of its requests.
        head = bytes(self._early or b"").partition(b"\r\n\r\n")[0]
        line, _, rest = head.partition(b"\r\n")
        parts = line.split(b" ")
        headers = []
        for field in rest.split(b"\r\n"):
            name, _, value = field.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        version = parts[2].removeprefix(b"HTTP/") if len(parts) == 3 else b""
        offer = read_offer(parts[0], version, headers)
        if not isinstance(offer, Offer):
            status, why, extra = offer
            return Refusal(RejectConnection(status_code=status, headers=extra), why)
        return self.policy.decide(request)

    def send(self, mqtt: bytes) -> bytes:
        """MQTT bytes (one packet or several) as one binary frame; b"" once closing."""
        if not self.open:
            return b""
        return self._ws.send(BytesMessage(data=mqtt))

    def ping(self, payload: bytes = b"") -> bytes:
        """A ping to prove the peer is there (its pong counts in :attr:`pongs`)."""
        if not self.open:
            return b""
        return self._ws.send(Ping(payload=payload))

    def close(self, code: int = 1000, reason: str = "") -> bytes:
        """The close frame that ends the connection from this side (b"" if one was sent)."""
        if self._ws.state is not ConnectionState.OPEN:
            return b""
        return self._ws.send(CloseConnection(code=code, reason=reason))
