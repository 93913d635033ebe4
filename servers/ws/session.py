"""An open WebSocket's frames, sans-IO: bytes in, whole messages and bytes to write
out (RFC 6455 §5, on wsproto's frame layer).

For an ASGI app, which is handed whole messages: fragments are joined here, up to
``max_size`` bytes a message (as uvicorn's ``--ws-max-size``); a longer message ends
the connection with 1009 once ``max_size`` bytes of it are held, whatever length its
frames declare. Compressed messages are bounded the same way while they inflate
(:mod:`.deflate`). Pings are answered at once; frames that break the protocol are
answered with wsproto's close code (1002, 1007) and end the connection.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.extensions import Extension
from wsproto.frame_protocol import CloseReason

from .fastpath import frame_message, read_whole_frames, wsproto_idle

__all__ = ["MESSAGE_TOO_BIG", "Closed", "Received", "WsSession", "quiet_events"]

MESSAGE_TOO_BIG = CloseReason.MESSAGE_TOO_BIG.value
ABNORMAL_CLOSURE = CloseReason.ABNORMAL_CLOSURE.value


@dataclass(frozen=True, slots=True)
class Closed:
    """How the connection ended: the close code and reason, and who sent them."""

    code: int
    reason: str
    by_peer: bool
    """False when this side ended it (a bad frame, a message too big)."""


@dataclass(slots=True)
class Received:
    """What one :meth:`WsSession.receive` made of the bytes it was given."""

    messages: list[str | bytes]
    """Whole messages, in order: ``str`` from text frames, ``bytes`` from binary."""
    out: bytes
    """Bytes to write to the peer (pongs, the close that answers the peer's)."""
    closed: Closed | None
    """Set once the connection is over: write ``out``, then close the socket."""


class _Rare:
    """What wsproto's connection needs of its event queue (``append``, ``popleft``,
    truth), holding nothing until an event is queued."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[object] | None = None

    def append(self, item: object) -> None:
        if self.items is None:
            self.items = []
        self.items.append(item)

    def popleft(self) -> object:
        assert self.items
        return self.items.pop(0)

    def __bool__(self) -> bool:
        return bool(self.items)


def quiet_events(ws: Connection) -> None:
    """Give ``ws`` an event queue that holds nothing until an event is queued.

    wsproto queues events there only for an EOF; an empty deque is 0.7 KiB, most of
    an idle WebSocket's frame layer."""
    if isinstance(ws._events, deque) and not ws._events:
        ws._events = _Rare()  # type: ignore[assignment]


class WsSession:
    """One WebSocket after its opening handshake, on the server side."""

    __slots__ = ("max_size", "closed", "_ws", "_parts", "_size", "_plain")

    def __init__(self, *, max_size: int, extensions: list[Extension] | None = None) -> None:
        self.max_size = max_size
        self.closed: Closed | None = None
        self._ws = ws = Connection(ConnectionType.SERVER, extensions)
        quiet_events(ws)
        self._parts: list[str | bytes] | None = None  # a message still arriving, by fragments
        self._size = 0
        # No extension: whole plain frames may be read and written past wsproto (.fastpath).
        self._plain = not extensions

    @property
    def open(self) -> bool:
        """Whether messages may still be sent (no close sent or received)."""
        return self._ws.state is ConnectionState.OPEN

    @property
    def closing(self) -> bool:
        """Whether this side has sent its close and waits for the peer's."""
        return self._ws.state is ConnectionState.LOCAL_CLOSING

    def receive(self, data: bytes) -> Received:
        """Take bytes from the peer; ``b""`` is its EOF."""
        got = Received([], b"", self.closed)
        if self.closed is not None:
            return got
        ws = self._ws
        if data and self._plain and self._parts is None and ws.state is ConnectionState.OPEN and wsproto_idle(ws):
            taken = read_whole_frames(data, self.max_size, got.messages)
            if taken == len(data):
                return got
            data = data[taken:]
        out: list[bytes] = []
        ws.receive_data(data or None)
        for event in ws.events():
            if isinstance(event, TextMessage | BytesMessage):
                if ws.state is not ConnectionState.OPEN:
                    continue  # data after our close is dropped (RFC 6455 §1.4)
                message = self._add(event.data, event.message_finished)
                if message is not None:
                    got.messages.append(message)
                elif self._size > self.max_size:
                    out.append(self._end(MESSAGE_TOO_BIG, f"message over {self.max_size} bytes"))
                    break
            elif isinstance(event, Ping):
                if ws.state is ConnectionState.OPEN:
                    out.append(ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                out.append(self._closed(event))
                break
        got.out = b"".join(out)
        got.closed = self.closed
        return got

    def _add(self, data: str | bytes | bytearray, finished: bool) -> str | bytes | None:
        piece: str | bytes = data if isinstance(data, str) else bytes(data)
        if finished and self._parts is None:
            if len(piece) > self.max_size:
                self._size = len(piece)
                return None
            return piece
        parts = self._parts if self._parts is not None else []
        parts.append(piece)
        self._size += len(piece)
        if self._size > self.max_size:
            self._parts = None
            return None
        if not finished:
            self._parts = parts
            return None
        self._parts, self._size = None, 0
        return "".join(parts) if isinstance(piece, str) else b"".join(parts)  # type: ignore[arg-type]

    def _closed(self, event: CloseConnection) -> bytes:
        ws = self._ws
        code, reason = int(event.code), event.reason or ""
        if code == ABNORMAL_CLOSURE:
            self.closed = Closed(code, "", by_peer=True)  # EOF without a close frame
            return b""
        if ws.state is ConnectionState.OPEN:
            # wsproto reports a frame it could not parse as a close event and stays
            # open: the close is ours to send, with its code.
            return self._end(code, reason)
        if ws.state is ConnectionState.LOCAL_CLOSING:
            self.closed = Closed(code, reason, by_peer=False)  # a bad frame while we close
            return b""
        self.closed = Closed(code, reason, by_peer=True)
        if ws.state is ConnectionState.REMOTE_CLOSING:
            return ws.send(event.response())
        return b""  # the answer to our own close

    def _end(self, code: int, reason: str) -> bytes:
        self.closed = Closed(code, reason, by_peer=False)
        return self._ws.send(CloseConnection(code=code, reason=reason[:120]))

    def send(self, message: str | bytes) -> bytes:
        """One message as a frame; b"" once a close has been sent or received."""
        if self._ws.state is not ConnectionState.OPEN:
            return b""
        if self._plain:
            return frame_message(message)
        if isinstance(message, str):
            return self._ws.send(TextMessage(data=message))
        return self._ws.send(BytesMessage(data=message))

    def ping(self, payload: bytes = b"") -> bytes:
        """A ping: the peer's pong is a read, which keeps its receive deadline fresh."""
        if self._ws.state is not ConnectionState.OPEN:
            return b""
        return self._ws.send(Ping(payload=payload))

    def close(self, code: int = 1000, reason: str = "") -> bytes:
        """This side's close frame; b"" if one was already sent. The connection is
        over once the peer answers (:attr:`closed`), or at the close timeout."""
        if self._ws.state is not ConnectionState.OPEN:
            return b""
        return self._ws.send(CloseConnection(code=code, reason=reason))
