"""One MQTT connection's protocol state, sans-IO: packets in, effects out.

The server's connection loop feeds each parsed packet to :meth:`Session.receive`
and carries out the effects it returns (send bytes, route a message, subscribe,
close). Nothing here touches a socket, a clock or the broker, so every rule of the
handshake and of MQTT 3.1.1's packet order is testable on its own.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os
from collections.abc import Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from . import encoders, packets
from .effects import (
    Accept,
    Acknowledged,
    AddSubscription,
    Denied,
    Effect,
    Goodbye,
    HoldInbound,
    ReleaseInbound,
    RemoveSubscription,
    Send,
    SubscriptionRefused,
    TooLarge,
    Will,
)
from .filters import SHARE_PREFIX, pack_options, shared_filter
from .packets import ProtocolError
from .policy import DEFAULT_MAX_QOS, DEFAULT_PRESENCE_PREFIX, SessionPolicy, utf8_length
from .publication import Publication

if TYPE_CHECKING:
    from .endings import Offline
    from .reader import AnyPacket

__all__ = [
    "DEFAULT_MAX_QOS",
    "DEFAULT_PRESENCE_PREFIX",
    "Permissions",
    "Publication",
    "Session",
    "State",
]


class Verdict(enum.Enum):
    """What became of one filter of a SUBSCRIBE."""

    GRANTED = "granted"
    DENIED = "denied"
    """The access rules refuse it."""
    QUOTA = "quota"
    """The client holds as many filters (or bytes of them) as the server allows."""
    INVALID = "invalid"
    """A shared subscription's filter without its group or its filter (``$share/g``)."""


class State(enum.Enum):
    """Where a connection is in its life."""

    AWAITING_CONNECT = "awaiting-connect"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    CLOSED = "closed"


class Permissions(Protocol):
    """What one client may do (the server binds its access rules to the client's user and id)."""

    def may_subscribe(self, topic_filter: str) -> bool:
        """Whether the client may subscribe to ``topic_filter``."""
        ...

    def may_publish(self, topic: str) -> bool:
        """Whether the client may publish on ``topic``."""
        ...

    def may_read(self, topic: str) -> bool:
        """Whether a message on ``topic`` may be delivered to the client."""
        ...


MAX_INBOUND_QOS2 = 1000
"""QoS 2 messages a client may have taken (PUBREC sent) without releasing (PUBREL)."""
SUBACK_FAILURE = 0x80
"""The SUBACK return code of a refused subscription (MQTT-3.9.3)."""
_ids = itertools.count(1)
_ID_PREFIX = f"auto-{os.getpid():x}-"


_DEFAULT = SessionPolicy()
# A bridge's subscriptions (Mosquitto's, for a CONNECT marked try_private): none of its
# own messages back, and the retain flag as published, so no two brokers loop.
_BRIDGED = pack_options(no_local=True, retain_as_published=True)


def assign_client_id() -> str:
    """A client id for a CONNECT that sent an empty one (unique in this process)."""
    return f"{_ID_PREFIX}{next(_ids):x}"


