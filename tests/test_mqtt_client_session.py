"""The client side of MQTT (issue 64), sans-IO: :class:`ClientSession` against a scripted
remote for every exchange of 3.1.1 and 5.0, a state machine against a plain model
(every QoS 1/2 message acknowledged exactly once, whatever the acks, duplicates and
reconnects), and the session over real loopback sockets against Mosquitto and against
this server in-process."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loadtest.processes import free_port, stop, wait_listening
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt import packets as v3
from servers.heartbeat.mqtt.client import (
    CLOSED,
    CONNECTED,
    MQTT_50,
    MQTT_311,
    Acknowledged,
    ClientOptions,
    ClientSession,
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
from servers.heartbeat.mqtt.client.reader import ServerPacketReader
from servers.heartbeat.mqtt.reader import PacketReader
from servers.heartbeat.mqtt.v5 import codec
from servers.heartbeat.mqtt.v5 import packets as v5
from servers.heartbeat.mqtt.v5.properties import EMPTY, Properties

from .mosquitto_peer import require_mosquitto
from .test_heartbeat import running

VERSIONS = pytest.mark.parametrize("version", [MQTT_311, MQTT_50], ids=["3.1.1", "5.0"])


# -- a scripted remote: reads what the client wrote, writes what a broker would --------


class Remote:
    """The broker's half of a unit test, one network connection at a time."""

    def __init__(self, version: int) -> None:
        self.v5 = version == MQTT_50
        self.reader = PacketReader(1 << 20)

    def read(self, session: ClientSession) -> list[Any]:
        """What the client queued, parsed by the server's own reader."""
        return self.reader.feed(session.bytes_to_send())

    def reconnect(self) -> None:
        self.reader = PacketReader(1 << 20)

    def connack(self, present: bool = False, code: int = 0, props: Properties = EMPTY) -> bytes:
        if self.v5:
            return codec.pack(v5.Connack(present, code, props))
        return encoders.encode_connack(present, code)

    def publish(self, topic: str, payload: bytes, qos: int = 0, packet_id: int | None = None, **kw: Any) -> bytes:
        if self.v5:
            return codec.pack(v5.Publish(topic, payload, qos, packet_id=packet_id, **kw))
        return encoders.encode_publish(topic, payload, qos, packet_id=packet_id, **kw)

    def suback(self, packet_id: int, codes: list[int]) -> bytes:
        if self.v5:
            return codec.pack(v5.Suback(packet_id, tuple(codes)))
        return encoders.encode_suback(packet_id, codes)


def ack(kind: int, packet_id: int, code: int = 0) -> bytes:
    """PUBACK, PUBREC, PUBREL or PUBCOMP: with code 0 the same bytes in both versions."""
    return codec.pack(v5.Ack(kind, packet_id, code))


def shape(packet: Any) -> tuple[Any, ...]:
    """A packet of either version as a comparable tuple: (name, packet id, ...)."""
    if isinstance(packet, (v3.Publish, v5.Publish)):
        return ("PUBLISH", packet.packet_id, packet.topic, packet.qos, packet.dup)
    if isinstance(packet, v5.Ack):
        return (v3.TYPE_NAMES[packet.kind], packet.packet_id, packet.reason_code)
    if isinstance(packet, (v3.Puback, v3.Pubrec, v3.Pubrel, v3.Pubcomp)):
        return (type(packet).__name__.upper(), packet.packet_id, 0)
    return (type(packet).__name__.upper(),)


def connected(
    version: int, present: bool = False, props: Properties = EMPTY, **kw: Any
) -> tuple[ClientSession, Remote]:
    session = ClientSession(ClientOptions("bridge-1", version, **kw))
    remote = Remote(version)
    session.connect()
    (connect,) = remote.read(session)
    assert isinstance(connect, (v3.Connect, v5.Connect))
    assert session.receive_data(remote.connack(present, props=props)) == [Connected(present, 0, props)]
    assert session.state == CONNECTED
    return session, remote


# -- CONNECT and CONNACK ------------------------------------------------------------------


