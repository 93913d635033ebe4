"""A session's outbound QoS 1 and 2 messages, sans-IO: the in-flight window and the queue behind it.

MQTT 3.1.1 (4.3, 4.4) asks the server to keep every QoS 1 and 2 message it sends
until the client acknowledges it (PUBACK; PUBREC then PUBCOMP), to resend the
unacknowledged ones with DUP when the client reconnects to a persistent session
(and PUBREL for a QoS 2 message whose PUBREC came), and to deliver in order. An
:class:`Outbox` does that bookkeeping and returns the bytes to write; it never
touches a socket. A connection with a clean session owns one for as long as it
lives; a persistent session's outbox lives in the session store, which outlives
the connection.

Bounds, as Mosquitto has them: at most ``window`` messages in flight (its
``max_inflight_messages``, 20) and, if ``window_bytes`` is set, payload bytes in
flight up to it (``max_inflight_bytes``, 0: none; see :meth:`Outbox.admits`), at most
``max_queued`` messages and
``max_queued_bytes`` behind them (``max_queued_messages``, 1,000); a message beyond
them is dropped and counted, the newest first, so what was queued keeps its order.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from ..mqtt.encoders import PUBLISH_HEAD, U16, encode_held, encode_pubrel
from ..mqtt.v5 import outbound

__all__ = [
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_MAX_QUEUED_BYTES",
    "DEFAULT_WINDOW",
    "Message",
    "MessageJournal",
    "Outbox",
    "Stage",
]

DEFAULT_WINDOW = 20
"""Messages in flight (sent, not yet acknowledged) per client."""
DEFAULT_MAX_QUEUED = 1000
"""Messages queued behind the window per client."""
DEFAULT_MAX_QUEUED_BYTES = 16 * 1024 * 1024
"""Payload and topic bytes queued behind the window per client."""


class Stage(enum.Enum):
    """Where an in-flight message is in its exchange."""

    PUBLISHED = "published"
    """PUBLISH sent; waiting for PUBACK (QoS 1) or PUBREC (QoS 2)."""
    RELEASED = "released"
    """QoS 2: PUBREC came and PUBREL was sent; waiting for PUBCOMP."""


_PUBLISHED = Stage.PUBLISHED


class Message:
    """One outbound message: what to publish, and (once in flight) its packet id and stage."""

    # A persistent session of a vanished device may hold a thousand of these.
    __slots__ = (
        "topic", "payload", "qos", "retain", "properties", "group", "packet_id", "stage", "sent", "born", "seq"
    )  # fmt: skip

    def __init__(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool = False,
        properties: bytes | None = None,
        group: str = "",
    ) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.properties = properties
        """For an MQTT 5 client: the publisher's properties, packed (maybe empty); None
        for a 3.1.1 client, whose PUBLISH has no room for them."""
        self.group = group
        """The shared subscription (``$share/...``) it came through, if any: should its
        client leave without acknowledging it, another member gets it."""
        self.packet_id = 0
        self.stage = Stage.PUBLISHED
        self.sent = False
        """Whether it was ever written: a resend then carries DUP (MQTT-3.3.1-1)."""
        self.born = 0.0
        """When its outbox took it (its clock), if it has an MQTT 5 Message Expiry to count down."""
        self.seq = 0
        """Its number in a durable store (0: not kept in one)."""

    @property
    def size(self) -> int:
        """What it counts against the queue's byte bound."""
        return len(self.topic) + len(self.payload)

    def expired(self, now: float) -> bool:
        """Whether its MQTT 5 Message Expiry has run out (one that has none never does)."""
        expiry = outbound.message_expiry(self.properties or b"") if self.born else None
        return expiry is not None and now - self.born >= expiry

    def wire(self, now: float = 0.0) -> bytes:
        """The packet that (re)sends it, and marks it sent; an MQTT 5 Message Expiry is
        sent as what is left of it at ``now`` (at least a second: a resend completes a
        delivery already begun)."""
        if self.stage is Stage.RELEASED:
            return encode_pubrel(self.packet_id)
        properties = self.properties
        if properties is None:
            data = encode_held(self.topic, self.payload, self.qos, self.retain, self.packet_id, self.sent)
        else:
            expiry = outbound.message_expiry(properties) if self.born else None
            if expiry is not None:
                properties = outbound.counted_down(properties, min(now - self.born, expiry - 1)) or properties
            data = outbound.publish(
                self.topic, self.payload, self.qos, self.retain, self.packet_id, self.sent, properties
            )
        self.sent = True
        return data

    def __repr__(self) -> str:
        return f"Message({self.topic!r}, qos={self.qos}, id={self.packet_id}, {self.stage.value})"