class Session:
    """MQTT 3.1.1 (and 3.1) packet-order rules and replies for one connection.

    ``policy`` is the server's (:class:`~.policy.SessionPolicy`, one for every session):
    its ``max_qos`` caps the QoS granted in SUBACK and the QoS a PUBLISH is routed at;
    the topics it reserves (presence, ``$``) are the server's own: a device's PUBLISH
    there is acknowledged as usual but dropped and counted in ``denied_publishes``; a
    client id past its length or holding ``+`` or ``#`` gets CONNACK 2, a username past
    its length CONNACK 4; a filter past the client's share gets 0x80 in SUBACK.
    ``max_qos`` and ``presence_prefix`` alone make a policy of their own (for tests).
    ``permissions``, set by the server once the client is known, refuses a
    subscription (0x80 in SUBACK) or drops a publish (3.1.1 has no refusal for one:
    it is acknowledged, dropped and counted).

    Without ``retain_available`` a retained PUBLISH, or a CONNECT whose Will is retained,
    closes the connection unanswered (3.1.1 has no code for it; Mosquitto does the
    same); a payload past ``message_size_limit`` is acknowledged and dropped
    (:class:`~.effects.TooLarge`), a Will's refuses the CONNECT with CONNACK 5.

    QoS 2 from the client is exactly once (4.3.3, method B): a PUBLISH whose packet id
    is held (PUBREC sent, no PUBREL yet) is acknowledged again but not routed again.
    """

    # One per connection, a million of them on a dense server: slots, not a dict.
    __slots__ = (
        "state",
        "protocol_level",
        "client_id",
        "assigned",
        "keep_alive",
        "will",
        "denied_publishes",
        "permissions",
        "inbound",
        "_policy",
    )

    def __init__(
        self,
        policy: SessionPolicy | None = None,
        *,
        max_qos: int = DEFAULT_MAX_QOS,
        presence_prefix: str = DEFAULT_PRESENCE_PREFIX,
    ) -> None:
        self.state = State.AWAITING_CONNECT
        self.protocol_level = 4
        """3 for MQTT 3.1 (``MQIsdp``), 4 for 3.1.1, once the CONNECT has said."""
        self.client_id: str | None = None
        self.assigned = False
        self.keep_alive = 0
        self.will: Will | None = None
        self.denied_publishes = 0
        self.permissions: Permissions | None = None
        self.inbound: set[int] | None = None
        """QoS 2 packet ids held until PUBREL (made on the first one: most devices never use QoS 2)."""
        if policy is None:
            policy = (
                _DEFAULT
                if (max_qos, presence_prefix) == (DEFAULT_MAX_QOS, DEFAULT_PRESENCE_PREFIX)
                else SessionPolicy(max_qos=max_qos, presence_prefix=presence_prefix)
            )
        self._policy = policy

    def receive(self, packet: AnyPacket) -> list[Effect]:
        """Effects of one packet from the client. Raises ProtocolError on a violation."""
        if self.state is State.AWAITING_CONNECT:
            if not isinstance(packet, packets.Connect):
                raise ProtocolError("expected-connect", detail=f"{type(packet).__name__} before CONNECT")
            return [self._connect(packet)]
        if self.state is not State.CONNECTED:
            raise ProtocolError("not-connected", detail=f"{type(packet).__name__} in state {self.state.value}")
        if isinstance(packet, packets.Pingreq):
            return [Send(encoders.encode_pingresp())]
        if isinstance(packet, packets.Publish):
            return self._publish(packet)
        if isinstance(packet, packets.Puback):  # next most common: a subscriber's, per message
            return [Acknowledged("puback", packet.packet_id)]
        if isinstance(packet, packets.Subscribe):
            return self._subscribe(packet)
        if isinstance(packet, packets.Unsubscribe):
            out: list[Effect] = [RemoveSubscription(topic_filter) for topic_filter in packet.topics]
            out.append(Send(encoders.encode_unsuback(packet.packet_id)))
            return out
        if isinstance(packet, packets.Disconnect):
            self.state = State.CLOSED
            self.will = None
            return [Goodbye()]
        if isinstance(packet, packets.Pubrel):
            return self._release(packet.packet_id)
        if isinstance(packet, packets.Pubrec):
            return [Acknowledged("pubrec", packet.packet_id)]
        if isinstance(packet, packets.Pubcomp):
            return [Acknowledged("pubcomp", packet.packet_id)]
        if isinstance(packet, packets.Connect):
            raise ProtocolError("second-connect", detail="CONNECT on a connected session")
        return []

    def _release(self, packet_id: int) -> list[Effect]:
        """PUBREL: the held QoS 2 id is let go, and PUBCOMP sent (same bytes in 3.1.1 and 5.0)."""
        released: list[Effect] = []
        inbound = self.inbound
        if inbound is not None and packet_id in inbound:
            inbound.discard(packet_id)
            released.append(ReleaseInbound(packet_id))
        # PUBCOMP even for an id not held: the client may resend PUBREL after a lost PUBCOMP.
        released.append(Send(encoders.encode_pubcomp(packet_id)))
        return released

    def accepted(self, session_present: bool = False, inbound: frozenset[int] = frozenset()) -> bytes:
        """The server took the CONNECT: the CONNACK to send.

        A resumed persistent session says so (``session_present``) and brings back the
        QoS 2 packet ids it held (``inbound``).
        """
        self.state = State.CONNECTED
        if inbound:
            self.inbound = set(inbound)
        # MQTT 3.1's CONNACK has no session-present flag: its first byte is reserved, 0.
        return encoders.encode_connack(session_present and self.protocol_level >= 4, 0)

    def violated(self, exc: ProtocolError) -> bytes | None:
        """The client broke the protocol: the CONNACK refusal to send before closing, if
        the spec has one (only while the CONNECT is being answered), else None."""
        if exc.connack_code is not None and self.state in (State.AWAITING_CONNECT, State.CONNECTING):
            return self.refused(exc.connack_code)
        return None

    def goodbye(self, reason: Offline) -> bytes | None:
        """What to send the client when the server ends its connection for ``reason``:
        nothing in 3.1.1, which has no DISCONNECT from the server (5.0 has)."""
        return None

    @property
    def reason_code(self) -> int | None:
        """The MQTT 5 reason code that ended the session (sent or received); None in 3.1.1."""
        return None

    def reserved(self, topic: str) -> bool:
        """Whether ``topic`` is the server's alone (presence, ``$`` topics): no client writes there."""
        return self._policy.reserved(topic)

    def superseded(self) -> None:
        """The server drops the CONNECT unanswered (a newer connection of the client id
        holds the session): nothing more is read or answered."""
        self.state = State.CLOSED
        self.will = None

    def refused(self, return_code: int) -> bytes:
        """The server refused the CONNECT: the CONNACK to send before closing."""
        self.state = State.CLOSED
        self.will = None
        return encoders.encode_connack(False, return_code)

    def _connect(self, packet: packets.Connect) -> Accept:
        self.state = State.CONNECTING
        self.protocol_level = packet.protocol_level
        client_id = packet.client_id
        if packet.bridge:
            # A policy of its own rather than a slot on every device's session.
            self._policy = dataclasses.replace(self._policy, bridge=True)
        policy = self._policy
        if packet.will_retain and packet.will_topic is not None and not policy.retain_available:
            # As Mosquitto: read from the flags, before anything else; no CONNACK code says it.
            raise ProtocolError("retain-not-supported", detail="a retained Will (--retain-available false)")
        if not client_id and packet.protocol_level == 3:
            # MQTT 3.1 requires an id (1 to 23 characters; longer ones are taken, as by Mosquitto).
            raise ProtocolError(
                "identifier-rejected", connack_code=2, detail="an empty client id from an MQTT 3.1 client"
            )
        if "+" in client_id or "#" in client_id:
            # It names the device's presence topic, where MQTT forbids wildcards (MQTT-3.3.2-2).
            raise ProtocolError("identifier-rejected", connack_code=2, detail="a wildcard (+ or #) in the client id")
        if utf8_length(client_id) > policy.max_client_id:
            raise ProtocolError(
                "identifier-rejected",
                connack_code=2,
                detail=f"a client id of {utf8_length(client_id)} bytes (at most {policy.max_client_id})",
            )
        limit = policy.message_size_limit
        if limit and packet.will_topic is not None and len(packet.will_message or b"") > limit:
            # Mosquitto 2.0 answers 5 (not authorized): 3.1.1 has no code for a size.
            raise ProtocolError(
                "will-too-large", connack_code=5, detail=f"a Will payload over --message-size-limit {limit}"
            )
        username = packet.username
        if username is not None and utf8_length(username) > policy.max_username:
            raise ProtocolError(
                "bad-username",
                connack_code=4,
                detail=f"a username of {utf8_length(username)} bytes (at most {policy.max_username})",
            )
        assigned = False
        if not client_id:
            if not packet.clean_session:
                # MQTT-3.1.3-8: an empty id needs a clean session.
                raise ProtocolError(
                    "identifier-rejected", connack_code=2, detail="empty client id without clean session"
                )
            client_id = assign_client_id()
            assigned = True
        self.client_id = client_id
        self.assigned = assigned
        self.keep_alive = packet.keep_alive
        if packet.will_topic is not None:
            self.will = Will(packet.will_topic, packet.will_message or b"", packet.will_qos, packet.will_retain)
        return Accept(
            client_id=client_id,
            assigned=assigned,
            keep_alive=packet.keep_alive,
            clean_session=packet.clean_session,
            username=packet.username,
            password=packet.password,
            will=self.will,
        )

    def _subscribe(self, packet: packets.Subscribe) -> list[Effect]:
        effects: list[Effect] = []
        granted: list[int] = []
        for topic_filter, level, verdict in self._verdicts(packet.topics):
            if verdict is Verdict.GRANTED:
                granted.append(level)
                effects.append(AddSubscription(topic_filter, level, options=_BRIDGED if self._policy.bridge else 0))
            else:
                granted.append(SUBACK_FAILURE)
                if verdict is Verdict.QUOTA:
                    effects.append(SubscriptionRefused(topic_filter))
        effects.append(Send(encoders.encode_suback(packet.packet_id, granted)))
        return effects

    def _verdicts(self, requests: Iterable[tuple[str, int]]) -> Iterator[tuple[str, int, Verdict]]:
        """Each requested (filter, QoS) judged: the access rules, then the client's share
        of filters; a granted one at min(QoS, the server's maximum)."""
        permissions = self.permissions
        policy = self._policy
        # What the client holds already (the broker's set), and what this packet adds:
        # a filter held again only replaces its QoS, so it counts once.
        held: Collection[str] = ()
        size = 0
        if policy.held is not None and self.client_id is not None:
            held, size = policy.held(self.client_id)
        count = len(held)
        added: set[str] = set()
        for topic_filter, qos in requests:
            checked = topic_filter
            if topic_filter.startswith(SHARE_PREFIX):
                parts = shared_filter(topic_filter)
                if parts is None:
                    yield topic_filter, 0, Verdict.INVALID
                    continue
                checked = parts[1]  # the access rules judge what it reads, whatever the group
            if permissions is not None and not permissions.may_subscribe(checked):
                yield topic_filter, 0, Verdict.DENIED
                continue
            if policy.held is not None and topic_filter not in held and topic_filter not in added:
                length = utf8_length(topic_filter)
                if count >= policy.max_subscriptions or size + length > policy.max_subscription_bytes:
                    yield topic_filter, 0, Verdict.QUOTA
                    continue
                count, size = count + 1, size + length
                added.add(topic_filter)
            yield topic_filter, min(qos, policy.max_qos), Verdict.GRANTED

    def _publish(self, packet: packets.Publish) -> list[Effect]:
        effects: list[Effect] = []
        packet_id = packet.packet_id
        policy = self._policy
        if packet.retain and not policy.retain_available:
            raise ProtocolError("retain-not-supported", detail="a retained PUBLISH (--retain-available false)")
        limit = policy.message_size_limit
        if limit and len(packet.payload) > limit:
            # Answered, never held (a PUBREL for it gets its PUBCOMP all the same), nor routed.
            effects.append(TooLarge(packet.topic, len(packet.payload)))
            if packet.qos == 1 and packet_id is not None:
                effects.append(Send(encoders.encode_puback(packet_id)))
            elif packet.qos == 2 and packet_id is not None:
                effects.append(Send(encoders.encode_pubrec(packet_id)))
            return effects
        if packet.qos == 2 and packet_id is not None:
            inbound = self.inbound
            if inbound is None:
                inbound = self.inbound = set()
            elif packet_id in inbound:
                return [Send(encoders.encode_pubrec(packet_id))]  # a duplicate: taken already
            elif len(inbound) >= MAX_INBOUND_QOS2:
                # Each held id is memory the client makes us keep; no honest client needs this many.
                raise ProtocolError("qos2-window", detail=f"more than {MAX_INBOUND_QOS2} QoS 2 messages without PUBREL")
            inbound.add(packet_id)
            effects.append(HoldInbound(packet_id))
        topic = packet.topic
        if policy.reserved(topic) or (self.permissions is not None and not self.permissions.may_publish(topic)):
            # Presence (and every $ topic) is the server's to publish; a device may not forge it.
            self.denied_publishes += 1
            effects.append(Denied(topic))
        else:
            effects.append(Publication(topic, packet.payload, min(packet.qos, policy.max_qos), packet.retain))
        if packet.qos == 1 and packet_id is not None:
            effects.append(Send(encoders.encode_puback(packet_id)))
        elif packet.qos == 2 and packet_id is not None:
            effects.append(Send(encoders.encode_pubrec(packet_id)))
        return effects
