"""MQTT 5.0 packets as values, both directions: what :mod:`.codec` reads and writes.

Beside the 3.1.1 packets (:mod:`servers.heartbeat.mqtt.packets`), not inside them: a 5.0
packet carries :class:`~.properties.Properties` and reason codes that 3.1.1 has no
room for. Nothing here parses, encodes or does I/O.
"""

from __future__ import annotations

from typing import TypeAlias

from ..packets import (
    CONNACK,
    CONNECT,
    DISCONNECT,
    PINGREQ,
    PINGRESP,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBACK,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
)
from ..records import record
from .properties import EMPTY, Properties

__all__ = [
    "AUTH",
    "CONNACK",
    "CONNECT",
    "DISCONNECT",
    "PINGREQ",
    "PINGRESP",
    "PUBACK",
    "PUBCOMP",
    "PUBLISH",
    "PUBREC",
    "PUBREL",
    "SUBACK",
    "SUBSCRIBE",
    "UNSUBACK",
    "UNSUBSCRIBE",
    "Ack",
    "Auth",
    "Connack",
    "Connect",
    "Disconnect",
    "Packet",
    "Pingreq",
    "Pingresp",
    "Publish",
    "Suback",
    "Subscribe",
    "Subscription",
    "Unsuback",
    "Unsubscribe",
    "Will",
]

AUTH = 15
"""MQTT 5's one packet type more than 3.1.1 (the others' numbers are :mod:`..packets`')."""


@record
class Will:
    """A CONNECT's Will: a PUBLISH that waits, with its own properties (Will Delay)."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = EMPTY


@record
class Connect:
    """CONNECT at protocol level 5."""

    client_id: str
    keep_alive: int
    clean_start: bool = True
    properties: Properties = EMPTY
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None


@record
class Connack:
    """CONNACK: the session's fate and the server's limits (in ``properties``)."""

    session_present: bool
    reason_code: int
    properties: Properties = EMPTY


@record
class Publish:
    """PUBLISH. ``topic`` may be empty when a Topic Alias stands for it."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = EMPTY


@record
class Ack:
    """PUBACK, PUBREC, PUBREL or PUBCOMP (``kind`` is the packet type, 4 to 7)."""

    kind: int
    packet_id: int
    reason_code: int = 0
    properties: Properties = EMPTY


@record
class Subscription:
    """One filter of a SUBSCRIBE and its options (§3.8.3.1)."""

    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@record
class Subscribe:
    """SUBSCRIBE: one or more filters."""

    packet_id: int
    subscriptions: tuple[Subscription, ...]
    properties: Properties = EMPTY


@record
class Suback:
    """SUBACK: a reason code per filter, in order."""

    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = EMPTY


@record
class Unsubscribe:
    """UNSUBSCRIBE: one or more filters."""

    packet_id: int
    topic_filters: tuple[str, ...]
    properties: Properties = EMPTY


@record
class Unsuback:
    """UNSUBACK: a reason code per filter, in order."""

    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = EMPTY


@record
class Pingreq:
    """PINGREQ."""


@record
class Pingresp:
    """PINGRESP."""


@record
class Disconnect:
    """DISCONNECT, from either side, with why."""

    reason_code: int = 0
    properties: Properties = EMPTY


@record
class Auth:
    """AUTH: a step of enhanced authentication."""

    reason_code: int = 0
    properties: Properties = EMPTY


Packet: TypeAlias = (
    Connect
    | Connack
    | Publish
    | Ack
    | Subscribe
    | Suback
    | Unsubscribe
    | Unsuback
    | Pingreq
    | Pingresp
    | Disconnect
    | Auth
)
