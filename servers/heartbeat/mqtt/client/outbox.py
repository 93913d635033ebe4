"""A client's outbound messages: those in flight (sent at QoS 1 or 2, not yet done) and
those queued behind the window, with the packet identifiers they and the pending
SUBSCRIBE and UNSUBSCRIBE hold. Bookkeeping only: no encoding, no I/O.

The messages outlive network connections: a bridge promises its QoS 1 and 2 messages
through a remote's restart, so nothing here forgets one until it is done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from ..v5.properties import EMPTY, Properties

__all__ = ["Outbox", "Outgoing"]


@dataclass(slots=True, eq=False)
class Outgoing:
    """One message to send: what :meth:`~.session.ClientSession.publish` was given, its
    token, and where it stands (``packet_id`` once in flight; ``released`` once the
    remote's PUBREC has it waiting for our PUBREL). Mutable: the session moves it on."""

    token: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: Properties = EMPTY
    packet_id: int | None = None
    released: bool = False


class Outbox:
    """The messages of one client, in the order they were published.

    ``window`` is how many QoS 1/2 messages may be in flight at once; the session
    sets it from its options and the remote's Receive Maximum.
    """

    __slots__ = ("inflight", "queue", "requests", "window", "_next_id", "_next_token")

    def __init__(self, window: int) -> None:
        self.inflight: dict[int, Outgoing] = {}
        """Messages sent and not yet done, by packet id, in the order first sent."""
        self.queue: deque[Outgoing] = deque()
        """Messages waiting: for a connection, or for room in the window."""
        self.requests: dict[int, int] = {}
        """Pending SUBSCRIBE and UNSUBSCRIBE: packet id -> how many filters it named."""
        self.window = window
        self._next_id = 1
        self._next_token = 1

    def new(self, topic: str, payload: bytes, qos: int, retain: bool, properties: Properties) -> Outgoing:
        """A message with the next token, not yet placed."""
        token, self._next_token = self._next_token, self._next_token + 1
        return Outgoing(token, topic, payload, qos, retain, properties)

    @property
    def room(self) -> bool:
        """Whether one more QoS 1/2 message may go out now."""
        return len(self.inflight) < self.window

    def allocate(self) -> int:
        """A packet id no message in flight nor pending request holds (1 to 65535)."""
        if len(self.inflight) + len(self.requests) >= 0xFFFF:
            raise RuntimeError("every packet identifier is in use")
        ident = self._next_id
        while ident in self.inflight or ident in self.requests:
            ident = ident % 0xFFFF + 1
        self._next_id = ident % 0xFFFF + 1
        return ident

    def fly(self, message: Outgoing, packet_id: int) -> None:
        """``message`` goes out under ``packet_id``."""
        message.packet_id = packet_id
        self.inflight[packet_id] = message

    def done(self, packet_id: int) -> Outgoing:
        """The message ``packet_id`` is finished: it leaves the window."""
        return self.inflight.pop(packet_id)

    def forget_flight(self) -> None:
        """The remote has no session: every message in flight is sent again as new, ahead
        of those queued and in its first order (its old packet id means nothing now)."""
        again = list(self.inflight.values())
        self.inflight.clear()
        for message in again:
            message.packet_id = None
            message.released = False
        self.queue.extendleft(reversed(again))

    def __iter__(self) -> Iterator[Outgoing]:
        """Every message not yet done: in flight first, then queued."""
        yield from self.inflight.values()
        yield from self.queue