def test_a_311_connect_says_what_the_options_ask() -> None:
    will = v5.Will("bridges/b1/state", b"gone", 1, True)
    options = ClientOptions("b1", MQTT_311, clean=False, keep_alive=30, username="u", password=b"p", will=will)
    session = ClientSession(options)
    session.connect()
    (connect,) = PacketReader().feed(session.bytes_to_send())
    assert connect == v3.Connect("MQTT", 4, False, 30, "b1", "bridges/b1/state", b"gone", 1, True, "u", b"p")


def test_a_50_connect_carries_its_properties_and_the_wills() -> None:
    will = v5.Will("w", b"x", 2, False, Properties(will_delay_interval=5))
    extra = Properties(user_properties=(("bridge", "yes"),))
    options = ClientOptions(
        "b1", MQTT_50, session_expiry=600, receive_maximum=10, maximum_packet_size=4096, will=will, properties=extra
    )
    session = ClientSession(options)
    session.connect()
    (connect,) = PacketReader().feed(session.bytes_to_send())
    assert isinstance(connect, v5.Connect) and connect.will == will and connect.clean_start
    assert connect.properties == extra.replace(
        session_expiry_interval=600, receive_maximum=10, maximum_packet_size=4096
    )


@VERSIONS
def test_try_private_marks_the_protocol_level_as_a_mosquitto_bridge_does(version: int) -> None:
    plain, private = (ClientSession(ClientOptions("b" * 200, version, try_private=p)) for p in (False, True))
    for session in (plain, private):
        session.connect()
    a, b = plain.bytes_to_send(), private.bytes_to_send()
    # 200 bytes of client id: a two-byte remaining length, so the level sits at 3 + 6.
    assert a[9] == version and b[9] == version | 0x80
    assert a[:9] + a[10:] == b[:9] + b[10:]


@pytest.mark.parametrize(
    ("version", "code", "label"), [(4, 5, "not-authorized"), (5, 0x86, "bad-user-name-or-password")]
)
def test_a_refusal_is_reported_and_closes(version: int, code: int, label: str) -> None:
    session, remote = ClientSession(ClientOptions("b", version)), Remote(version)
    session.connect()
    assert session.receive_data(remote.connack(False, code)) == [Refused(code, label)]
    assert session.state == CLOSED


def test_a_50_connack_sets_the_window_the_keep_alive_and_the_client_id() -> None:
    session = ClientSession(ClientOptions("", MQTT_50, window=50))
    remote = Remote(MQTT_50)
    session.connect()
    remote.read(session)
    props = Properties(receive_maximum=2, server_keep_alive=15, assigned_client_identifier="auto-7")
    session.receive_data(remote.connack(props=props))
    assert (session.keep_alive, session.client_id) == (15, "auto-7")
    tokens = [session.publish("t", b"%d" % i, qos=1) for i in range(3)]
    assert [shape(p)[:2] for p in remote.read(session)] == [("PUBLISH", 1), ("PUBLISH", 2)]
    assert (session.in_flight, session.queued) == (2, 1)
    assert session.receive_data(ack(v5.PUBACK, 1)) == [Acknowledged(tokens[0])]
    assert [shape(p)[:2] for p in remote.read(session)] == [("PUBLISH", 3)]
    session.connect()  # the next CONNECT names the assigned id
    (connect,) = Remote(MQTT_50).read(session)
    assert connect.client_id == "auto-7"


# -- outbound messages ------------------------------------------------------------------


@VERSIONS
def test_qos_0_1_and_2_out_and_their_acknowledgements(version: int) -> None:
    session, remote = connected(version)
    t0, t1, t2 = (session.publish("a/b", b"m%d" % q, qos=q, retain=q == 1) for q in (0, 1, 2))
    assert [shape(p) for p in remote.read(session)] == [
        ("PUBLISH", None, "a/b", 0, False),
        ("PUBLISH", 1, "a/b", 1, False),
        ("PUBLISH", 2, "a/b", 2, False),
    ]
    assert session.receive_data(ack(v5.PUBACK, 1) + ack(v5.PUBREC, 2)) == [Acknowledged(t1)]
    assert [shape(p) for p in remote.read(session)] == [("PUBREL", 2, 0)]
    assert session.receive_data(ack(v5.PUBREC, 2)) == []  # a duplicate PUBREC: PUBREL again
    assert [shape(p) for p in remote.read(session)] == [("PUBREL", 2, 0)]
    assert session.receive_data(ack(v5.PUBCOMP, 2)) == [Acknowledged(t2)]
    assert session.receive_data(ack(v5.PUBCOMP, 2) + ack(v5.PUBACK, 1)) == []  # late duplicates: no news
    assert t0 < t1 < t2 and session.unfinished == []


