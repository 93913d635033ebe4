"""One MQTT 5.0 connection's protocol state, sans-IO: the 3.1.1 session's rules, with
what 5.0 adds.

:class:`Session5` takes the place of :class:`~servers.heartbeat.mqtt.session.Session` once
a client's CONNECT says protocol level 5 (the connection swaps it in), and answers
with the same effects, so that everything behind a session (admission, fan-out,
presence, the coordinator) serves both versions alike. What differs is said here:

- **CONNACK** tells the client the server's limits (Receive Maximum, Maximum Packet
  Size, Topic Alias Maximum, Maximum QoS, no Subscription Identifiers or shared
  subscriptions yet), an Assigned Client Identifier for an empty id, a Server Keep
  Alive when the client asked for more than ``--max-keepalive`` or for none, and the
  server's Session Expiry Interval when it cut the client's to ``--session-expiry``
  (§3.2.2.3.2 lets a server impose another by saying so).
- **Sessions** (§3.1.2.4, §3.1.2.11.2): Clean Start says whether a stored session is
  resumed; the Session Expiry Interval (absent: 0) says only how long the session
  outlives *this* connection, so Clean Start 0 with none resumes a stored session that
  then ends with the connection. A DISCONNECT may change the expiry, except from 0 to
  more (0x82). A Will waits its Will Delay or the session's end, whichever is first.
- **Refusals** carry 5.0 reason codes: a CONNACK before the session exists, a
  DISCONNECT after (``0x81`` malformed, ``0x82`` protocol error, ``0x93`` receive
  maximum exceeded, ``0x94`` topic alias invalid, ``0x95`` packet too large, ...).
- **PUBLISH**: topic aliases from the client, the properties that reach subscribers
  (:func:`.outbound.forwarded`), a refused publish answered ``0x87`` (not authorized)
  in its PUBACK or PUBREC rather than silently, as 3.1.1 must; a payload past
  ``--message-size-limit`` likewise with ``0x97`` (Mosquitto's ``0x95`` is no PUBACK
  code: paho drops the connection and resends); RETAIN 1 without
  ``--retain-available`` is DISCONNECT ``0x9A`` (CONNACK ``0x9A`` for a retained Will,
  Retain Available 0 in every CONNACK), as Mosquitto 2.0 answers.
- **SUBSCRIBE**: a reason code per filter (``0x87`` the access rules refuse it,
  ``0x97`` the client's share of filters is used up, ``0x9E`` a shared subscription),
  and Retain Handling.
- **DISCONNECT** in both directions with a reason code; ``0x04`` from the client
  publishes its Will, as the spec says; the code is kept for the presence event.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from ..bodies import forbidden_character
from ..effects import (
    Accept,
    Acknowledged,
    AddSubscription,
    Denied,
    Effect,
    Goodbye,
    HoldInbound,
    RemoveSubscription,
    Send,
    SubscriptionRefused,
    TooLarge,
    Will,
)
from ..endings import Offline
from ..filters import SHARE_PREFIX, check_filter, pack_options
from ..packets import Pingreq, ProtocolError
from ..policy import SessionPolicy, utf8_length
from ..publication import Publication
from ..session import Session, State, Verdict, assign_client_id
from . import outbound
from .aliases import OutboundAliases
from .codec import fit_reason, pack
from .packets import (
    CONNACK,
    DISCONNECT,
    PUBACK,
    PUBCOMP,
    PUBREC,
    Ack,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Publish,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from .properties import Properties
from .reason_codes import PacketError, ReasonCode, protocol_error

__all__ = ["Session5", "code_for"]

R = ReasonCode
_PINGRESP = Send(b"\xd0\x00")
_REFUSALS = {1: R.UNSUPPORTED_PROTOCOL_VERSION, 2: R.CLIENT_IDENTIFIER_NOT_VALID, 3: R.SERVER_UNAVAILABLE}
_REFUSALS.update({4: R.BAD_USER_NAME_OR_PASSWORD, 5: R.NOT_AUTHORIZED})
"""3.1.1's CONNACK codes (what the server's admission speaks) as 5.0's."""
_GOODBYES = {
    Offline.KEEPALIVE_TIMEOUT: R.KEEP_ALIVE_TIMEOUT,
    Offline.TAKEOVER: R.SESSION_TAKEN_OVER,
    Offline.SHUTDOWN: R.SERVER_SHUTTING_DOWN,
    Offline.SEND_OVERFLOW: R.QUOTA_EXCEEDED,
}
"""Why the server ends a connection, as the DISCONNECT tells the client."""
_BY_REASON = {
    "packet-too-large": R.PACKET_TOO_LARGE,
    "qos2-window": R.RECEIVE_MAXIMUM_EXCEEDED,
    "second-connect": R.PROTOCOL_ERROR,
    "not-connected": R.PROTOCOL_ERROR,
    "expected-connect": R.PROTOCOL_ERROR,
}
"""The 3.1.1 reader's errors (it frames 5.0 packets too) that are not Malformed Packets."""
_MAX_REASON_STRING = 200
"""Characters of a log detail sent as a DISCONNECT's Reason String."""


