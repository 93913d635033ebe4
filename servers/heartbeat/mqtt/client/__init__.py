"""MQTT's client side, sans-IO, for a bridge to another broker (issue 64): 3.1.1 or 5.0.

:class:`ClientSession` (:mod:`.session`) is one client's session with a remote broker;
:class:`ClientOptions` (:mod:`.options`) says what its CONNECT asks for;
:mod:`.events` are what it reports; :mod:`.reader` parses what a server sends and
:mod:`.outbox` keeps the outbound messages until they are done. Bytes in, events
out; nothing here does I/O, reads a clock or imports trio, as in the rest of
:mod:`..`, whose codec it reuses.
"""

from .events import (
    Acknowledged,
    Connected,
    Disconnected,
    Dropped,
    Event,
    Message,
    Pong,
    ProtocolViolation,
    Refused,
    Subscribed,
    Unsubscribed,
)
from .options import MQTT_50, MQTT_311, ClientOptions
from .session import CLOSED, CONNECTED, CONNECTING, IDLE, ClientSession

__all__ = [
    "CLOSED",
    "CONNECTED",
    "CONNECTING",
    "IDLE",
    "MQTT_311",
    "MQTT_50",
    "Acknowledged",
    "ClientOptions",
    "ClientSession",
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