def test_the_311_window_queues_and_releases_in_order() -> None:
    session, remote = connected(MQTT_311, window=2)
    tokens = [session.publish("q", b"", qos=2) for _ in range(4)]
    assert [shape(p)[1] for p in remote.read(session)] == [1, 2]
    session.publish("q0", b"")  # QoS 0 owes the window nothing
    assert [shape(p)[1:3] for p in remote.read(session)] == [(None, "q0")]
    session.receive_data(ack(v5.PUBREC, 1))
    assert [shape(p)[:2] for p in remote.read(session)] == [("PUBREL", 1)]  # still in flight until PUBCOMP
    assert session.receive_data(ack(v5.PUBCOMP, 1)) == [Acknowledged(tokens[0])]
    assert [shape(p)[:2] for p in remote.read(session)] == [("PUBLISH", 3)]
    assert session.unfinished == tokens[1:]


def test_a_50_failed_puback_or_pubrec_finishes_the_message_with_its_code() -> None:
    session, remote = connected(MQTT_50)
    t1, t2 = session.publish("x", b"", qos=1), session.publish("y", b"", qos=2)
    remote.read(session)
    assert session.receive_data(ack(v5.PUBACK, 1, 0x87) + ack(v5.PUBREC, 2, 0x97)) == [
        Acknowledged(t1, 0x87),
        Acknowledged(t2, 0x97),
    ]
    assert remote.read(session) == []  # no PUBREL after a failed PUBREC


def test_the_remotes_maximum_packet_size_drops_what_would_exceed_it() -> None:
    session, remote = connected(MQTT_50, props=Properties(maximum_packet_size=64))
    big = session.publish("t", b"x" * 100, qos=1)
    small = session.publish("t", b"x", qos=1)
    assert session.pending_events() == [Dropped(big, "packet-too-large")]
    assert [shape(p)[:2] for p in remote.read(session)] == [("PUBLISH", 2)]  # the big one went nowhere
    assert session.receive_data(ack(v5.PUBACK, 2)) == [Acknowledged(small)]


def test_maximum_qos_retain_available_and_topic_aliases_the_remote_offers() -> None:
    props = Properties(maximum_qos=1, retain_available=0, topic_alias_maximum=10)
    session, remote = connected(MQTT_50, props=props)
    token = session.publish("some/long/topic", b"", qos=2, retain=True, properties=Properties(topic_alias=3))
    (publish,) = remote.read(session)
    assert (publish.qos, publish.retain, publish.topic) == (1, False, "some/long/topic")
    assert publish.properties.topic_alias is None
    assert session.receive_data(ack(v5.PUBACK, 1)) == [Acknowledged(token)]


# -- inbound messages -------------------------------------------------------------------


@VERSIONS
def test_inbound_qos_2_is_delivered_once_whatever_the_resends(version: int) -> None:
    session, remote = connected(version)
    first = session.receive_data(remote.publish("in/t", b"v", 2, 9))
    assert first == [Message("in/t", b"v", 2, False)]
    assert session.receive_data(remote.publish("in/t", b"v", 2, 9, dup=True)) == []  # not yet released
    assert [shape(p) for p in remote.read(session)] == [("PUBREC", 9, 0), ("PUBREC", 9, 0)]
    assert session.receive_data(ack(v5.PUBREL, 9)) == []
    assert [shape(p) for p in remote.read(session)] == [("PUBCOMP", 9, 0)]
    # Released: the same id is a new message now.
    assert session.receive_data(remote.publish("in/t", b"w", 2, 9)) == [Message("in/t", b"w", 2, False)]


@VERSIONS
def test_inbound_qos_0_and_1(version: int) -> None:
    session, remote = connected(version)
    events = session.receive_data(remote.publish("a", b"0", retain=True) + remote.publish("b", b"1", 1, 4))
    assert events == [Message("a", b"0", 0, True), Message("b", b"1", 1, False)]
    assert [shape(p) for p in remote.read(session)] == [("PUBACK", 4, 0)]


