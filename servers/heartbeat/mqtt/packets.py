"""MQTT 3.1.1 packets as values: what :mod:`.reader` returns and :mod:`.encoders` writes.

Each client-to-server packet is an immutable record (:func:`.records.record`); :data:`Packet` is their union.
:class:`ProtocolError` is how the reader and the session report a violation by the
peer. Nothing here parses, encodes or does I/O.
"""

from __future__ import annotations

from typing import TypeAlias

from .records import record

__all__ = [
    "MAX_REMAINING_LENGTH",
    "TYPE_NAMES",
    "PINGREQ_WIRE",
    "Connect",
    "Disconnect",
    "Packet",
    "Pingreq",
    "ProtocolError",
    "Puback",
    "Pubcomp",
    "Publish",
    "Pubrec",
    "Pubrel",
    "Subscribe",
    "Unsubscribe",
]

# Control packet types (2.1.2): the fixed header's high nibble. MQTT 5 keeps them and adds AUTH.
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14

TYPE_NAMES = {
    0: "reserved type 0",
    CONNECT: "CONNECT",
    CONNACK: "CONNACK",
    PUBLISH: "PUBLISH",
    PUBACK: "PUBACK",
    PUBREC: "PUBREC",
    PUBREL: "PUBREL",
    PUBCOMP: "PUBCOMP",
    SUBSCRIBE: "SUBSCRIBE",
    SUBACK: "SUBACK",
    UNSUBSCRIBE: "UNSUBSCRIBE",
    UNSUBACK: "UNSUBACK",
    PINGREQ: "PINGREQ",
    PINGRESP: "PINGRESP",
    DISCONNECT: "DISCONNECT",
    15: "reserved type 15",
}
"""Each packet type's name, as log lines and errors write it (15 is MQTT 5.0's AUTH)."""

MAX_REMAINING_LENGTH = 268_435_455
"""The largest remaining length four varint bytes can carry."""

PINGREQ_WIRE = b"\xc0\x00"
"""A whole PINGREQ on the wire: the reader's fast path compares reads against it."""


class ProtocolError(Exception):
    """A violation by the peer.

    ``reason`` is short, lowercase and hyphenated (``"packet-too-large"``), fit for a
    log line or a metric label. ``connack_code`` is the CONNACK return code to send
    before closing when the spec prescribes one (1: unacceptable protocol level,
    2: identifier rejected), else None. ``detail`` is free text for humans.
    """

    def __init__(self, reason: str, connack_code: int | None = None, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.connack_code = connack_code
        self.detail = detail


# -- packets a client sends ---------------------------------------------------------


@record
class Connect:
    """CONNECT: the first packet of every connection."""

    protocol_name: str
    protocol_level: int
    clean_session: bool
    keep_alive: int
    client_id: str
    will_topic: str | None = None
    will_message: bytes | None = None
    will_qos: int = 0
    will_retain: bool = False
    username: str | None = None
    password: bytes | None = None
    bridge: bool = False
    """The protocol level's top bit was set (``0x84``, ``0x83``): a bridge's CONNECT, as
    Mosquitto's ``try_private`` marks it; ``protocol_level`` is without the bit."""


@record
class Publish:
    """PUBLISH: ``packet_id`` is set for QoS 1 and 2, None for QoS 0."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None


@record
class Puback:
    """PUBACK: acknowledges a QoS 1 PUBLISH."""

    packet_id: int


@record
class Pubrec:
    """PUBREC: first acknowledgement of a QoS 2 PUBLISH."""

    packet_id: int


@record
class Pubrel:
    """PUBREL: second step of the QoS 2 exchange."""

    packet_id: int


@record
class Pubcomp:
    """PUBCOMP: last step of the QoS 2 exchange."""

    packet_id: int


@record
class Subscribe:
    """SUBSCRIBE: ``topics`` are (filter, requested QoS) pairs, at least one."""

    packet_id: int
    topics: tuple[tuple[str, int], ...]


@record
class Unsubscribe:
    """UNSUBSCRIBE: ``topics`` are filters, at least one."""

    packet_id: int
    topics: tuple[str, ...]


@record
class Pingreq:
    """PINGREQ: the keep-alive heartbeat."""


@record
class Disconnect:
    """DISCONNECT: a clean goodbye (the will is discarded)."""


Packet: TypeAlias = (
    Connect | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe | Unsubscribe | Pingreq | Disconnect
)
"""Any packet :class:`PacketReader` returns."""
