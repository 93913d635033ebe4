"""What a session asks of the server, sans-IO: each record is one effect that
:meth:`.session.Session.receive` returns (send these bytes, admit this CONNECT,
route this message, add this subscription, ...), for the server to carry out."""

from __future__ import annotations

from .publication import Publication
from .records import record

__all__ = [
    "Accept",
    "Acknowledged",
    "AddSubscription",
    "Denied",
    "Effect",
    "Goodbye",
    "HoldInbound",
    "ReleaseInbound",
    "RemoveSubscription",
    "Send",
    "SubscriptionRefused",
    "TooLarge",
    "Will",
]


@record
class Will:
    """The message a client asked to have published if it dies."""

    topic: str
    message: bytes
    qos: int
    retain: bool
    properties: bytes = b""
    """An MQTT 5 Will's message properties, packed (:func:`.v5.outbound.forwarded`)."""
    delay: int = 0
    """Seconds an MQTT 5 Will waits once the connection has closed: its Will Delay
    Interval, or less if the session ends sooner."""
    asked_delay: int = 0
    """The Will Delay Interval the CONNECT asked for (a DISCONNECT may move the
    session's end, and with it ``delay``, either way)."""


@record
class Send:
    """Write these bytes to the client."""

    data: bytes


@record
class Accept:
    """A well-formed CONNECT: the server checks credentials and capacity, then calls
    :meth:`Session.accepted` or :meth:`Session.refused`."""

    client_id: str
    assigned: bool
    keep_alive: int
    clean_session: bool
    username: str | None
    password: bytes | None
    will: Will | None
    fresh: bool = False
    """MQTT 5's Clean Start with a session that outlives the connection: any stored
    session is discarded first, then a new one is kept (``clean_session`` is False)."""
    expiry: int | None = None
    """MQTT 5's Session Expiry Interval, as the server grants it (0: the session ends
    with the connection, so Clean Start 0 resumes a stored one and makes none); None
    for 3.1.x, whose persistent sessions are kept ``--session-expiry``."""


@record
class AddSubscription:
    """Add a subscription (already granted in the SUBACK that follows)."""

    topic_filter: str
    qos: int
    suback: bool = True
    """False for a resumed session's subscription: no SUBACK follows, nothing to hold."""
    retained: bool = True
    """Whether the filter's retained messages are sent (MQTT 5's Retain Handling may say not)."""
    options: int = 0
    """MQTT 5's No Local, Retain As Published and Subscription Identifier, packed
    (:func:`.filters.pack_options`); 0 for none (every 3.1.1 subscription)."""


@record
class RemoveSubscription:
    """Remove a subscription."""

    topic_filter: str


@record
class Goodbye:
    """The client sent DISCONNECT: close cleanly and discard its Will."""


@record
class Denied:
    """A PUBLISH the client may not make (the presence prefix, or the access rules):
    acknowledged as usual, since 3.1.1 has no refusal, then dropped."""

    topic: str


@record
class TooLarge:
    """A PUBLISH whose payload is longer than ``--message-size-limit``: answered as
    usual (with 0x95 in 5.0, as Mosquitto), neither routed nor retained."""

    topic: str
    size: int
    """The payload's bytes."""


@record
class SubscriptionRefused:
    """A filter refused (0x80 in its SUBACK) because the client holds as many filters,
    or as many bytes of them, as the server allows (:class:`~.policy.SessionPolicy`)."""

    topic_filter: str


@record
class Acknowledged:
    """The client acknowledged a message the server sent: ``kind`` is ``puback``,
    ``pubrec`` or ``pubcomp`` (the server's outbox for the client takes it)."""

    kind: str
    packet_id: int


@record
class HoldInbound:
    """A QoS 2 PUBLISH was taken: its packet id is held until PUBREL (a persistent
    session stores it, so a duplicate after a reconnect elsewhere is recognised)."""

    packet_id: int


@record
class ReleaseInbound:
    """PUBREL came for a held QoS 2 packet id."""

    packet_id: int


Effect = (
    Send
    | Accept
    | Publication
    | AddSubscription
    | RemoveSubscription
    | Goodbye
    | Acknowledged
    | HoldInbound
    | ReleaseInbound
    | Denied
    | TooLarge
    | SubscriptionRefused
)