def only_messages(events: list[Event]) -> list[Message]:
    """``events``, every one a :class:`Message`."""
    assert all(isinstance(e, Message) for e in events), events
    return [e for e in events if isinstance(e, Message)]


@VERSIONS
def test_manual_ack_answers_only_when_told_and_once(version: int) -> None:
    session, remote = connected(version, manual_ack=True)
    wire = remote.publish("a", b"0") + remote.publish("b", b"1", 1, 4) + remote.publish("c", b"2", 2, 5)
    zero, one, two = only_messages(session.receive_data(wire))
    assert (zero.packet_id, one.packet_id, two.packet_id) == (0, 4, 5)
    assert remote.read(session) == []  # nothing answered yet
    # A resend of a message still waiting is neither delivered again nor answered.
    assert session.receive_data(remote.publish("b", b"1", 1, 4, dup=True)) == []
    assert session.receive_data(remote.publish("c", b"2", 2, 5, dup=True)) == []
    assert remote.read(session) == []
    assert session.acknowledge(zero) is False  # QoS 0: nothing to answer
    assert session.acknowledge(two) is True
    assert session.acknowledge(one) is True
    assert session.acknowledge(one) is False  # once
    assert [shape(p) for p in remote.read(session)] == [("PUBREC", 5, 0), ("PUBACK", 4, 0)]
    # A QoS 2 resend after its PUBREC: answered again, not delivered again.
    assert session.receive_data(remote.publish("c", b"2", 2, 5, dup=True)) == []
    assert [shape(p) for p in remote.read(session)] == [("PUBREC", 5, 0)]


@VERSIONS
def test_manual_ack_of_a_message_from_an_earlier_connection_answers_nothing(version: int) -> None:
    session, remote = connected(version, manual_ack=True)
    old1, old2 = only_messages(session.receive_data(remote.publish("b", b"1", 1, 4) + remote.publish("c", b"2", 2, 5)))
    session.connect()
    remote.reconnect()
    remote.read(session)
    session.receive_data(remote.connack(False))
    # The same ids, new messages: the stale acknowledgements must not answer them.
    new1, new2 = only_messages(session.receive_data(remote.publish("x", b"n", 1, 4) + remote.publish("y", b"m", 2, 5)))
    assert new2.topic == "y"  # the QoS 2 id is free again: delivered, not taken for a resend
    assert session.acknowledge(old1) is False and session.acknowledge(old2) is False
    assert remote.read(session) == []
    assert session.acknowledge(new1) and session.acknowledge(new2)
    assert [shape(p) for p in remote.read(session)] == [("PUBACK", 4, 0), ("PUBREC", 5, 0)]


def test_a_50_pubrel_for_an_unknown_id_is_answered_not_found() -> None:
    session, remote = connected(MQTT_50)
    session.receive_data(ack(v5.PUBREL, 3))
    assert [shape(p) for p in remote.read(session)] == [("PUBCOMP", 3, 0x92)]


def test_inbound_topic_aliases_are_resolved_within_our_maximum() -> None:
    session, remote = connected(MQTT_50, topic_alias_maximum=2)
    events = session.receive_data(
        remote.publish("long/topic", b"1", properties=Properties(topic_alias=2))
        + remote.publish("", b"2", properties=Properties(topic_alias=2, user_properties=(("k", "v"),)))
    )
    assert events == [
        Message("long/topic", b"1", 0, False),
        Message("long/topic", b"2", 0, False, Properties(user_properties=(("k", "v"),))),
    ]
    (violation,) = session.receive_data(remote.publish("x", b"", properties=Properties(topic_alias=3)))
    assert isinstance(violation, ProtocolViolation) and violation.reason_code == 0x94
    assert [shape(p) for p in remote.read(session)] == [("DISCONNECT",)]


def test_more_qos_2_messages_than_our_receive_maximum_is_a_violation() -> None:
    session, remote = connected(MQTT_50, receive_maximum=1)
    session.receive_data(remote.publish("t", b"", 2, 1))
    (violation,) = session.receive_data(remote.publish("t", b"", 2, 2))
    assert isinstance(violation, ProtocolViolation) and violation.reason_code == 0x93


