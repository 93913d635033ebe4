"""What a client says in its CONNECT, and the CONNECT itself on the wire, either version.

:class:`ClientOptions` is fixed for a bridge's life; :func:`encode_connect` writes the
CONNECT for one network connection (the version picks the encoder: :mod:`..encoders`
for 3.1.1, :mod:`..v5.codec` for 5.0). Pure.
"""

from __future__ import annotations

from .. import encoders
from ..packets import MAX_REMAINING_LENGTH
from ..records import record
from ..v5 import codec as v5_codec
from ..v5 import packets as v5
from ..v5.properties import EMPTY, Properties

__all__ = ["MQTT_311", "MQTT_50", "ClientOptions", "encode_connect"]

MQTT_311 = 4
"""Protocol level of MQTT 3.1.1 (Mosquitto's ``bridge_protocol_version mqttv311``)."""
MQTT_50 = 5
"""Protocol level of MQTT 5.0 (``mqttv50``)."""

_PRIVATE = 0x80
"""What Mosquitto's ``try_private`` adds to the protocol level: a broker that knows it
learns that the client is a bridge (and, Mosquitto, treats its loops accordingly)."""


@record
class ClientOptions:
    """A client's CONNECT and its own limits.

    ``clean`` is 3.1.1's Clean Session and 5.0's Clean Start; in 5.0 the session
    outlives the connection by ``session_expiry`` seconds (None: 0, it ends with it).
    ``receive_maximum``, ``maximum_packet_size`` and ``topic_alias_maximum`` are what
    we accept from the remote (5.0 tells it; in 3.1.1 the packet size still bounds
    the reader). ``window`` caps outbound QoS 1/2 messages in flight (in 5.0 the
    remote's Receive Maximum may lower it). ``try_private`` marks the protocol level
    with 0x80, as a Mosquitto bridge does. With ``manual_ack`` an inbound QoS 1/2
    message is answered (PUBACK, PUBREC) only when the caller says so
    (:meth:`~.session.ClientSession.acknowledge`): a bridge acknowledges a message once
    the broker it passed it on to has acknowledged its copy. ``properties`` adds any
    other CONNECT property (User Properties, an Authentication Method).
    """

    client_id: str
    version: int = MQTT_311
    clean: bool = True
    keep_alive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: v5.Will | None = None
    session_expiry: int | None = None
    receive_maximum: int | None = None
    maximum_packet_size: int | None = None
    topic_alias_maximum: int = 0
    window: int = 20
    try_private: bool = False
    manual_ack: bool = False
    properties: Properties = EMPTY

    def __post_init__(self) -> None:
        if self.version not in (MQTT_311, MQTT_50):
            raise ValueError(f"protocol level {self.version}: 4 (3.1.1) or 5 (5.0)")
        if not 1 <= self.window <= 0xFFFF:
            raise ValueError(f"window {self.window}: 1 to 65535")
        if self.password is not None and self.username is None and self.version == MQTT_311:
            raise ValueError("3.1.1 sends no password without a username (MQTT-3.1.2-22)")

    @property
    def v5(self) -> bool:
        """Whether these options speak MQTT 5.0."""
        return self.version == MQTT_50

    @property
    def largest_inbound(self) -> int:
        """The largest packet we take from the remote."""
        return self.maximum_packet_size or MAX_REMAINING_LENGTH + 5


def _connect_properties(options: ClientOptions) -> Properties:
    changes: dict[str, int] = {}
    if options.session_expiry:
        changes["session_expiry_interval"] = options.session_expiry
    if options.receive_maximum is not None:
        changes["receive_maximum"] = options.receive_maximum
    if options.maximum_packet_size is not None:
        changes["maximum_packet_size"] = options.maximum_packet_size
    if options.topic_alias_maximum:
        changes["topic_alias_maximum"] = options.topic_alias_maximum
    return options.properties.replace(**changes) if changes else options.properties


def encode_connect(options: ClientOptions) -> bytes:
    """The CONNECT of ``options`` on the wire."""
    if options.v5:
        packet = v5.Connect(
            options.client_id,
            options.keep_alive,
            options.clean,
            _connect_properties(options),
            options.will,
            options.username,
            options.password,
        )
        wire = v5_codec.pack(packet)
    else:
        will = options.will
        wire = encoders.encode_connect(
            options.client_id,
            options.keep_alive,
            options.clean,
            will_topic=None if will is None else will.topic,
            will_message=None if will is None else will.payload,
            will_qos=0 if will is None else will.qos,
            will_retain=False if will is None else will.retain,
            username=options.username,
            password=options.password,
        )
    if not options.try_private:
        return wire
    # The level byte follows the fixed header and the protocol name ("\0\4MQTT"), in
    # both versions; marking it after encoding spares both encoders a flag only a
    # bridge uses.
    at = 1
    while wire[at] & 0x80:  # the remaining length's continuation bytes
        at += 1
    at += 1 + 6
    return wire[:at] + bytes((wire[at] | _PRIVATE,)) + wire[at + 1 :]
