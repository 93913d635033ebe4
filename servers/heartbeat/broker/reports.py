"""What a worker and the owner of its persistent sessions tell each other, pure records:
the reports a worker makes of a session's life in order (:data:`Report`: attached,
detached, subscribed, acknowledged...), and what the owner answers (:class:`Opened` for
a CONNECT, :class:`Delivery` for packets to write). They cross the bus between workers
and the Redis fleet's queue unchanged, so each is a small immutable record."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable

from ..mqtt.records import record

__all__ = [
    "Acked",
    "AckedTogether",
    "Attach",
    "Delivery",
    "Detach",
    "Discard",
    "Inbound",
    "Opened",
    "Push",
    "Report",
    "Subscribed",
]


@record
class Opened:
    """What a CONNECT finds: CONNACK's session-present flag and the session to restore
    (with its subscriptions' MQTT 5 options, for those that have any)."""

    present: bool
    subscriptions: dict[str, int]
    inbound: frozenset[int]
    options: dict[str, int] = dataclasses.field(default_factory=dict)
    kept: bool = True
    """Whether the store keeps a session for the connection: False when it was asked
    to resume one only (MQTT 5's Clean Start 0 with Session Expiry 0) and had none."""


@record
class Delivery:
    """Packets for the connection of ``client_id`` held by ``holder``, written for MQTT
    5.0 if ``v5`` (else 3.1.1)."""

    client_id: str
    holder: Hashable
    packets: list[bytes]
    v5: bool = False


@record
class Attach:
    """The CONNACK of a resumed or new persistent session is out; ``epoch`` holds it now,
    and the session outlives it by ``expiry`` seconds (None: as it was)."""

    client_id: str
    epoch: str
    expiry: int | None = None


@record
class Detach:
    """Connection ``epoch`` of the client ended; an MQTT 5 client's DISCONNECT says the
    session's expiry from now, ``expiry`` seconds (0: the session ends now; None: it
    ended otherwise, and the expiry stays as it was)."""

    client_id: str
    epoch: str
    expiry: int | None = None


@record
class Subscribed:
    """The client subscribed (``qos`` granted, with its MQTT 5 ``options`` packed as
    :func:`~..mqtt.filters.pack_options` packs them) or, with ``qos`` None, unsubscribed."""

    client_id: str
    topic_filter: str
    qos: int | None
    options: int = 0


@record
class Acked:
    """Connection ``epoch`` acknowledged a message (``kind``: puback, pubrec or pubcomp)."""

    client_id: str
    epoch: str
    kind: str
    packet_id: int


_ACK_KINDS = ("puback", "pubrec", "pubcomp")


@record
class AckedTogether:
    """Connection ``epoch`` read these acknowledgements together, in order: ``acks`` is
    three bytes each, the kind's place in puback, pubrec, pubcomp and the packet id
    (big-endian), as :meth:`pack` writes them. One report in place of an
    :class:`Acked` each, so the session's window is refilled once."""

    client_id: str
    epoch: str
    acks: bytes

    def __post_init__(self) -> None:
        # Checked once, where the report is made or read off a worker's link, so that
        # unpacking it (in the sessions' owner) needs no check of its own.
        data = self.acks
        if len(data) % 3 or (data and max(data[::3]) >= len(_ACK_KINDS)):
            raise ValueError(f"acks: not three bytes each, a known kind first: {data!r}")

    @classmethod
    def pack(cls, client_id: str, epoch: str, acks: Iterable[tuple[str, int]]) -> AckedTogether:
        """The report of ``acks`` (kind and packet id, in order)."""
        return cls(client_id, epoch, b"".join(bytes((_ACK_KINDS.index(k), i >> 8, i & 0xFF)) for k, i in acks))

    def unpack(self) -> list[tuple[str, int]]:
        """The acknowledgements, kind and packet id, in order."""
        data = self.acks
        return [(_ACK_KINDS[data[j]], (data[j + 1] << 8) | data[j + 2]) for j in range(0, len(data), 3)]


@record
class Inbound:
    """A QoS 2 packet id from the client was taken (``held``) or released by PUBREL."""

    client_id: str
    packet_id: int
    held: bool


@record
class Push:
    """A message for this client only (a retained message its new subscription matched;
    ``properties``: for a 5.0 session, its own and the subscription's identifier)."""

    client_id: str
    topic: str
    payload: bytes
    qos: int
    retain: bool = True
    properties: bytes = b""


@record
class Discard:
    """A CONNECT with CleanSession=1: any stored session of the client goes."""

    client_id: str


Report = Attach | Detach | Subscribed | Acked | AckedTogether | Inbound | Push | Discard
"""What a worker tells the owner of its persistent sessions, in order."""