# -- SUBSCRIBE, PING, DISCONNECT ------------------------------------------------------------


@VERSIONS
def test_subscribe_and_unsubscribe(version: int) -> None:
    session, remote = connected(version)
    sub = v5.Subscription("r/#", 2, no_local=True, retain_as_published=True, retain_handling=1)
    packet_id = session.subscribe([sub, ("s/+", 1)])
    (packet,) = remote.read(session)
    if version == MQTT_50:
        assert packet.subscriptions == (sub, v5.Subscription("s/+", 1))
    else:
        assert packet.topics == (("r/#", 2), ("s/+", 1))
    assert session.receive_data(remote.suback(packet_id, [2, 0x80])) == [Subscribed(packet_id, (2, 0x80))]
    gone = session.unsubscribe(["r/#"])
    assert shape(remote.read(session)[0]) == ("UNSUBSCRIBE",)
    unsuback = codec.pack(v5.Unsuback(gone, (0,))) if version == MQTT_50 else encoders.encode_unsuback(gone)
    assert session.receive_data(unsuback) == [Unsubscribed(gone, (0,) if version == MQTT_50 else ())]


@VERSIONS
def test_ping_and_a_clean_disconnect(version: int) -> None:
    session, remote = connected(version)
    session.ping()
    assert remote.read(session) == [v3.Pingreq()]
    assert session.receive_data(encoders.encode_pingresp()) == [Pong()]
    session.disconnect()
    assert session.bytes_to_send() == b"\xe0\x00" and session.state == CLOSED


def test_a_50_server_disconnect_is_reported() -> None:
    session, _ = connected(MQTT_50)
    props = Properties(reason_string="shutting down")
    assert session.receive_data(codec.pack(v5.Disconnect(0x8B, props))) == [Disconnected(0x8B, props)]
    assert session.state == CLOSED


@pytest.mark.parametrize(
    ("version", "wire", "reason"),
    [
        (MQTT_311, encoders.encode_connect("x"), "bad-packet-type"),  # a client's packet from the server
        (MQTT_311, encoders.encode_suback(77, [0]), "protocol-error"),  # a SUBACK nobody asked for
        (MQTT_311, b"\xe0\x00", "bad-packet-type"),  # DISCONNECT is not 3.1.1's from a server
        (MQTT_50, codec.pack(v5.Connack(False, 0)), "protocol-error"),  # a second CONNACK
        (MQTT_50, ack(v5.PUBACK, 1), "protocol-error"),  # a PUBACK for a QoS 2 message
        (MQTT_50, codec.pack(v5.Auth()), "protocol-error"),
    ],
)
def test_what_the_remote_gets_wrong_is_a_violation(version: int, wire: bytes, reason: str) -> None:
    session, remote = connected(version)
    session.publish("t", b"", qos=2)
    remote.read(session)
    events = session.receive_data(wire)
    assert [type(e) for e in events] == [ProtocolViolation] and events[0].reason == reason  # type: ignore[union-attr]
    assert session.state == CLOSED and session.receive_data(ack(v5.PUBREC, 1)) == []
    assert session.unfinished == [1]  # the message waits for the next connection


@VERSIONS
def test_a_packet_before_the_connack_and_one_too_large(version: int) -> None:
    session = ClientSession(ClientOptions("b", version, maximum_packet_size=32))
    session.connect()
    session.bytes_to_send()
    (early,) = session.receive_data(encoders.encode_pingresp())
    assert isinstance(early, ProtocolViolation) and early.reason == "protocol-error"
    session, remote = connected(version, maximum_packet_size=32)
    (large,) = session.receive_data(remote.publish("t", b"x" * 40))
    assert isinstance(large, ProtocolViolation) and large.reason == "packet-too-large"


def test_the_reader_takes_packets_split_anywhere() -> None:
    remote = Remote(MQTT_50)
    wire = remote.publish("split/topic", b"y" * 300, 1, 5) + ack(v5.PUBACK, 2) + b"\xd0\x00"
    reader = ServerPacketReader(True)
    got = [p for i in range(len(wire)) for p in reader.feed(wire[i : i + 1])]
    assert [shape(p) for p in got] == [("PUBLISH", 5, "split/topic", 1, False), ("PUBACK", 2, 0), ("PINGRESP",)]
    assert reader.buffered == 0