class MessageJournal(Protocol):
    """Who is told of every change to a persistent session's messages, so that a durable
    store writes only what changed (:mod:`..coordination.durable`)."""

    def kept(self, message: Message) -> None:
        """``message`` was taken (queued, or sent at once)."""
        ...

    def changed(self, message: Message) -> None:
        """``message`` was sent (given its packet id), released (PUBREC came) or rewritten."""
        ...

    def gone(self, message: Message) -> None:
        """``message`` left: acknowledged to the end, or expired unsent."""
        ...


class Outbox:
    """The in-flight window and the queue of one client's QoS 1 and 2 messages.

    While the client is connected (:attr:`attached`), every method returns the
    packets to write now, in order. While it is away, messages queue and nothing is
    returned; :meth:`attach` then returns the resends (DUP) and the next messages.
    """

    __slots__ = (
        "window",
        "window_bytes",
        "max_queued",
        "max_queued_bytes",
        "attached",
        "dropped",
        "expired",
        "clock",
        "journal",
        "_inflight",
        "_queue",
        "_bytes",
        "_flying",
    )

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        *,
        window_bytes: int = 0,
        attached: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 1:
            raise ValueError("the window must hold at least one message")
        if window_bytes < 0:
            raise ValueError("the window's bytes must be 0 (no bound) or more")
        self.window = window
        self.window_bytes = window_bytes
        """Payload bytes in flight past which no more messages go (0: no bound)."""
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.attached = attached
        self.dropped = 0
        """Messages dropped because the queue was full."""
        self.expired = 0
        """MQTT 5 messages dropped from the queue: their Message Expiry ran out first."""
        self.clock = clock
        """What an MQTT 5 Message Expiry is counted down by."""
        self.journal: MessageJournal | None = None
        """Told of every change to the messages, where they are kept durably."""
        # Insertion order is send order, which is the order resends must keep (4.6).
        self._inflight: dict[int, Message] = {}
        self._queue: collections.deque[Message] = collections.deque()
        self._bytes = 0
        self._flying = 0

    def __len__(self) -> int:
        """Messages held: in flight and queued."""
        return len(self._inflight) + len(self._queue)

    @property
    def queued_bytes(self) -> int:
        """Bytes of the messages waiting behind the window."""
        return self._bytes

    @property
    def inflight_bytes(self) -> int:
        """Payload bytes of the messages in flight (what ``window_bytes`` bounds)."""
        return self._flying

    def admits(self) -> bool:
        """Whether the window has room for one more message, whatever its size.

        Mosquitto's rule (``db__ready_for_flight``): a count below ``window`` and, when
        ``window_bytes`` is set, payload bytes in flight *below* it. The message is not
        weighed first, so the last one let in may go past the bound by its own size, and
        one message always goes when nothing is in flight however large it is; counted
        otherwise, a message larger than the bound could never be sent."""
        if len(self._inflight) >= self.window:
            return False
        return not self.window_bytes or self._flying < self.window_bytes

    def inflight(self) -> list[Message]:
        """The messages sent and not yet acknowledged, oldest first."""
        return list(self._inflight.values())

    def queued(self) -> list[Message]:
        """The messages waiting behind the window, oldest first."""
        return list(self._queue)

    def push(self, message: Message) -> list[bytes]:
        """Take a QoS 1 or 2 message; returns what to write now (nothing while away or
        while the window is full). A message beyond the queue's bounds is dropped."""
        if message.qos not in (1, 2):
            raise ValueError("only QoS 1 and 2 messages are held")
        if message.properties and outbound.message_expiry(message.properties) is not None:
            message.born = self.clock()
        journal = self.journal
        if self.attached and not self._queue and self.admits():
            data = self._launch(message, message.born)  # taken now: none of its lifetime has gone
            if journal is not None:
                journal.kept(message)
            return [data]
        size = message.size
        if len(self._queue) >= self.max_queued or self._bytes + size > self.max_queued_bytes:
            self.dropped += 1
            return []
        self._queue.append(message)
        self._bytes += size
        if journal is not None:
            journal.kept(message)
        return []

    def puback(self, packet_id: int) -> list[bytes]:
        """The client acknowledged a QoS 1 message; returns what to write next."""
        return self.acknowledge((("puback", packet_id),))

    def pubrec(self, packet_id: int) -> list[bytes]:
        """The client received a QoS 2 message: answer PUBREL (resent as PUBREL from now on)."""
        return self.acknowledge((("pubrec", packet_id),))

    def pubcomp(self, packet_id: int) -> list[bytes]:
        """The QoS 2 exchange is complete; returns what to write next."""
        return self.acknowledge((("pubcomp", packet_id),))

    def acknowledge(self, acks: Iterable[tuple[str, int]]) -> list[bytes]:
        """Acknowledgements read together, in order (``kind``: ``puback``, ``pubrec`` or
        ``pubcomp``, and the packet id); returns what to write next: a PUBREL per PUBREC,
        then the messages that take the freed places. An acknowledgement of nothing in
        flight, or of the wrong kind, is ignored: the spec leaves a stale or confused
        one to the server.

        The window is refilled once, after all of them, not once per acknowledgement:
        the same messages go out in the same order, in one write instead of many."""
        inflight = self._inflight
        journal = self.journal
        out: list[bytes] = []
        freed = False
        for kind, packet_id in acks:
            message = inflight.get(packet_id)
            if message is None:
                continue
            if kind == "puback":
                if message.qos == 1:
                    del inflight[packet_id]
                    self._flying -= len(message.payload)
                    freed = True
                    if journal is not None:
                        journal.gone(message)
            elif kind == "pubrec":
                if message.qos == 2:
                    message.stage = Stage.RELEASED
                    if journal is not None:
                        journal.changed(message)
                    if self.attached:
                        out.append(encode_pubrel(packet_id))
            elif kind == "pubcomp":
                if message.stage is Stage.RELEASED:
                    del inflight[packet_id]
                    self._flying -= len(message.payload)
                    freed = True
                    if journal is not None:
                        journal.gone(message)
            else:
                raise ValueError(f"not an acknowledgement: {kind!r}")
        if freed:
            out += self._fill()
        return out

    def restore(self, inflight: Iterable[Message], queued: Iterable[Message]) -> None:
        """Take back what a durable store kept: the messages in flight, in the order they
        were sent, with their packet ids and stages (each counts as sent: a resend
        carries DUP), then the queue behind them. Nothing is written until :meth:`attach`."""
        for message in inflight:
            message.sent = True
            self._inflight[message.packet_id] = message
            self._flying += len(message.payload)
        for message in queued:
            self._queue.append(message)
            self._bytes += message.size

    def attach(self) -> list[bytes]:
        """The client (re)connected: resend everything in flight, in order, then fill the window."""
        self.attached = True
        now = self.clock()
        resent = [m.wire(now) for m in self._inflight.values()]
        return resent + self._fill()

    def detach(self) -> None:
        """The client went away: hold everything until it returns."""
        self.attached = False

    def _fill(self) -> list[bytes]:
        inflight = self._inflight
        queue = self._queue
        room = self.window - len(inflight)
        if not queue or room <= 0 or not self.attached:
            return []
        # No byte bound reads as one no message reaches, so the loop tests one number.
        limit = self.window_bytes or (1 << 62)
        flying = self._flying
        # A stored queue drains through here a window at a time, so the launch of each
        # message is inline (_launch's and _free_id's work, the same ids in the same order),
        # and so is encode_held's commonest case: a QoS 1 or 2 PUBLISH whose remaining
        # length fits a byte, its topic encoded once for a run of messages that share it.
        out: list[bytes] = []
        append = out.append
        now = self.clock()
        last = next(reversed(inflight), 0)
        taken = 0
        topic: str | None = None
        name = b""
        fixed = 0
        journal = self.journal
        while queue and room and flying < limit:
            message = queue.popleft()
            payload = message.payload
            taken += len(message.topic) + len(payload)  # Message.size, without its call
            if message.born and message.expired(now):
                self.expired += 1  # §3.3.2.3.3: not yet sent, and past its lifetime: deleted
                if journal is not None:
                    journal.gone(message)
                continue
            last = last % 65535 + 1
            while last in inflight:
                last = last % 65535 + 1
            message.packet_id = last
            inflight[last] = message
            room -= 1
            flying += len(payload)
            if journal is not None:
                journal.changed(message)
            if message.properties is not None or message.stage is not _PUBLISHED:
                append(message.wire(now))
                continue
            if message.topic != topic:
                topic = message.topic
                name = topic.encode("utf-8")
                fixed = 4 + len(name)  # the topic's length, the topic, the packet id
            length = fixed + len(payload)
            if length < 0x80:
                first = 0x30 | (0x08 if message.sent else 0) | (message.qos << 1) | (0x01 if message.retain else 0)
                append(b"".join((PUBLISH_HEAD.pack(first, length, fixed - 4), name, U16.pack(last), payload)))
            else:
                append(encode_held(topic, payload, message.qos, message.retain, last, message.sent))
            message.sent = True
        self._bytes -= taken
        self._flying = flying
        return out

    def _launch(self, message: Message, now: float) -> bytes:
        message.packet_id = self._free_id()
        self._inflight[message.packet_id] = message
        self._flying += len(message.payload)
        return message.wire(now)

    def _free_id(self) -> int:
        # The window is far smaller than 65,535, so a free id is always near.
        last = next(reversed(self._inflight), 0) if self._inflight else 0
        candidate = last % 65535 + 1
        while candidate in self._inflight:
            candidate = candidate % 65535 + 1
        return candidate
