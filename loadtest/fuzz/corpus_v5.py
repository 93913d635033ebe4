"""MQTT 5.0 sessions for the fuzz corpus (:mod:`.corpus`), written by the server's own 5.0
codec (:func:`servers.heartbeat.mqtt.v5.codec.pack`). Pure: no I/O.

A session is a CONNECT with properties (Session Expiry, Receive Maximum, Maximum Packet
Size, Topic Alias Maximum, problem and response information, User Properties, now and
then an Authentication Method), maybe a Will with its own properties (Will Delay,
Message Expiry, Content Type, Payload Format, Response Topic, Correlation Data),
username and password; then a few of SUBSCRIBE with options (No Local, Retain As
Published, Retain Handling) and a Subscription Identifier, UNSUBSCRIBE, PUBLISH with
properties (a Topic Alias set with its topic, then used alone), the QoS
acknowledgements with reason codes and reason strings, AUTH, PINGREQ; and sometimes a
DISCONNECT with a reason code and properties.

Valid by the codec's reading; some are refused by a server all the same, as the
security table and the spec's semantics want (a Will on a server-only topic, an AUTH
without enhanced authentication, a Topic Alias past the server's maximum): those
refusals are clear answers too.
"""

from __future__ import annotations

import random
from typing import Any

from servers.heartbeat.mqtt.v5.codec import pack
from servers.heartbeat.mqtt.v5.packets import (
    PUBACK,
    PUBCOMP,
    PUBREC,
    PUBREL,
    Ack,
    Auth,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Publish,
    Subscribe,
    Subscription,
    Unsubscribe,
    Will,
)
from servers.heartbeat.mqtt.v5.properties import EMPTY, Properties

from .segments import Segments

__all__ = ["mqtt5_session"]

# The same ids and topics as the 3.1.1 corpus's, so that 5.0 and 3.1.1 sessions take
# each other over and publish to each other's subscriptions.
CLIENT_IDS = ("", "", "", "fuzz-0", "fuzz-1", "fuzz-2", "fuzz-3", "fuzz-4", "fuzz-5", "f" * 23, "fuzz/é", "fuzz-7")
HOSTILE_IDS = ("fuzz+1", "fuzz#2", "fuzz/cmd", "f" * 300)
TOPICS = ("fuzz/a/b", "fuzz/0/state", "fuzz/1/state", "fuzz/x", "fuzz/é/ü")
SERVER_TOPICS = ("$SYS/presence/fuzz-1", "$SYS/fuzz")
"""Topics only the server writes (its presence topics, and ``$SYS``)."""
FILTERS = ("fuzz/+/state", "fuzz/a/#", "fuzz/a/b", "fuzz/x", "$SYS/presence/fuzz-1", "+/+/state", "fuzz/#", "#")
FILTER_WEIGHTS = (6, 4, 6, 4, 2, 2, 1, 0.3)
AUTH_METHODS = ("SCRAM-SHA-1", "fuzz-token")
_USER_KEYS = ("k", "region", "é", "")
_CLIENT_DISCONNECT_CODES = (0x00, 0x00, 0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x90, 0x93, 0x94, 0x95, 0x98)
_PUB_ACK_CODES = (0x00, 0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99)
_ACK_KINDS = {"puback": PUBACK, "pubrec": PUBREC, "pubrel": PUBREL, "pubcomp": PUBCOMP}


def _packet_id(rng: random.Random) -> int:
    return rng.randint(1, 0xFDFF)


def _users(rng: random.Random) -> tuple[tuple[str, str], ...]:
    return tuple((rng.choice(_USER_KEYS), f"v{rng.randrange(100)}") for _ in range(rng.randint(1, 3)))


