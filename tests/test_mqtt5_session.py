"""The MQTT 5.0 session, sans-IO (issue 28): what a 5.0 client is told in CONNACK, how
its packets are answered with reason codes, and what reaches subscribers. Packets in
are built with the v5 codec's values; what the session sends is read back with it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servers.heartbeat.broker.outbox import Message, Outbox
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.effects import (
    Accept,
    Acknowledged,
    AddSubscription,
    Denied,
    Goodbye,
    HoldInbound,
    RemoveSubscription,
    Send,
    SubscriptionRefused,
)
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.filters import pack_options
from servers.heartbeat.mqtt.packets import Pingreq, ProtocolError
from servers.heartbeat.mqtt.policy import SessionPolicy
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.mqtt.reader import PacketReader
from servers.heartbeat.mqtt.session import State
from servers.heartbeat.mqtt.v5 import outbound
from servers.heartbeat.mqtt.v5.codec import pack, read_packets
from servers.heartbeat.mqtt.v5.packets import (
    PUBACK,
    PUBREL,
    Ack,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Publish,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
)
from servers.heartbeat.mqtt.v5.packets import Suback as Suback5
from servers.heartbeat.mqtt.v5.properties import Properties
from servers.heartbeat.mqtt.v5.reason_codes import PacketError, ReasonCode
from servers.heartbeat.mqtt.v5.session import Session5, code_for

R = ReasonCode


class Rules:
    """Access rules that refuse what starts with ``no/``."""

    def may_subscribe(self, topic_filter: str) -> bool:
        return not topic_filter.startswith("no/")

    def may_publish(self, topic: str) -> bool:
        return not topic.startswith("no/")

    def may_read(self, topic: str) -> bool:
        return True


def sent(effects: Sequence[object]) -> list[object]:
    """The packets the session sent, read back as 5.0 values."""
    return [p for e in effects if isinstance(e, Send) for p in read_packets(e.data)]


def connected(policy: SessionPolicy | None = None, **connect: object) -> tuple[Session5, Connack]:
    session = Session5(policy or SessionPolicy())
    fields: dict[str, object] = {"client_id": "dev", "keep_alive": 30}
    fields.update(connect)
    (accept,) = session.receive(Connect(**fields))  # type: ignore[arg-type]
    assert isinstance(accept, Accept)
    (connack,) = read_packets(session.accepted())
    assert isinstance(connack, Connack)
    return session, connack


def test_connack_tells_the_servers_limits_and_nothing_a_client_did_not_need() -> None:
    policy = SessionPolicy(max_keepalive=60, receive_maximum=7, max_packet_size=4096, topic_alias_maximum=3)
    session, connack = connected(policy, keep_alive=30)
    props = connack.properties
    assert connack.reason_code == 0 and not connack.session_present
    assert props.receive_maximum == 7 and props.maximum_packet_size == 4096 and props.topic_alias_maximum == 3
    assert props.subscription_identifier_available is None and props.shared_subscription_available is None
    # Its own keep-alive was kept, its id was its own, it asked for no lasting session: not told.
    assert props.server_keep_alive is None and props.assigned_client_identifier is None
    assert props.session_expiry_interval is None and props.maximum_qos is None
    assert session.keep_alive == 30 and session.state is State.CONNECTED


@pytest.mark.parametrize(("asked", "told"), [(0, 60), (61, 60), (65535, 60), (60, None), (1, None)])
def test_server_keep_alive_for_a_client_asking_more_or_none(asked: int, told: int | None) -> None:
    session, connack = connected(SessionPolicy(max_keepalive=60), keep_alive=asked)
    assert connack.properties.server_keep_alive == told
    assert session.keep_alive == (told or asked)


def test_an_empty_id_is_assigned_and_told_with_either_clean_start() -> None:
    for clean_start in (True, False):
        session, connack = connected(client_id="", clean_start=clean_start)
        assigned = connack.properties.assigned_client_identifier
        assert assigned is not None and assigned == session.client_id and session.assigned


def test_session_expiry_is_the_clients_within_the_servers_cap() -> None:
    # §3.1.2.11.2: the client's interval, which the server may cut (and then says so, §3.2.2.3.2).
    policy = SessionPolicy(session_expiry=3600)
    session = Session5(policy)
    (accept,) = session.receive(Connect("p", 30, clean_start=True, properties=Properties(session_expiry_interval=10)))
    assert isinstance(accept, Accept)
    assert not accept.clean_session and accept.fresh  # a new lasting session: any stored one goes
    assert accept.expiry == 10 == session.session_expiry
    (connack,) = read_packets(session.accepted())
    assert isinstance(connack, Connack) and connack.properties.session_expiry_interval is None  # kept: not told
    for asked in (3601, 0xFFFFFFFF):  # more than the cap, and "never expires"
        capped = Session5(policy)
        (accept,) = capped.receive(
            Connect("p", 30, clean_start=False, properties=Properties(session_expiry_interval=asked))
        )
        assert isinstance(accept, Accept) and not accept.clean_session and not accept.fresh
        assert accept.expiry == 3600
        (connack,) = read_packets(capped.accepted(session_present=True))
        assert isinstance(connack, Connack) and connack.session_present
        assert connack.properties.session_expiry_interval == 3600  # cut: told
    clean = Session5(policy)
    (accept,) = clean.receive(Connect("c", 30))
    assert isinstance(accept, Accept) and accept.clean_session and accept.expiry == 0


def test_clean_start_0_without_an_expiry_asks_for_the_stored_session() -> None:
    # §3.1.2.4: Clean Start 0 resumes a stored session; the absent expiry (0) only says it
    # ends with this connection. So the server must look (clean_session False), and make none.
    session = Session5(SessionPolicy())
    (accept,) = session.receive(Connect("p", 30, clean_start=False))
    assert isinstance(accept, Accept)
    assert not accept.clean_session and not accept.fresh and accept.expiry == 0


@pytest.mark.parametrize(
    ("connect", "code"),
    [
        (Connect("a+b", 30), R.CLIENT_IDENTIFIER_NOT_VALID),
        (Connect("a\x1bb", 30), R.CLIENT_IDENTIFIER_NOT_VALID),
        (Connect("x" * 300, 30), R.CLIENT_IDENTIFIER_NOT_VALID),
        (Connect("a", 30, username="u" * 2000), R.BAD_USER_NAME_OR_PASSWORD),
        (Connect("a", 30, properties=Properties(authentication_method="SCRAM-SHA-1")), R.BAD_AUTHENTICATION_METHOD),
        (Connect("a", 30, will=Will("w/#", b"x")), R.TOPIC_NAME_INVALID),
    ],
)
def test_a_refused_connect_gets_a_5_0_connack_with_the_reason(connect: Connect, code: ReasonCode) -> None:
    session = Session5(SessionPolicy())
    with pytest.raises(PacketError) as info:
        session.receive(connect)
    assert info.value.code == code
    (connack,) = read_packets(session.violated(info.value) or b"")
    assert connack == Connack(False, code)
    assert session.state is State.CLOSED and session.reason_code == code


@pytest.mark.parametrize(("old", "new"), [(1, 0x84), (2, 0x85), (3, 0x88), (4, 0x86), (5, 0x87), (0x9F, 0x9F)])
def test_the_servers_refusals_are_told_in_5_0s_codes(old: int, new: int) -> None:
    session = Session5(SessionPolicy())
    session.receive(Connect("a", 30))
    assert read_packets(session.refused(old)) == [Connack(False, new)]


def test_publish_properties_reach_subscribers_and_topic_aliases_do_not() -> None:
    session, _ = connected(SessionPolicy(topic_alias_maximum=2))
    props = Properties(
        payload_format_indicator=1,
        message_expiry_interval=60,
        content_type="text/plain",
        response_topic="reply/dev",
        correlation_data=b"\x01\x02",
        user_properties=(("b", "2"), ("a", "1"), ("b", "3")),
        topic_alias=1,
    )
    (route,) = session.receive(Publish("data/t", b"hi", properties=props))
    assert isinstance(route, Publication) and route.topic == "data/t"
    body = outbound.publish(route.topic, route.payload, properties=route.properties)
    (delivered,) = read_packets(body)
    assert isinstance(delivered, Publish)
    assert delivered.properties == props.replace(topic_alias=None)  # order of user properties kept
    # The alias now stands for the topic.
    (again,) = session.receive(Publish("", b"again", properties=Properties(topic_alias=1)))
    assert isinstance(again, Publication) and again.topic == "data/t" and again.properties == b""


@pytest.mark.parametrize(
    ("publish", "code"),
    [
        (Publish("t", b"", properties=Properties(topic_alias=3)), R.TOPIC_ALIAS_INVALID),
        (Publish("", b"", properties=Properties(topic_alias=2)), R.PROTOCOL_ERROR),
        (Publish("t", b"", properties=Properties(subscription_identifiers=(4,))), R.PROTOCOL_ERROR),
        (Publish("t\x7f", b""), R.TOPIC_NAME_INVALID),
        (Publish("t", b"", qos=2, packet_id=1), R.QOS_NOT_SUPPORTED),
    ],
)
def test_a_bad_publish_is_a_violation_with_its_reason_code(publish: Publish, code: ReasonCode) -> None:
    session, _ = connected(SessionPolicy(topic_alias_maximum=2, max_qos=1))
    with pytest.raises(PacketError) as info:
        session.receive(publish)
    assert info.value.code == code
    (goodbye,) = read_packets(session.violated(info.value) or b"")
    assert isinstance(goodbye, Disconnect) and goodbye.reason_code == code
    assert goodbye.properties.reason_string  # the client asked for problem information (default)
    assert session.reason_code == code and session.state is State.CLOSED


def test_no_reason_string_for_a_client_that_asked_for_none() -> None:
    session, _ = connected(properties=Properties(request_problem_information=0))
    with pytest.raises(ProtocolError) as info:
        session.receive(Publish("", b"", properties=Properties(topic_alias=1)))
    assert read_packets(session.violated(info.value) or b"") == [Disconnect(R.PROTOCOL_ERROR)]


def test_a_refused_publish_is_told_not_authorized_and_dropped() -> None:
    session, _ = connected()
    session.permissions = Rules()
    for topic in ("$SYS/presence/other", "no/way"):
        effects = session.receive(Publish(topic, b"forged", qos=1, packet_id=9))
        assert Denied(topic) in effects and not any(isinstance(e, Publication) for e in effects)
        assert sent(effects) == [Ack(PUBACK, 9, R.NOT_AUTHORIZED)]
    effects = session.receive(Publish("no/way", b"x", qos=2, packet_id=10))
    assert not any(isinstance(e, HoldInbound) for e in effects)  # a failed PUBREC ends the exchange
    assert session.receive(Publish("no/way", b"x")) == [Denied("no/way")]
    assert session.denied_publishes == 4


def test_a_payload_that_is_not_the_utf_8_it_claims_is_refused() -> None:
    session, _ = connected()
    effects = session.receive(
        Publish("t", b"\xff", qos=1, packet_id=3, properties=Properties(payload_format_indicator=1))
    )
    assert sent(effects) == [Ack(PUBACK, 3, R.PAYLOAD_FORMAT_INVALID)]
    assert not any(isinstance(e, Publication) for e in effects)


def test_qos_2_past_the_receive_maximum_is_disconnect_0x93() -> None:
    session, _ = connected(SessionPolicy(receive_maximum=2))
    for packet_id in (1, 2):
        assert HoldInbound(packet_id) in session.receive(Publish("t", b"", qos=2, packet_id=packet_id))
    assert sent(session.receive(Publish("t", b"", qos=2, packet_id=2, dup=True))) == [Ack(5, 2)]  # a resend
    with pytest.raises(PacketError) as info:
        session.receive(Publish("t", b"", qos=2, packet_id=3))
    assert info.value.code == R.RECEIVE_MAXIMUM_EXCEEDED
    _, pubcomp = session.receive(Ack(PUBREL, 1))
    assert isinstance(pubcomp, Send) and pubcomp.data == encoders.encode_pubcomp(1)


def test_acknowledgements_with_reason_codes_reach_the_outbox() -> None:
    session, _ = connected()
    assert session.receive(Ack(PUBACK, 5, R.NO_MATCHING_SUBSCRIBERS)) == [Acknowledged("puback", 5)]
    assert session.receive(Ack(5, 6)) == [Acknowledged("pubrec", 6)]
    assert session.receive(Ack(7, 6)) == [Acknowledged("pubcomp", 6)]
    assert session.receive(Pingreq()) == [Send(b"\xd0\x00")]


def test_suback_says_why_per_filter() -> None:
    held = {"dev": ({"old/#"}, 5)}
    policy = SessionPolicy(max_subscriptions=4, held=lambda client_id: held[client_id])
    session, _ = connected(policy)
    session.permissions = Rules()
    effects = session.receive(
        Subscribe(
            4,
            (
                Subscription("a/#", 1),
                Subscription("no/x", 1),
                Subscription("$share/g/a", 0),
                Subscription("$share/g/no/x", 0),  # judged by what it reads, whatever the group
                Subscription("$share/nofilter", 0),
                Subscription("old/#", 2, retain_handling=1),
                Subscription("b", 2, retain_handling=2),
                Subscription("c", 0),
            ),
        )
    )
    codes = (1, R.NOT_AUTHORIZED, 0, R.NOT_AUTHORIZED, R.TOPIC_FILTER_INVALID, 2, 2, R.QUOTA_EXCEEDED)
    assert sent(effects) == [Suback5(4, codes)]
    adds = [e for e in effects if isinstance(e, AddSubscription)]
    assert adds == [
        AddSubscription("a/#", 1),
        AddSubscription("$share/g/a", 0),  # a shared subscription counts like any filter
        AddSubscription("old/#", 2, retained=False),  # Retain Handling 1, held already: none
        AddSubscription("b", 2, retained=False),  # Retain Handling 2: never
    ]
    assert SubscriptionRefused("c") in effects


def test_no_local_on_a_shared_subscription_is_a_protocol_error() -> None:
    session, _ = connected()
    with pytest.raises(PacketError) as info:
        session.receive(Subscribe(1, (Subscription("$share/g/a", 0, no_local=True),)))
    assert info.value.code == R.PROTOCOL_ERROR


def test_subscription_options_travel_with_the_subscription() -> None:
    session, connack = connected()
    assert connack.properties.subscription_identifier_available is None  # available: not said
    effects = session.receive(
        Subscribe(
            1,
            (Subscription("a/#", 1, no_local=True), Subscription("b", 0, retain_as_published=True)),
            Properties(subscription_identifiers=(300,)),
        )
    )
    adds = [e for e in effects if isinstance(e, AddSubscription)]
    assert [a.options for a in adds] == [pack_options(True, False, 300), pack_options(False, True, 300)]
    plain = session.receive(Subscribe(2, (Subscription("c", 0),)))
    assert [e.options for e in plain if isinstance(e, AddSubscription)] == [0]


def test_a_malformed_filter_is_disconnect_0x81() -> None:
    session, _ = connected()
    with pytest.raises(ProtocolError) as info:
        session.receive(Subscribe(1, (Subscription("a/#/b"),)))
    assert code_for(info.value) == R.MALFORMED_PACKET


def test_unsuback_says_which_filters_were_held() -> None:
    session, _ = connected(SessionPolicy(held=lambda client_id: ({"a"}, 1)))
    effects = session.receive(Unsubscribe(2, ("a", "b")))
    assert RemoveSubscription("a") in effects and RemoveSubscription("b") in effects
    assert sent(effects) == [Unsuback(2, (0, R.NO_SUBSCRIPTION_EXISTED))]


def test_disconnect_with_will_keeps_the_will_and_its_properties() -> None:
    will = Will("wills/dev", b"gone", 1, False, Properties(will_delay_interval=5, content_type="text/plain"))
    session, _ = connected(will=will, properties=Properties(session_expiry_interval=60))
    assert session.will is not None and session.will.delay == 5
    assert session.receive(Disconnect(R.DISCONNECT_WITH_WILL)) == [Goodbye()]
    assert session.will is not None and session.reason_code == 4
    (delivered,) = read_packets(outbound.publish("w", b"", properties=session.will.properties))
    assert isinstance(delivered, Publish) and delivered.properties == Properties(content_type="text/plain")
    plain, _ = connected(will=will)
    plain.receive(Disconnect())
    assert plain.will is None and plain.reason_code == 0


def test_a_will_waits_at_most_as_long_as_its_session_lasts() -> None:
    will = Will("wills/dev", b"gone", 0, False, Properties(will_delay_interval=30))
    brief, _ = connected(will=will)  # Session Expiry 0: the session ends with the connection
    assert brief.will is not None and brief.will.delay == 0
    # §3.1.3.2.2: the Will goes at its delay or the session's end, whichever is first: the
    # session's own expiry (5), not the server's cap (10), nor the delay (30).
    lasting, _ = connected(
        SessionPolicy(session_expiry=10), will=will, properties=Properties(session_expiry_interval=5)
    )
    assert lasting.will is not None and lasting.will.delay == 5
    lasting.receive(Disconnect(R.DISCONNECT_WITH_WILL, Properties(session_expiry_interval=0)))
    assert lasting.will is not None and lasting.will.delay == 0 and lasting.session_expiry == 0
    # A DISCONNECT that shortens the session shortens the Will's wait, one that lengthens
    # it gives the Will its own delay back; one that sets no expiry leaves both.
    shortened, _ = connected(will=will, properties=Properties(session_expiry_interval=20))
    assert shortened.will is not None and shortened.will.delay == 20
    shortened.receive(Disconnect(R.DISCONNECT_WITH_WILL, Properties(session_expiry_interval=3)))
    assert shortened.will is not None and shortened.will.delay == 3 and shortened.session_expiry == 3
    longer, _ = connected(will=will, properties=Properties(session_expiry_interval=2))
    assert longer.will is not None and longer.will.delay == 2
    longer.receive(Disconnect(R.DISCONNECT_WITH_WILL, Properties(session_expiry_interval=600)))
    assert longer.will is not None and longer.will.delay == 30
    kept, _ = connected(will=will, properties=Properties(session_expiry_interval=20))
    kept.receive(Disconnect(R.DISCONNECT_WITH_WILL))
    assert kept.will is not None and kept.will.delay == 20 and kept.session_expiry == 20


def test_a_session_that_ends_with_its_connection_cannot_be_kept_at_disconnect() -> None:
    session, _ = connected()
    with pytest.raises(PacketError) as info:
        session.receive(Disconnect(properties=Properties(session_expiry_interval=60)))
    assert info.value.code == R.PROTOCOL_ERROR


def test_packet_order_violations() -> None:
    with pytest.raises(PacketError):
        Session5(SessionPolicy()).receive(Pingreq())
    session, _ = connected()
    for packet in (Connect("again", 30), Auth()):
        with pytest.raises(PacketError) as info:
            session.receive(packet)
        assert info.value.code == R.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        (Offline.KEEPALIVE_TIMEOUT, 0x8D),
        (Offline.TAKEOVER, 0x8E),
        (Offline.SHUTDOWN, 0x8B),
        (Offline.SEND_OVERFLOW, 0x97),
        (Offline.SEND_TIMEOUT, None),
    ],
)
def test_the_server_says_why_it_ends_a_connection(reason: Offline, code: int | None) -> None:
    session, _ = connected()
    farewell = session.goodbye(reason)
    if code is None:
        assert farewell is None and session.reason_code is None
    else:
        assert read_packets(farewell or b"") == [Disconnect(code)] and session.reason_code == code
    assert Session5(SessionPolicy()).goodbye(reason) is None  # before CONNACK: never a DISCONNECT


def test_reader_turns_to_5_0_after_a_5_0_connect_in_the_same_read() -> None:
    wire = pack(Connect("r", 30)) + pack(Publish("t", b"x", properties=Properties(content_type="a"))) + b"\xc0\x00"
    wire += pack(Ack(PUBACK, 3, R.NO_MATCHING_SUBSCRIBERS)) + pack(Disconnect(4)) + pack(Auth(0x19))
    for chunk in (len(wire), 1, 3):
        reader = PacketReader()
        out = []
        for i in range(0, len(wire), chunk):
            out += reader.feed(wire[i : i + chunk])
        assert reader.v5
        assert out == [
            Connect("r", 30),
            Publish("t", b"x", properties=Properties(content_type="a")),
            Pingreq(),
            Ack(PUBACK, 3, R.NO_MATCHING_SUBSCRIBERS),
            Disconnect(4),
            Auth(0x19),
        ]


def test_a_5_0_reader_refuses_a_remaining_length_longer_than_it_needs() -> None:
    reader = PacketReader()
    assert reader.feed(pack(Connect("r", 30))) == [Connect("r", 30)]
    with pytest.raises(ProtocolError) as info:
        reader.feed(b"\xc0\x80\x00")  # PINGREQ's length 0 in two bytes (MQTT-1.5.5-1)
    assert code_for(info.value) == R.MALFORMED_PACKET


def test_a_malformed_5_0_connect_is_a_packet_error() -> None:
    broken = encoders.encode_connect("x", protocol_level=5)  # 3.1.1's layout: no property length
    with pytest.raises(PacketError) as info:
        PacketReader().feed(broken)
    assert info.value.code in (R.MALFORMED_PACKET, R.PROTOCOL_ERROR)


@given(
    topic=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40).filter(
        lambda t: "+" not in t and "#" not in t
    ),
    payload=st.binary(max_size=300),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    dup=st.booleans(),
    packet_id=st.integers(1, 65535),
)
def test_a_stored_3_1_1_publish_reads_the_same_as_5_0(
    topic: str, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int
) -> None:
    old = encoders.encode_publish(topic, payload, qos, retain, packet_id if qos else None, dup and qos > 0)
    (new,) = read_packets(outbound.from_v311(old))
    assert new == Publish(topic, payload, qos, retain, dup and qos > 0, packet_id if qos else None)
    assert outbound.from_v311(encoders.encode_pubrel(packet_id)) == encoders.encode_pubrel(packet_id)


def test_a_queued_message_counts_its_expiry_down_and_is_dropped_once_it_runs_out() -> None:
    """§3.3.2.3.3: the lifetime left is what the subscriber is told, and a message not
    yet sent when it runs out is deleted, not delivered late."""
    now = [100.0]
    box = Outbox(window=1, clock=lambda: now[0])
    lasting = outbound.forwarded(Properties(payload_format_indicator=1, message_expiry_interval=10))
    brief = outbound.forwarded(Properties(message_expiry_interval=2, content_type="c"))
    (first,) = box.push(Message("t", b"1", 1, properties=lasting))  # sent at once: 10 s told
    assert read_packets(first)[0].properties.message_expiry_interval == 10  # type: ignore[union-attr]
    assert box.push(Message("t", b"2", 1, properties=brief)) == []  # queued behind the window
    assert box.push(Message("t", b"3", 1, properties=lasting)) == []
    assert box.push(Message("t", b"4", 1, properties=b"")) == []  # no expiry: never dropped
    now[0] += 3.5  # the brief one has run out while queued; the others have 6.5 s left
    (third,) = box.puback(1)
    (sent,) = read_packets(third)
    assert isinstance(sent, Publish) and sent.payload == b"3"
    assert sent.properties.message_expiry_interval == 7 and sent.properties.payload_format_indicator == 1
    assert box.expired == 1
    (fourth,) = box.puback(sent.packet_id or 0)
    assert read_packets(fourth)[0].properties.message_expiry_interval is None  # type: ignore[union-attr]


def test_counted_down_properties() -> None:
    props = outbound.forwarded(Properties(message_expiry_interval=5, user_properties=(("a", "b"),)))
    assert outbound.message_expiry(props) == 5
    lowered = outbound.counted_down(props, 2.9) or b""
    assert outbound.message_expiry(lowered) == 3
    assert outbound.counted_down(props, 5.0) is None
    plain = outbound.forwarded(Properties(content_type="x"))
    assert outbound.message_expiry(plain) is None and outbound.counted_down(plain, 99) == plain