def code_for(exc: ProtocolError) -> ReasonCode:
    """The reason code that answers ``exc``: its own for a 5.0 reader's error, else
    Malformed Packet for a framing error (bad flags, a lying length), or the code the
    error's kind has."""
    if isinstance(exc, PacketError):
        return exc.code
    return _BY_REASON.get(exc.reason, R.MALFORMED_PACKET)


class Session5(Session):
    """MQTT 5.0 packet-order rules and replies for one connection (see the module docs)."""

    __slots__ = (
        "asked_expiry",
        "session_expiry",
        "told_keep_alive",
        "receive_maximum",
        "max_packet_size",
        "problem_information",
        "aliases",
        "sent_aliases",
        "_code",
    )

    def __init__(self, policy: SessionPolicy | None = None) -> None:
        super().__init__(policy)
        self.protocol_level = 5
        self.asked_expiry = 0
        """The Session Expiry Interval the CONNECT asked for (absent: 0)."""
        self.session_expiry = 0
        """The one the session has: the client's, at most ``--session-expiry`` (0: it ends
        with the connection); a DISCONNECT may change it."""
        self.told_keep_alive: int | None = None
        """The Server Keep Alive sent in CONNACK, if the client's was not kept."""
        self.receive_maximum = 65535
        """QoS 1 and 2 messages the client takes unacknowledged (its Receive Maximum)."""
        self.max_packet_size = 0
        """The largest packet the client takes (its Maximum Packet Size); 0: no limit."""
        self.problem_information = True
        """Whether the client takes Reason Strings (Request Problem Information)."""
        self.aliases: dict[int, str] | None = None
        """The client's topic aliases (made on the first)."""
        self.sent_aliases: OutboundAliases | None = None
        """The server's topic aliases towards the client, if its CONNECT allowed any."""
        self._code: int | None = None

    # -- the server's side ---------------------------------------------------------------

    @property
    def reason_code(self) -> int | None:
        """The reason code that ended the session: the client's DISCONNECT's, or the
        server's (a refusal, a DISCONNECT it sent); None while it lives."""
        return self._code

    def accepted(self, session_present: bool = False, inbound: frozenset[int] = frozenset()) -> bytes:
        """The CONNACK of an accepted CONNECT, with the server's limits."""
        super().accepted(session_present, inbound)
        policy = self._policy
        told_expiry = self.session_expiry if self.session_expiry != self.asked_expiry else None
        props = Properties(
            session_expiry_interval=told_expiry,
            receive_maximum=policy.receive_maximum if policy.receive_maximum < 65535 else None,
            maximum_qos=policy.max_qos if policy.max_qos < 2 else None,
            maximum_packet_size=policy.max_packet_size,
            assigned_client_identifier=self.client_id if self.assigned else None,
            topic_alias_maximum=policy.topic_alias_maximum or None,
            server_keep_alive=self.told_keep_alive,
            retain_available=None if policy.retain_available else 0,
        )
        return pack(Connack(session_present, 0, props))

    def refused(self, return_code: int) -> bytes:
        """The CONNACK refusing the CONNECT: ``return_code`` is 3.1.1's (1 to 5, what
        the server's admission says) or already 5.0's (0x80 and up)."""
        super().refused(return_code)
        code = fit_reason(CONNACK, _REFUSALS.get(return_code, return_code))
        self._code = code
        return pack(Connack(False, code))

    def goodbye(self, reason: Offline) -> bytes | None:
        """The DISCONNECT telling the client why the server ends its connection
        (keep-alive timeout, takeover, shutdown, quota), if it is connected."""
        code = _GOODBYES.get(reason)
        if code is None or self.state is not State.CONNECTED:
            return None
        self._code = int(code)
        return pack(Disconnect(code))

    def violated(self, exc: ProtocolError) -> bytes | None:
        """The client broke the protocol: a CONNACK refusal before the session exists,
        a DISCONNECT with the reason code after (with the detail as Reason String,
        unless the client asked for none)."""
        code = code_for(exc)
        if self.state in (State.AWAITING_CONNECT, State.CONNECTING):
            return self.refused(code)
        if self.state is not State.CONNECTED:
            return None
        self.state = State.CLOSED
        told = fit_reason(DISCONNECT, code)
        self._code = told
        if not self.problem_information:
            return pack(Disconnect(told))
        return pack(Disconnect(told, Properties(reason_string=f"{exc.reason}: {exc.detail}"[:_MAX_REASON_STRING])))

    # -- the client's packets ------------------------------------------------------------

    def receive(self, packet: object) -> list[Effect]:
        """Effects of one packet from the client. Raises :class:`ProtocolError` (a
        :class:`PacketError` with the reason code to send) on a violation."""
        state = self.state
        if state is State.AWAITING_CONNECT:
            if type(packet) is not Connect:
                raise protocol_error(f"{type(packet).__name__} before CONNECT")
            return [self._connect5(packet)]
        if state is not State.CONNECTED:
            raise protocol_error(f"{type(packet).__name__} in state {state.value}")
        kind = type(packet)
        if kind is Pingreq:
            return [_PINGRESP]
        if kind is Publish:
            return self._publish5(packet)  # type: ignore[arg-type]
        if kind is Ack:
            return self._ack(packet)  # type: ignore[arg-type]
        if kind is Subscribe:
            return self._subscribe5(packet)  # type: ignore[arg-type]
        if kind is Unsubscribe:
            return self._unsubscribe5(packet)  # type: ignore[arg-type]
        if kind is Disconnect:
            return self._disconnect5(packet)  # type: ignore[arg-type]
        if kind is Auth:
            raise protocol_error("AUTH, where the CONNECT named no Authentication Method")
        raise protocol_error(f"{kind.__name__} on a connected session")

    def _connect5(self, packet: Connect) -> Accept:
        self.state = State.CONNECTING
        policy = self._policy
        props = packet.properties
        client_id = packet.client_id
        if packet.will is not None and packet.will.retain and not policy.retain_available:
            raise PacketError(R.RETAIN_NOT_SUPPORTED, "a retained Will (--retain-available false)")
        if props.authentication_method is not None:
            raise PacketError(R.BAD_AUTHENTICATION_METHOD, repr(props.authentication_method[:32]))
        bad = forbidden_character(client_id)
        if bad is not None or "+" in client_id or "#" in client_id:
            what = f"U+{ord(bad):04X}" if bad is not None else "a wildcard (+ or #)"
            raise PacketError(R.CLIENT_IDENTIFIER_NOT_VALID, f"{what} in the client id")
        if utf8_length(client_id) > policy.max_client_id:
            raise PacketError(
                R.CLIENT_IDENTIFIER_NOT_VALID,
                f"a client id of {utf8_length(client_id)} bytes (at most {policy.max_client_id})",
            )
        username = packet.username
        if username is not None and (utf8_length(username) > policy.max_username or forbidden_character(username)):
            raise PacketError(R.BAD_USER_NAME_OR_PASSWORD, f"a username of {utf8_length(username)} bytes, or unfit")
        assigned = not client_id
        if assigned:
            client_id = assign_client_id()  # 5.0 takes an empty id with any Clean Start (§3.1.3.1)
        self.client_id = client_id
        self.assigned = assigned
        keep_alive = packet.keep_alive
        if not keep_alive or keep_alive > policy.max_keepalive:
            keep_alive = self.told_keep_alive = policy.max_keepalive
        self.keep_alive = keep_alive
        asked = props.session_expiry_interval or 0
        self.asked_expiry = asked
        self.session_expiry = min(asked, policy.session_expiry)  # 0xFFFFFFFF, "never", is cut too
        if props.receive_maximum is not None:
            self.receive_maximum = props.receive_maximum
        if props.maximum_packet_size is not None:
            self.max_packet_size = props.maximum_packet_size
        if props.request_problem_information == 0:
            self.problem_information = False
        if props.topic_alias_maximum and policy.outbound_topic_aliases:
            self.sent_aliases = OutboundAliases(props.topic_alias_maximum)
        will = packet.will
        if will is not None:
            topic = will.topic
            if not topic or "+" in topic or "#" in topic or forbidden_character(topic) is not None:
                raise PacketError(R.TOPIC_NAME_INVALID, f"the Will topic {topic[:64]!r}")
            if policy.message_size_limit and len(will.payload) > policy.message_size_limit:
                raise PacketError(R.PACKET_TOO_LARGE, f"a Will payload over {policy.message_size_limit} bytes")
            wp = will.properties
            # It goes at the delay's end or the session's, whichever is first (§3.1.3.2.2).
            asked_delay = wp.will_delay_interval or 0
            delay = min(asked_delay, self.session_expiry)
            self.will = Will(topic, will.payload, will.qos, will.retain, outbound.forwarded(wp), delay, asked_delay)
        lasting = self.session_expiry > 0
        clean = packet.clean_start
        return Accept(
            client_id=client_id,
            assigned=assigned,
            keep_alive=keep_alive,
            # Clean Start 0 asks for a stored session whatever the expiry: the expiry is
            # only how long the session outlives this connection (§3.1.2.4).
            clean_session=clean and not lasting,
            username=username,
            password=packet.password,
            will=self.will,
            fresh=clean and lasting,
            expiry=self.session_expiry,
        )

    def _publish5(self, packet: Publish) -> list[Effect]:
        policy = self._policy
        if packet.retain and not policy.retain_available:
            raise PacketError(R.RETAIN_NOT_SUPPORTED, "a retained PUBLISH (--retain-available false)")
        props = packet.properties
        topic = packet.topic
        alias = props.topic_alias
        if alias is not None:
            if not 0 < alias <= policy.topic_alias_maximum:
                raise PacketError(R.TOPIC_ALIAS_INVALID, f"alias {alias} (at most {policy.topic_alias_maximum})")
            aliases = self.aliases
            if aliases is None:
                aliases = self.aliases = {}
            if topic:
                aliases[alias] = topic
            else:
                known = aliases.get(alias)
                if known is None:
                    raise protocol_error(f"topic alias {alias} used before it was set")
                topic = known
        if props.subscription_identifiers:
            raise protocol_error("a Subscription Identifier in a client's PUBLISH")
        bad = forbidden_character(topic)
        if bad is not None:
            raise PacketError(R.TOPIC_NAME_INVALID, f"U+{ord(bad):04X} in a topic")
        qos = packet.qos
        if qos > policy.max_qos:
            raise PacketError(R.QOS_NOT_SUPPORTED, f"PUBLISH at QoS {qos}, above Maximum QoS {policy.max_qos}")
        packet_id = packet.packet_id
        effects: list[Effect] = []
        code = 0
        limit = policy.message_size_limit
        if limit and len(packet.payload) > limit:
            # Judged before the access rules, as Mosquitto. It answers 0x95, which MQTT 5 does
            # not allow in a PUBACK or PUBREC: paho reads it as a malformed packet, reconnects
            # and sends the message again, for ever. 0x97 (an administrative limit) ends it.
            effects.append(TooLarge(topic, len(packet.payload)))
            code = R.QUOTA_EXCEEDED
        elif self.reserved(topic) or (self.permissions is not None and not self.permissions.may_publish(topic)):
            # Presence (and every $ topic) is the server's to publish; told so, unlike 3.1.1.
            self.denied_publishes += 1
            effects.append(Denied(topic))
            code = R.NOT_AUTHORIZED
        elif props.payload_format_indicator == 1 and not _utf8(packet.payload):
            code = R.PAYLOAD_FORMAT_INVALID
        if qos == 2 and packet_id is not None:
            inbound = self.inbound
            if inbound is None:
                inbound = self.inbound = set()
            if packet_id in inbound:
                return [Send(pack(Ack(PUBREC, packet_id)))]  # a duplicate: taken already
            if not code:  # a refusal ends the exchange at PUBREC: nothing is held (§4.3.3)
                if len(inbound) >= policy.receive_maximum:
                    raise PacketError(
                        R.RECEIVE_MAXIMUM_EXCEEDED,
                        f"more than {policy.receive_maximum} QoS 2 messages without PUBREL",
                    )
                inbound.add(packet_id)
                effects.append(HoldInbound(packet_id))
        if not code:
            effects.append(Publication(topic, packet.payload, qos, packet.retain, outbound.forwarded(props)))
        if qos == 1 and packet_id is not None:
            effects.append(Send(pack(Ack(PUBACK, packet_id, code))))
        elif qos == 2 and packet_id is not None:
            effects.append(Send(pack(Ack(PUBREC, packet_id, code))))
        return effects

    def _ack(self, packet: Ack) -> list[Effect]:
        kind = packet.kind
        if kind == PUBACK:
            return [Acknowledged("puback", packet.packet_id)]
        if kind == PUBREC:
            return [Acknowledged("pubrec", packet.packet_id)]
        if kind == PUBCOMP:
            return [Acknowledged("pubcomp", packet.packet_id)]
        return self._release(packet.packet_id)

    def _subscribe5(self, packet: Subscribe) -> list[Effect]:
        identifiers = packet.properties.subscription_identifiers
        identifier = identifiers[0] if identifiers else 0  # the codec allows one in a SUBSCRIBE
        codes: list[int] = []
        effects: list[Effect] = []
        wanted: list[tuple[str, int]] = []
        handling: dict[str, int] = {}
        options: dict[str, int] = {}
        for sub in packet.subscriptions:
            topic_filter = sub.topic_filter
            check_filter(topic_filter)
            if forbidden_character(topic_filter) is not None:
                raise PacketError(R.MALFORMED_PACKET, f"a control character in the filter {topic_filter[:64]!r}")
            if topic_filter.startswith(SHARE_PREFIX) and sub.no_local:
                raise protocol_error(f"No Local on the shared subscription {topic_filter[:64]!r} (§3.8.3.1)")
            wanted.append((topic_filter, sub.qos))
            handling[topic_filter] = sub.retain_handling
            options[topic_filter] = pack_options(sub.no_local, sub.retain_as_published, identifier)
        held = self._held_filters()
        for topic_filter, level, verdict in self._verdicts(wanted):
            if verdict is Verdict.INVALID:
                codes.append(R.TOPIC_FILTER_INVALID)
            elif verdict is Verdict.DENIED:
                codes.append(R.NOT_AUTHORIZED)
            elif verdict is Verdict.QUOTA:
                codes.append(R.QUOTA_EXCEEDED)
                effects.append(SubscriptionRefused(topic_filter))
            else:
                # Retain Handling: 0 send the retained messages, 1 only for a new subscription, 2 never.
                how = handling[topic_filter]
                retained = how == 0 or (how == 1 and topic_filter not in held)
                codes.append(level)
                effects.append(AddSubscription(topic_filter, level, retained=retained, options=options[topic_filter]))
        effects.append(Send(pack(Suback(packet.packet_id, tuple(codes)))))
        return effects

    def _held_filters(self) -> Collection[str]:
        # The broker's own set, as a view (read before this packet's effects apply): a
        # SUBSCRIBE must not cost a step per filter its client already holds.
        held = self._policy.held
        if held is None or self.client_id is None:
            return ()
        return held(self.client_id)[0]

    def _unsubscribe5(self, packet: Unsubscribe) -> list[Effect]:
        counted = self._policy.held is not None
        held = self._held_filters()
        effects: list[Effect] = []
        codes: list[int] = []
        for topic_filter in packet.topic_filters:
            check_filter(topic_filter)
            codes.append(R.SUCCESS if not counted or topic_filter in held else R.NO_SUBSCRIPTION_EXISTED)
            effects.append(RemoveSubscription(topic_filter))
        effects.append(Send(pack(Unsuback(packet.packet_id, tuple(codes)))))
        return effects

    def _disconnect5(self, packet: Disconnect) -> list[Effect]:
        expiry = packet.properties.session_expiry_interval
        if expiry and not self.asked_expiry:
            # §3.14.2.2.2: a session that was to end with the connection cannot be kept now.
            raise protocol_error("a Session Expiry Interval at DISCONNECT after 0 at CONNECT")
        self.state = State.CLOSED
        self._code = packet.reason_code
        if expiry is not None:
            self.session_expiry = min(expiry, self._policy.session_expiry)
        will = self.will
        if packet.reason_code != R.DISCONNECT_WITH_WILL:
            self.will = None
        elif will is not None:
            # It goes when its delay is up or its session ends, whichever is first: the
            # DISCONNECT may have moved the session's end either way.
            self.will = replace(will, delay=min(will.asked_delay, self.session_expiry))
        return [Goodbye()]


def _utf8(payload: bytes) -> bool:
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