def _message_properties(rng: random.Random, payload: bytes) -> tuple[Properties, bytes]:
    """Properties a PUBLISH or a Will may carry, a random few of them (the payload made
    UTF-8 when the Payload Format Indicator says so)."""
    props: dict[str, Any] = {}
    if rng.random() < 0.2:
        props["payload_format_indicator"] = 1
        payload = "état ok".encode()
    if rng.random() < 0.2:
        props["message_expiry_interval"] = rng.choice((0, 1, 60, 0xFFFFFFFF))
    if rng.random() < 0.15:
        props["content_type"] = rng.choice(("application/json", "text/plain; charset=utf-8", ""))
    if rng.random() < 0.15:
        props["response_topic"] = rng.choice(TOPICS)
        if rng.random() < 0.7:
            props["correlation_data"] = rng.randbytes(rng.randint(0, 16))
    if rng.random() < 0.2:
        props["user_properties"] = _users(rng)
    return (Properties(**props) if props else EMPTY), payload


def _connect(rng: random.Random) -> tuple[str, Connect]:
    hostile = rng.random() < 0.05
    client_id = rng.choice(HOSTILE_IDS if hostile else CLIENT_IDS)
    name = "connect5-hostile-id" if hostile else "connect5"
    props: dict[str, Any] = {}
    if rng.random() < 0.5:
        props["session_expiry_interval"] = rng.choice((0, 0, 10, 30, 0xFFFFFFFF))
    if rng.random() < 0.5:
        props["receive_maximum"] = rng.choice((1, 10, 32, 65535))
    if rng.random() < 0.3:
        props["maximum_packet_size"] = rng.choice((128, 1024, 262144, 0xFFFFFFFF))
    if rng.random() < 0.3:
        props["topic_alias_maximum"] = rng.choice((0, 1, 10, 65535))
    if rng.random() < 0.15:
        props["request_response_information"] = rng.randrange(2)
    if rng.random() < 0.15:
        props["request_problem_information"] = rng.randrange(2)
    if rng.random() < 0.2:
        props["user_properties"] = _users(rng)
    if rng.random() < 0.05:
        # Enhanced authentication, which a server without it refuses (0x8C).
        name += "-auth-method"
        props["authentication_method"] = rng.choice(AUTH_METHODS)
        if rng.random() < 0.7:
            props["authentication_data"] = rng.randbytes(rng.randint(0, 24))
    will = None
    if rng.random() < 0.2:
        name += "-will"
        topic = rng.choice(SERVER_TOPICS) if rng.random() < 0.1 else f"fuzz/will/{rng.randrange(4)}"
        will_props, payload = _message_properties(rng, rng.randbytes(rng.randint(0, 16)))
        if rng.random() < 0.4:
            will_props = will_props.replace(will_delay_interval=rng.choice((0, 1, 5, 3600)))
        will = Will(topic, payload, rng.randrange(3), rng.random() < 0.1, will_props)
    username = password = None
    if rng.random() < 0.2:
        name += "-login"
        username = rng.choice(("fuzz", "", "üser"))
        password = rng.randbytes(rng.randint(0, 12)) if rng.random() < 0.7 else None
    packet = Connect(
        client_id,
        rng.choice((1, 1, 1, 2, 2, 0, 30)),
        clean_start=rng.random() < 0.85,
        properties=Properties(**props) if props else EMPTY,
        will=will,
        username=username,
        password=password,
    )
    return name, packet