# -- across connections -------------------------------------------------------------------


@VERSIONS
def test_with_the_session_present_the_flight_goes_again_with_dup_and_pubrel(version: int) -> None:
    session, remote = connected(version, clean=False)
    t1, t2, t3 = (session.publish("r", b"%d" % q, qos=q) for q in (1, 2, 2))
    remote.read(session)
    session.receive_data(ack(v5.PUBREC, 2))
    session.connect()  # the connection dropped before anything else came back
    remote.reconnect()
    assert session.receive_data(remote.connack(True)) == [Connected(True, 0, EMPTY)]
    assert [shape(p) for p in remote.read(session)[1:]] == [
        ("PUBLISH", 1, "r", 1, True),
        ("PUBREL", 2, 0),
        ("PUBLISH", 3, "r", 2, True),
    ]
    done = session.receive_data(ack(v5.PUBACK, 1) + ack(v5.PUBCOMP, 2) + ack(v5.PUBREC, 3) + ack(v5.PUBCOMP, 3))
    assert done == [Acknowledged(t1), Acknowledged(t2), Acknowledged(t3)]


@VERSIONS
def test_without_a_session_the_flight_goes_again_as_new_messages(version: int) -> None:
    session, remote = connected(version, clean=False, window=2)
    tokens = [session.publish("r", b"%d" % i, qos=2) for i in range(3)]
    remote.read(session)
    session.receive_data(ack(v5.PUBREC, 1))
    session.receive_data(remote.publish("in", b"", 2, 40))  # the remote restarts before releasing it
    session.connect()
    remote.reconnect()
    session.receive_data(remote.connack(False))
    resent = [shape(p) for p in remote.read(session)[1:]]
    assert resent == [("PUBLISH", 3, "r", 2, False), ("PUBLISH", 4, "r", 2, False)]
    assert session.unfinished == tokens  # the third still queued behind the window
    assert session.receive_data(remote.publish("in", b"", 2, 40)) == [Message("in", b"", 2, False)]


# -- the model: every QoS 1/2 message acknowledged exactly once ---------------------------


class Acknowledgements(RuleBasedStateMachine):
    """A client and a remote that answers in any order, repeats itself, loses the
    connection and forgets its session; the model is a set of tokens."""

    version = MQTT_311

    def __init__(self) -> None:
        super().__init__()
        self.session = ClientSession(ClientOptions("m", self.version, clean=False, window=3))
        self.remote = Remote(self.version)
        self.published: set[int] = set()
        self.acked: list[int] = []
        self.owed: list[bytes] = []  # answers the remote has yet to send on this connection
        self.held: set[int] = set()  # QoS 2 ids the remote PUBRECed, awaiting PUBREL
        self.last = b""
        self.reconnect(present=False)

    def take(self, events: list[Event]) -> None:
        for event in events:
            assert not isinstance(event, ProtocolViolation), event
            if isinstance(event, Acknowledged):
                assert event.token in self.published and event.token not in self.acked
                self.acked.append(event.token)
        for packet in self.remote.read(self.session):
            name, packet_id = (*shape(packet), None)[:2]
            if name == "PUBLISH" and packet.qos == 1:
                self.owed.append(ack(v5.PUBACK, packet_id))
            elif name == "PUBLISH" and packet.qos == 2:
                self.held.add(packet_id)
                self.owed.append(ack(v5.PUBREC, packet_id))
            elif name == "PUBREL":
                self.held.discard(packet_id)
                self.owed.append(ack(v5.PUBCOMP, packet_id))
        assert self.session.in_flight <= 3

    @rule(qos=st.integers(0, 2))
    def publish(self, qos: int) -> None:
        token = self.session.publish("t", b"", qos=qos)
        if qos:
            self.published.add(token)
        self.take(self.session.pending_events())

    @precondition(lambda self: self.owed)
    @rule(pick=st.integers(0, 99))
    def answer(self, pick: int) -> None:
        self.last = self.owed.pop(pick % len(self.owed))
        self.take(self.session.receive_data(self.last))

    @precondition(lambda self: self.last)
    @rule()
    def repeat(self) -> None:
        self.take(self.session.receive_data(self.last))

    @rule(present=st.booleans())
    def reconnect(self, present: bool) -> None:
        self.owed.clear()
        if not present:
            self.held.clear()  # the remote restarted without its store
        self.session.connect()
        self.remote.reconnect()
        self.take(self.session.receive_data(self.remote.connack(present)))

    @invariant()
    def acknowledged_at_most_once(self) -> None:
        assert len(self.acked) == len(set(self.acked))
        assert set(self.acked) | set(self.session.unfinished) >= self.published

    def teardown(self) -> None:
        # A remote that answers everything at last: every message is then done, once.
        self.reconnect(present=True)
        for _ in range(1000):
            if not self.owed:
                break
            self.answer(0)
        assert sorted(self.acked) == sorted(self.published)


