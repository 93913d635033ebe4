"""MQTT 5.0 reason codes (§2.4), and the error a v5 packet's reader raises.

One byte on every acknowledgement, CONNACK, DISCONNECT and AUTH: below 0x80 a
success, from 0x80 a failure. Pure: no parsing, no I/O.
"""

from __future__ import annotations

import enum

from ..packets import ProtocolError

__all__ = ["PacketError", "ReasonCode"]


class ReasonCode(enum.IntEnum):
    """Every reason code MQTT 5.0 defines. Some numbers mean two things by packet
    (0x00 is "granted QoS 0" in a SUBACK, "normal disconnection" in a DISCONNECT);
    the enum keeps one name per number, as the spec's table lists them first."""

    SUCCESS = 0x00
    """Also normal disconnection, and granted QoS 0."""
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    REAUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2

    @property
    def failed(self) -> bool:
        """Whether the code reports a failure (0x80 and above)."""
        return self >= 0x80

    @property
    def label(self) -> str:
        """The name as a log line or a metric label writes it: ``keep-alive-timeout``."""
        return self.name.lower().replace("_", "-")


class PacketError(ProtocolError):
    """A v5 packet the reader refuses: the reason code to send (in CONNACK before the
    session exists, in DISCONNECT after), with the 3.1.1 error's ``reason`` and
    ``detail`` so that the servers log both versions alike."""

    def __init__(self, code: ReasonCode, detail: str = "") -> None:
        super().__init__(code.label, connack_code=int(code), detail=detail)
        self.code = code
        """What to tell the peer."""


def malformed(detail: str) -> PacketError:
    """A packet that cannot be parsed as the spec lays it out (0x81)."""
    return PacketError(ReasonCode.MALFORMED_PACKET, detail)


def protocol_error(detail: str) -> PacketError:
    """A packet that parses but breaks a rule of the protocol (0x82)."""
    return PacketError(ReasonCode.PROTOCOL_ERROR, detail)
