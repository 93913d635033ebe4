"""What a :class:`~.session.ClientSession` reports from the remote broker: one record per
thing that happened, in the order it happened. Pure values, no behaviour."""

from __future__ import annotations

import dataclasses
from typing import TypeAlias

from ..records import record
from ..v5.properties import EMPTY, Properties

__all__ = [
    "Acknowledged",
    "Connected",
    "Disconnected",
    "Dropped",
    "Event",
    "Message",
    "Pong",
    "ProtocolViolation",
    "Refused",
    "Subscribed",
    "Unsubscribed",
]


@record
class Connected:
    """The remote accepted the CONNECT. ``properties`` are its CONNACK's (5.0), its limits
    among them; 3.1.1 has none."""

    session_present: bool
    code: int = 0
    properties: Properties = EMPTY


@record
class Refused:
    """The remote refused the CONNECT: its CONNACK ``code`` (3.1.1's 1 to 5, or 5.0's
    reason code) and a label for logs (``not-authorized``)."""

    code: int
    reason: str


@record
class Message:
    """A PUBLISH from the remote, delivered once (a QoS 2 duplicate is not). ``properties``
    are without the Topic Alias, which was the wire's business. ``packet_id`` is the
    PUBLISH's (0 at QoS 0); it is not part of the message's value (two deliveries of
    one message compare equal)."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: Properties = EMPTY
    packet_id: int = dataclasses.field(default=0, compare=False)


@record
class Subscribed:
    """A SUBACK: a granted QoS (or a failure code, 0x80 and up) per filter, in order."""

    packet_id: int
    codes: tuple[int, ...]


@record
class Unsubscribed:
    """An UNSUBACK: in 5.0, a reason code per filter; in 3.1.1, none."""

    packet_id: int
    codes: tuple[int, ...] = ()


@record
class Acknowledged:
    """An outbound QoS 1 or 2 message is done: PUBACK, PUBCOMP, or a 5.0 PUBREC that
    failed it (``code`` 0x80 and up). Reported once per :meth:`publish`, whatever the
    reconnects between."""

    token: int
    code: int = 0


@record
class Dropped:
    """An outbound message that was never sent and never will be: larger than the
    remote's Maximum Packet Size (5.0 says to discard it, MQTT-3.1.2-24)."""

    token: int
    reason: str


@record
class Pong:
    """A PINGRESP."""


@record
class Disconnected:
    """A DISCONNECT from a 5.0 remote, with why; the connection is over."""

    reason_code: int
    properties: Properties = EMPTY


@record
class ProtocolViolation:
    """Something the remote got wrong; the connection is over (in 5.0 a DISCONNECT with
    ``reason_code`` is queued to tell it why). ``reason`` is a short label."""

    reason: str
    detail: str = ""
    reason_code: int | None = None


Event: TypeAlias = (
    Connected
    | Refused
    | Message
    | Subscribed
    | Unsubscribed
    | Acknowledged
    | Dropped
    | Pong
    | Disconnected
    | ProtocolViolation
)
"""Anything :meth:`~.session.ClientSession.receive_data` returns."""