class Acknowledgements50(Acknowledgements):
    version = MQTT_50


TestAcknowledgements311 = Acknowledgements.TestCase
TestAcknowledgements50 = Acknowledgements50.TestCase
TestAcknowledgements311.settings = TestAcknowledgements50.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


@given(ids=st.lists(st.integers(1, 5), max_size=30), version=st.sampled_from([MQTT_311, MQTT_50]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_inbound_qos_2_is_delivered_once_per_release(ids: list[int], version: int) -> None:
    """Model: an id is delivered when it is not held; a PUBREL (here after every odd
    step) releases the oldest held one."""
    session, remote = connected(version)
    held: list[int] = []
    delivered = expected = 0
    for step, packet_id in enumerate(ids):
        events = session.receive_data(remote.publish("t", b"", 2, packet_id, dup=packet_id in held))
        delivered += len(events)
        if packet_id not in held:
            held.append(packet_id)
            expected += 1
        if step % 2 and held:
            session.receive_data(ack(v5.PUBREL, held.pop(0)))
    assert delivered == expected


# -- over real sockets ------------------------------------------------------------------


class Link:
    """A tiny trio driver: one socket, one session, events collected as they come."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self.stream: trio.SocketStream | None = None
        self.events: list[Event] = []

    async def open(self, port: int) -> Connected:
        self.stream = await trio.open_tcp_stream("127.0.0.1", port)
        self.session.connect()
        await self.flush()
        event = await self.until(lambda e: isinstance(e, (Connected, Refused)))
        assert isinstance(event, Connected), event
        return event

    async def flush(self) -> None:
        data = self.session.bytes_to_send()
        if data and self.stream is not None:
            await self.stream.send_all(data)

    async def until(self, want: Callable[[Event], bool]) -> Event:
        """Read until an event ``want`` accepts arrives (answering everything meanwhile)."""
        assert self.stream is not None
        with trio.fail_after(10):
            while True:
                for event in self.session.pending_events():
                    self.events.append(event)
                data = await self.stream.receive_some()
                assert data, "the remote closed the connection"
                new = self.session.receive_data(data)
                self.events.extend(new)
                await self.flush()
                for event in new:
                    assert not isinstance(event, ProtocolViolation), event
                    if want(event):
                        return event

    async def cut(self) -> None:
        """Drop the connection without a word, whatever was unread."""
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None

    def messages(self) -> list[tuple[str, bytes, int]]:
        return [(e.topic, e.payload, e.qos) for e in self.events if isinstance(e, Message)]

    def acknowledged(self) -> set[int]:
        return {e.token for e in self.events if isinstance(e, Acknowledged)}


async def exchange(version: int, port: int, restart: Callable[[], Any]) -> None:
    """Connect, subscribe, QoS 0/1/2 both ways, a resend with the session present, and a
    resend after the remote restarted (``restart`` returns the port it listens on next)."""
    expiry = 300 if version == MQTT_50 else None
    sub = Link(ClientSession(ClientOptions(f"sub-{version}", version)))
    pub = Link(ClientSession(ClientOptions(f"pub-{version}", version, clean=False, session_expiry=expiry)))
    await sub.open(port)
    packet_id = sub.session.subscribe([("bridge/#", 2)])
    await sub.flush()
    assert await sub.until(lambda e: isinstance(e, Subscribed)) == Subscribed(packet_id, (2,))
    assert (await pub.open(port)).session_present is False
    tokens = {pub.session.publish("bridge/a", b"q%d" % q, qos=q) for q in (1, 2)}
    pub.session.publish("bridge/a", b"q0", qos=0)
    await pub.flush()
    while not tokens <= pub.acknowledged():
        await pub.until(lambda e: isinstance(e, Acknowledged))
    while len(sub.messages()) < 3:
        await sub.until(lambda e: isinstance(e, Message))
    assert sorted(sub.messages()) == [("bridge/a", b"q%d" % q, q) for q in (0, 1, 2)]

    # The connection drops with both messages unanswered: they go again, DUP, at once.
    resent = {pub.session.publish("bridge/b", b"b%d" % q, qos=q) for q in (1, 2)}
    await pub.flush()
    await pub.cut()
    assert (await pub.open(port)).session_present is True
    while not resent <= pub.acknowledged():
        await pub.until(lambda e: isinstance(e, Acknowledged))
    while not {(b"b1", 1), (b"b2", 2)} <= {(p, q) for _, p, q in sub.messages()}:
        await sub.until(lambda e: isinstance(e, Message))
    with trio.move_on_after(0.3):  # a second copy of the QoS 2 message would come now
        await sub.until(lambda e: False)
    assert [m for m in sub.messages() if m[1] == b"b2"] == [("bridge/b", b"b2", 2)]

    # The remote restarts without its store, with two messages in flight and one queued.
    survivors = {pub.session.publish("bridge/c", b"c%d" % q, qos=q) for q in (1, 2)}
    await pub.flush()
    await pub.cut()
    await sub.cut()
    port = await restart()
    survivors.add(pub.session.publish("bridge/c", b"c3", qos=1))
    await sub.open(port)
    sub.session.subscribe([("bridge/#", 2)])
    await sub.flush()
    await sub.until(lambda e: isinstance(e, Subscribed))
    assert (await pub.open(port)).session_present is False
    while not survivors <= pub.acknowledged():
        await pub.until(lambda e: isinstance(e, Acknowledged))
    while not {b"c1", b"c2", b"c3"} <= {p for _, p, _ in sub.messages()}:
        await sub.until(lambda e: isinstance(e, Message))
    assert pub.session.unfinished == []
    assert sorted(e.token for e in pub.events if isinstance(e, Acknowledged)) == sorted(pub.acknowledged())
    await pub.cut()
    await sub.cut()


MOSQUITTO_CONF = """\
{user}listener {port} 127.0.0.1
allow_anonymous true
persistence false
"""


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[tuple[int, Callable[[], int]]]:
    """Mosquitto on a free loopback port: the port, and a call that restarts it (the same
    port, no store) and returns the port."""
    binary = require_mosquitto()
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    # Run as root, Mosquitto would drop to the "mosquitto" user; keep it as it is.
    user = "user root\n" if os.geteuid() == 0 else ""
    conf.write_text(MOSQUITTO_CONF.format(user=user, port=port))
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> int:
        if procs:
            stop(procs[-1])
        proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        wait_listening(port, proc)
        return port

    start()
    try:
        yield port, start
    finally:
        stop(procs[-1])


@VERSIONS
async def test_over_a_socket_against_mosquitto(version: int, mosquitto: tuple[int, Callable[[], int]]) -> None:
    port, start = mosquitto

    async def restart() -> int:
        return await trio.to_thread.run_sync(start)

    await exchange(version, port, restart)


@VERSIONS
async def test_over_a_socket_against_this_server(version: int) -> None:
    async with ServerInProcess() as server:
        await exchange(version, await server.start(), server.start)


class ServerInProcess:
    """This server in-process; :meth:`start` stops the running one (its sessions with it)
    and starts a fresh one, returning its port."""

    def __init__(self) -> None:
        self._current: Any = None

    async def start(self) -> int:
        await self.aclose()
        self._current = running()
        server, _ = await self._current.__aenter__()
        return int(server.port)

    async def aclose(self) -> None:
        if self._current is not None:
            current, self._current = self._current, None
            await current.__aexit__(None, None, None)

    async def __aenter__(self) -> ServerInProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