class _Session:
    """What a session's later packets depend on: the Topic Aliases it has set."""

    def __init__(self) -> None:
        self.aliases: list[int] = []

    def publish(self, rng: random.Random) -> tuple[str, Packet]:
        qos = rng.choice((0, 0, 1, 2))
        topic = rng.choice(SERVER_TOPICS) if rng.random() < 0.03 else rng.choice(TOPICS)
        props, payload = _message_properties(rng, rng.randbytes(rng.randint(0, 64)))
        name = f"publish5-{qos}"
        r = rng.random()
        if r < 0.15 and self.aliases:
            # The alias alone: the topic it was set with stands in for the empty name.
            name += "-alias"
            topic = ""
            props = props.replace(topic_alias=rng.choice(self.aliases))
        elif r < 0.35:
            name += "-alias-set"
            alias = rng.randint(1, 10)
            self.aliases.append(alias)
            props = props.replace(topic_alias=alias)
        packet = Publish(
            topic,
            payload,
            qos=qos,
            retain=rng.random() < 0.05,
            packet_id=_packet_id(rng) if qos else None,
            properties=props,
        )
        return name, packet

    def op(self, rng: random.Random) -> tuple[str, Packet]:
        r = rng.random()
        if r < 0.22:
            filters = rng.choices(FILTERS, FILTER_WEIGHTS, k=rng.randint(1, 3))
            subs = tuple(
                Subscription(
                    f,
                    qos=rng.randrange(3),
                    no_local=rng.random() < 0.2,
                    retain_as_published=rng.random() < 0.2,
                    retain_handling=rng.choice((0, 0, 1, 2)),
                )
                for f in filters
            )
            props: dict[str, Any] = {}
            if rng.random() < 0.3:
                props["subscription_identifiers"] = (rng.choice((1, 127, 128, 16_384, 268_435_455)),)
            if rng.random() < 0.2:
                props["user_properties"] = _users(rng)
            return "subscribe5", Subscribe(_packet_id(rng), subs, Properties(**props) if props else EMPTY)
        if r < 0.30:
            dropped = tuple(rng.sample(FILTERS[:6], rng.randint(1, 2)))
            users = Properties(user_properties=_users(rng)) if rng.random() < 0.2 else EMPTY
            return "unsubscribe5", Unsubscribe(_packet_id(rng), dropped, users)
        if r < 0.68:
            return self.publish(rng)
        if r < 0.80:
            kind = rng.choice(tuple(_ACK_KINDS))
            code = rng.choice((0x00, 0x92)) if kind in ("pubrel", "pubcomp") else rng.choice(_PUB_ACK_CODES)
            ack_props = Properties(reason_string="fuzz says no") if code and rng.random() < 0.5 else EMPTY
            return f"{kind}5", Ack(_ACK_KINDS[kind], _packet_id(rng), code, ack_props)
        if r < 0.85:
            # Re-authentication or a continued exchange: a server without enhanced
            # authentication refuses it (a Protocol Error).
            auth = Properties(authentication_method=rng.choice(AUTH_METHODS), authentication_data=rng.randbytes(8))
            return "auth5", Auth(rng.choice((0x18, 0x19)), auth)
        return "pingreq", Pingreq()


def _disconnect(rng: random.Random) -> tuple[str, Disconnect]:
    code = rng.choice(_CLIENT_DISCONNECT_CODES)
    props: dict[str, Any] = {}
    if rng.random() < 0.2:
        # A Protocol Error if the CONNECT's Session Expiry was 0: the server must say so.
        props["session_expiry_interval"] = rng.choice((0, 10))
    if rng.random() < 0.3:
        props["reason_string"] = rng.choice(("bye", "rebooting", "é"))
    if rng.random() < 0.1:
        props["user_properties"] = _users(rng)
    return f"disconnect5-0x{code:02x}", Disconnect(code, Properties(**props) if props else EMPTY)


def mqtt5_session(rng: random.Random) -> tuple[str, Segments]:
    """A valid MQTT 5.0 session as a client sends it: CONNECT, a few packets, maybe DISCONNECT;
    its name (``connect5-will+publish5-1-alias-set+disconnect5-0x04``) and its packets."""
    name, connect = _connect(rng)
    names = [name]
    packets = [pack(connect)]
    session = _Session()
    for _ in range(rng.choice((0, 1, 1, 2, 2, 3, 4, 5))):
        op, packet = session.op(rng)
        names.append(op)
        packets.append(pack(packet))
    if rng.random() < 0.35:
        op, packet = _disconnect(rng)
        names.append(op)
        packets.append(pack(packet))
    return "+".join(names), packets
