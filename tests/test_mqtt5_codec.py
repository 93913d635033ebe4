"""The MQTT 5.0 codec (issue 28, item 1): every property and packet round-trips, the
encoding agrees with paho-mqtt's byte for byte, a real paho CONNECT reads back, and
every malformed or misplaced input gets its reason code, never a traceback."""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as _PahoProperties
from paho.mqtt.subscribeoptions import SubscribeOptions

from servers.heartbeat.mqtt.v5 import outbound
from servers.heartbeat.mqtt.v5 import packets as p
from servers.heartbeat.mqtt.v5.codec import pack, read_packet, read_packets
from servers.heartbeat.mqtt.v5.properties import (
    EMPTY,
    Carrier,
    Properties,
    field_ident,
    pack_properties,
    read_properties,
)
from servers.heartbeat.mqtt.v5.reason_codes import PacketError, ReasonCode
from servers.heartbeat.mqtt.v5.wire import read_varint

from .test_mqtt_encoders import publish_by_the_spec, varint_by_the_spec

# paho's Properties has no type hints: called through Any.
PahoProperties: Any = _PahoProperties

# -- strategies ---------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=20)
BINARY = st.binary(max_size=20)
BIT = st.integers(0, 1)
U8 = st.integers(0, 255)
U16 = st.integers(0, 0xFFFF)
U32 = st.integers(0, 0xFFFF_FFFF)
SUB_ID = st.integers(1, 268_435_455)

_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "payload_format_indicator": BIT,
    "message_expiry_interval": U32,
    "content_type": TEXT,
    "response_topic": TEXT,
    "correlation_data": BINARY,
    "session_expiry_interval": U32,
    "assigned_client_identifier": TEXT,
    "server_keep_alive": U16,
    "authentication_method": TEXT,
    "authentication_data": BINARY,
    "request_problem_information": BIT,
    "will_delay_interval": U32,
    "request_response_information": BIT,
    "response_information": TEXT,
    "server_reference": TEXT,
    "reason_string": TEXT,
    "receive_maximum": st.integers(1, 0xFFFF),
    "topic_alias_maximum": U16,
    "topic_alias": st.integers(1, 0xFFFF),
    "maximum_qos": BIT,
    "retain_available": BIT,
    "maximum_packet_size": st.integers(1, 268_435_455),  # paho refuses larger, as no packet can be
    "wildcard_subscription_available": BIT,
    "subscription_identifier_available": BIT,
    "shared_subscription_available": BIT,
}
# Which carriers each field may appear in, from the spec's table (§2.2.2.2), written out
# again here rather than read from the module under test.
_C = Carrier
_CARRIERS: dict[str, set[Carrier]] = {
    "payload_format_indicator": {_C.PUBLISH, _C.WILL},
    "message_expiry_interval": {_C.PUBLISH, _C.WILL},
    "content_type": {_C.PUBLISH, _C.WILL},
    "response_topic": {_C.PUBLISH, _C.WILL},
    "correlation_data": {_C.PUBLISH, _C.WILL},
    "subscription_identifiers": {_C.PUBLISH, _C.SUBSCRIBE},
    "session_expiry_interval": {_C.CONNECT, _C.CONNACK, _C.DISCONNECT},
    "assigned_client_identifier": {_C.CONNACK},
    "server_keep_alive": {_C.CONNACK},
    "authentication_method": {_C.CONNECT, _C.CONNACK, _C.AUTH},
    "authentication_data": {_C.CONNECT, _C.CONNACK, _C.AUTH},
    "request_problem_information": {_C.CONNECT},
    "will_delay_interval": {_C.WILL},
    "request_response_information": {_C.CONNECT},
    "response_information": {_C.CONNACK},
    "server_reference": {_C.CONNACK, _C.DISCONNECT},
    "reason_string": {
        _C.CONNACK,
        _C.PUBACK,
        _C.PUBREC,
        _C.PUBREL,
        _C.PUBCOMP,
        _C.SUBACK,
        _C.UNSUBACK,
        _C.DISCONNECT,
        _C.AUTH,
    },
    "receive_maximum": {_C.CONNECT, _C.CONNACK},
    "topic_alias_maximum": {_C.CONNECT, _C.CONNACK},
    "topic_alias": {_C.PUBLISH},
    "maximum_qos": {_C.CONNACK},
    "retain_available": {_C.CONNACK},
    "user_properties": set(Carrier),
    "maximum_packet_size": {_C.CONNECT, _C.CONNACK},
    "wildcard_subscription_available": {_C.CONNACK},
    "subscription_identifier_available": {_C.CONNACK},
    "shared_subscription_available": {_C.CONNACK},
}


@st.composite
def properties_for(draw: st.DrawFn, carrier: Carrier) -> Properties:
    fields: dict[str, Any] = {}
    for name, strategy in _VALUES.items():
        if carrier in _CARRIERS[name] and draw(st.booleans()):
            fields[name] = draw(strategy)
    if carrier in _CARRIERS["subscription_identifiers"]:
        most = 3 if carrier is Carrier.PUBLISH else 1
        fields["subscription_identifiers"] = tuple(draw(st.lists(SUB_ID, max_size=most)))
    fields["user_properties"] = tuple(draw(st.lists(st.tuples(TEXT, TEXT), max_size=4)))
    if carrier is Carrier.CONNECT and "authentication_data" in fields:
        fields.setdefault("authentication_method", "SCRAM")
    return Properties(**fields)


# -- properties -----------------------------------------------------------------------------


def test_every_field_is_in_the_table_of_carriers() -> None:
    assert set(_CARRIERS) == {f.name for f in dataclasses.fields(Properties)}


@settings(max_examples=300)
@given(data=st.data(), carrier=st.sampled_from(list(Carrier)))
def test_every_property_round_trips_in_every_carrier(data: st.DataObject, carrier: Carrier) -> None:
    props = data.draw(properties_for(carrier))
    wire = pack_properties(props, carrier)
    back, pos = read_properties(wire, 0, len(wire), carrier)
    assert back == props and pos == len(wire)


_PAHO_TYPE = {
    Carrier.CONNECT: PacketTypes.CONNECT,
    Carrier.WILL: PacketTypes.WILLMESSAGE,
    Carrier.CONNACK: PacketTypes.CONNACK,
    Carrier.PUBLISH: PacketTypes.PUBLISH,
    Carrier.PUBACK: PacketTypes.PUBACK,
    Carrier.PUBREC: PacketTypes.PUBREC,
    Carrier.PUBREL: PacketTypes.PUBREL,
    Carrier.PUBCOMP: PacketTypes.PUBCOMP,
    Carrier.SUBSCRIBE: PacketTypes.SUBSCRIBE,
    Carrier.SUBACK: PacketTypes.SUBACK,
    Carrier.UNSUBSCRIBE: PacketTypes.UNSUBSCRIBE,
    Carrier.UNSUBACK: PacketTypes.UNSUBACK,
    Carrier.DISCONNECT: PacketTypes.DISCONNECT,
    Carrier.AUTH: PacketTypes.AUTH,
}
_PAHO_NAME = {"subscription_identifiers": "SubscriptionIdentifier", "user_properties": "UserProperty"}


def _paho_name(field: str) -> str:
    if field in _PAHO_NAME:
        return _PAHO_NAME[field]
    return "".join("QoS" if w == "qos" else w.capitalize() for w in field.split("_"))


@settings(max_examples=300)
@given(data=st.data(), carrier=st.sampled_from(list(Carrier)))
def test_the_encoding_is_paho_mqtts_byte_for_byte_and_paho_reads_ours(data: st.DataObject, carrier: Carrier) -> None:
    props = data.draw(properties_for(carrier))
    theirs = PahoProperties(_PAHO_TYPE[carrier])
    for f in dataclasses.fields(Properties):
        value = getattr(props, f.name)
        if value is None or value == ():
            continue
        setattr(theirs, _paho_name(f.name), list(value) if isinstance(value, tuple) else value)
    ours = pack_properties(props, carrier)
    assert ours == theirs.pack()
    read_back, _ = PahoProperties(_PAHO_TYPE[carrier]).unpack(ours)
    assert read_back.pack() == ours


# -- malformed and misplaced properties ------------------------------------------------------


def _props(*items: bytes) -> bytes:
    body = b"".join(items)
    return bytes((len(body),)) + body


def _code(carrier: Carrier, wire: bytes) -> ReasonCode:
    with pytest.raises(PacketError) as caught:
        read_properties(wire, 0, len(wire), carrier)
    return caught.value.code


@pytest.mark.parametrize(
    ("carrier", "wire", "code"),
    [
        (Carrier.PUBLISH, _props(b"\x05\x00"), ReasonCode.MALFORMED_PACKET),  # no property 0x05
        (Carrier.CONNECT, _props(b"\x23\x00\x01"), ReasonCode.MALFORMED_PACKET),  # Topic Alias in CONNECT
        (Carrier.PUBLISH, _props(b"\x11\x00\x00\x00\x01"), ReasonCode.MALFORMED_PACKET),  # Session Expiry
        (Carrier.WILL, _props(b"\x23\x00\x01"), ReasonCode.MALFORMED_PACKET),  # Topic Alias in a Will
        (Carrier.CONNECT, _props(b"\x21\x00\x05\x21\x00\x06"), ReasonCode.PROTOCOL_ERROR),  # twice
        (Carrier.CONNECT, _props(b"\x21\x00\x00"), ReasonCode.PROTOCOL_ERROR),  # Receive Maximum 0
        (Carrier.CONNECT, _props(b"\x27\x00\x00\x00\x00"), ReasonCode.PROTOCOL_ERROR),  # Maximum Packet Size 0
        (Carrier.CONNECT, _props(b"\x17\x02"), ReasonCode.PROTOCOL_ERROR),  # Request Problem Information 2
        (Carrier.PUBLISH, _props(b"\x01\x02"), ReasonCode.PROTOCOL_ERROR),  # Payload Format Indicator 2
        (Carrier.PUBLISH, _props(b"\x23\x00\x00"), ReasonCode.TOPIC_ALIAS_INVALID),  # Topic Alias 0
        (Carrier.SUBSCRIBE, _props(b"\x0b\x00"), ReasonCode.PROTOCOL_ERROR),  # Subscription Identifier 0
        (Carrier.SUBSCRIBE, _props(b"\x0b\x01\x0b\x02"), ReasonCode.PROTOCOL_ERROR),  # two in a SUBSCRIBE
        (Carrier.PUBLISH, _props(b"\x03\x00\x02\xc3\x28"), ReasonCode.MALFORMED_PACKET),  # not UTF-8
        (Carrier.PUBLISH, _props(b"\x03\x00\x01\x00"), ReasonCode.MALFORMED_PACKET),  # U+0000
        (Carrier.PUBLISH, _props(b"\x03\x00\x03\xed\xa0\x80"), ReasonCode.MALFORMED_PACKET),  # a surrogate
        (Carrier.PUBLISH, _props(b"\x02\x00\x00"), ReasonCode.MALFORMED_PACKET),  # a four-byte int cut short
        (Carrier.PUBLISH, b"\x09\x02\x00\x00\x00\x01", ReasonCode.MALFORMED_PACKET),  # runs past the end
        (Carrier.PUBLISH, _props(b"\x0b\x80\x00"), ReasonCode.MALFORMED_PACKET),  # an overlong varint
        (Carrier.PUBLISH, _props(b"\x0b\x80\x80\x80\x80\x01"), ReasonCode.MALFORMED_PACKET),  # five bytes
    ],
)
def test_bad_properties_get_the_specs_reason_code(carrier: Carrier, wire: bytes, code: ReasonCode) -> None:
    assert _code(carrier, wire) is code


def test_repeatable_properties_keep_their_order() -> None:
    pairs = (("b", "2"), ("a", "1"), ("b", "1"))
    props = Properties(user_properties=pairs, subscription_identifiers=(7, 3, 300))
    wire = pack_properties(props, Carrier.PUBLISH)
    back, _ = read_properties(wire, 0, len(wire), Carrier.PUBLISH)
    assert back.user_properties == pairs and back.subscription_identifiers == (7, 3, 300)
    assert field_ident("user_properties") == 0x26 and pack_properties(EMPTY, Carrier.PUBLISH) == b"\x00"
    with pytest.raises(ValueError, match="topic_alias"):
        pack_properties(Properties(topic_alias=1), Carrier.CONNECT)


# -- packets ---------------------------------------------------------------------------------

ID = st.integers(1, 0xFFFF)
TOPIC = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00+#"), min_size=1, max_size=12)


@st.composite
def any_packet(draw: st.DrawFn) -> p.Packet:
    kind = draw(st.sampled_from(["connect", "connack", "publish", "ack", "subscribe", "suback", "unsubscribe"]))
    kind = draw(st.sampled_from([kind, "unsuback", "ping", "disconnect", "auth"]))
    if kind == "connect":
        will = None
        if draw(st.booleans()):
            will = p.Will(
                draw(TOPIC),
                draw(BINARY),
                draw(st.integers(0, 2)),
                draw(st.booleans()),
                draw(properties_for(Carrier.WILL)),
            )
        return p.Connect(
            draw(TEXT),
            draw(U16),
            draw(st.booleans()),
            draw(properties_for(Carrier.CONNECT)),
            will,
            draw(st.none() | TEXT),
            draw(st.none() | BINARY),
        )
    if kind == "connack":
        return p.Connack(
            draw(st.booleans()),
            draw(st.sampled_from([0x00, 0x80, 0x85, 0x86, 0x87, 0x8A])),
            draw(properties_for(Carrier.CONNACK)),
        )
    if kind == "publish":
        qos = draw(st.integers(0, 2))
        return p.Publish(
            draw(TOPIC),
            draw(BINARY),
            qos,
            draw(st.booleans()),
            draw(st.booleans()) if qos else False,
            draw(ID) if qos else None,
            draw(properties_for(Carrier.PUBLISH)),
        )
    if kind == "ack":
        ack = draw(st.sampled_from([4, 5, 6, 7]))
        ack_codes = [0x00, 0x10, 0x80, 0x87, 0x97] if ack in (4, 5) else [0x00, 0x92]
        carrier = {4: Carrier.PUBACK, 5: Carrier.PUBREC, 6: Carrier.PUBREL, 7: Carrier.PUBCOMP}[ack]
        return p.Ack(ack, draw(ID), draw(st.sampled_from(ack_codes)), draw(properties_for(carrier)))
    if kind == "subscribe":
        subs = st.builds(p.Subscription, TOPIC, st.integers(0, 2), st.booleans(), st.booleans(), st.integers(0, 2))
        return p.Subscribe(
            draw(ID), tuple(draw(st.lists(subs, min_size=1, max_size=4))), draw(properties_for(Carrier.SUBSCRIBE))
        )
    if kind == "suback":
        codes = st.lists(
            st.sampled_from([0x00, 0x01, 0x02, 0x80, 0x87, 0x8F, 0x9E, 0xA1, 0xA2]), min_size=1, max_size=4
        )
        return p.Suback(draw(ID), tuple(draw(codes)), draw(properties_for(Carrier.SUBACK)))
    if kind == "unsubscribe":
        return p.Unsubscribe(
            draw(ID), tuple(draw(st.lists(TOPIC, min_size=1, max_size=4))), draw(properties_for(Carrier.UNSUBSCRIBE))
        )
    if kind == "unsuback":
        codes = st.lists(st.sampled_from([0x00, 0x11, 0x80, 0x87, 0x8F]), min_size=1, max_size=4)
        return p.Unsuback(draw(ID), tuple(draw(codes)), draw(properties_for(Carrier.UNSUBACK)))
    if kind == "ping":
        return p.Pingreq() if draw(st.booleans()) else p.Pingresp()
    if kind == "disconnect":
        code = draw(st.sampled_from([0x00, 0x04, 0x81, 0x82, 0x8B, 0x8D, 0x8E, 0x93, 0x95, 0x97]))
        return p.Disconnect(code, draw(properties_for(Carrier.DISCONNECT)))
    return p.Auth(draw(st.sampled_from([0x00, 0x18, 0x19])), draw(properties_for(Carrier.AUTH)))


@settings(max_examples=500)
@given(packets=st.lists(any_packet(), min_size=1, max_size=5))
def test_every_packet_round_trips(packets: list[p.Packet]) -> None:
    wire = b"".join(pack(packet) for packet in packets)
    assert read_packets(wire) == packets


@settings(max_examples=2000)
@given(first=U8, body=st.binary(max_size=64))
def test_any_bytes_give_a_packet_or_a_reason_code_never_a_traceback(first: int, body: bytes) -> None:
    try:
        read_packet(first, body)
    except PacketError as exc:
        assert exc.code in (ReasonCode.MALFORMED_PACKET, ReasonCode.PROTOCOL_ERROR)


def _fails(first: int, body: bytes) -> ReasonCode:
    with pytest.raises(PacketError) as caught:
        read_packet(first, body)
    return caught.value.code


def _connect_body(flags: int, props: bytes = b"\x00", tail: bytes = b"\x00\x01c") -> bytes:
    return b"\x00\x04MQTT\x05" + bytes((flags,)) + b"\x00\x3c" + props + tail


@pytest.mark.parametrize(
    ("first", "body", "code"),
    [
        (0x10, _connect_body(0x03), ReasonCode.MALFORMED_PACKET),  # reserved flag
        (0x10, _connect_body(0x08), ReasonCode.MALFORMED_PACKET),  # Will QoS 1 without a Will
        (0x10, _connect_body(0x1C), ReasonCode.MALFORMED_PACKET),  # Will QoS 3
        (0x10, _connect_body(0x02, _props(b"\x16\x00\x01x")), ReasonCode.PROTOCOL_ERROR),  # auth data, no method
        (0x10, _connect_body(0x02) + b"\x00", ReasonCode.MALFORMED_PACKET),  # a byte left over
        (0x11, _connect_body(0x02), ReasonCode.MALFORMED_PACKET),  # fixed-header flags
        (0x36, b"\x00\x01a\x00\x01\x00", ReasonCode.MALFORMED_PACKET),  # QoS 3
        (0x38, b"\x00\x01a\x00", ReasonCode.MALFORMED_PACKET),  # DUP at QoS 0
        (0x30, b"\x00\x00\x00", ReasonCode.PROTOCOL_ERROR),  # an empty topic without an alias
        (0x30, b"\x00\x03a/#\x00", ReasonCode.PROTOCOL_ERROR),  # a wildcard in a topic name
        (0x32, b"\x00\x01a\x00\x00\x00", ReasonCode.PROTOCOL_ERROR),  # packet identifier 0
        (0x40, b"\x00\x01\x92", ReasonCode.PROTOCOL_ERROR),  # PUBACK may not say "not found"
        (0x60, b"\x00\x01", ReasonCode.MALFORMED_PACKET),  # PUBREL's flags must be 0010
        (0x82, b"\x00\x01\x00\x00\x01a\x30", ReasonCode.PROTOCOL_ERROR),  # Retain Handling 3
        (0x82, b"\x00\x01\x00\x00\x01a\x40", ReasonCode.MALFORMED_PACKET),  # reserved option bits
        (0x82, b"\x00\x01\x00", ReasonCode.PROTOCOL_ERROR),  # no filter
        (0xA2, b"\x00\x01\x00", ReasonCode.PROTOCOL_ERROR),  # UNSUBSCRIBE, no filter
        (0xE0, b"\x10", ReasonCode.PROTOCOL_ERROR),  # DISCONNECT may not say "no matching subscribers"
        (0xF0, b"\x01\x00", ReasonCode.PROTOCOL_ERROR),  # AUTH 0x01
        (0xC0, b"\x00", ReasonCode.MALFORMED_PACKET),  # a PINGREQ with a body
        (0x00, b"", ReasonCode.MALFORMED_PACKET),  # packet type 0
    ],
)
def test_bad_packets_get_the_specs_reason_code(first: int, body: bytes, code: ReasonCode) -> None:
    assert _fails(first, body) is code


def test_short_forms_mean_success_with_no_properties() -> None:
    assert read_packet(0x40, b"\x00\x07") == p.Ack(4, 7)
    assert read_packet(0x50, b"\x00\x07\x10") == p.Ack(5, 7, 0x10)
    assert read_packet(0xE0, b"") == p.Disconnect()
    assert read_packet(0xE0, b"\x04") == p.Disconnect(0x04)
    assert read_packet(0xF0, b"") == p.Auth()
    assert pack(p.Ack(4, 7)) == b"\x40\x02\x00\x07"
    assert pack(p.Disconnect()) == b"\xe0\x00"
    assert pack(p.Disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)) == b"\xe0\x02\x8d\x00"
    assert read_varint(b"\xff\xff\xff\x7f", 0, 4) == (268_435_455, 4)


# -- a real client ---------------------------------------------------------------------------


def test_a_paho_v5_connect_and_subscribe_read_back_as_sent() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    port = listener.getsockname()[1]
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            data = b""
            while not data.startswith(b"\x10") or len(read_packets_safe(data)) < 1:
                data += conn.recv(4096)
            conn.sendall(pack(p.Connack(False, 0, Properties(server_keep_alive=30, topic_alias_maximum=5))))
            while len(read_packets_safe(data)) < 2:
                data += conn.recv(4096)
            got.append(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="paho-5", protocol=mqtt.MQTTv5)
    client.username_pw_set("alice", "secret")
    will_props = PahoProperties(PacketTypes.WILLMESSAGE)
    will_props.WillDelayInterval = 10
    client.will_set("wills/paho-5", b"gone", qos=1, properties=will_props)
    connect_props = PahoProperties(PacketTypes.CONNECT)
    connect_props.SessionExpiryInterval = 3600
    connect_props.ReceiveMaximum = 20
    connect_props.UserProperty = [("site", "north"), ("rack", "7")]
    client.connect("127.0.0.1", port, keepalive=45, clean_start=False, properties=connect_props)
    client.loop_start()
    try:
        sub_props = PahoProperties(PacketTypes.SUBSCRIBE)
        sub_props.SubscriptionIdentifier = 42
        options = SubscribeOptions(qos=1, noLocal=True, retainAsPublished=True, retainHandling=2)
        client.subscribe("a/+/c", options=options, properties=sub_props)
        thread.join(10)
    finally:
        client.loop_stop()
        sock = client.socket()
        if sock is not None:
            sock.close()
        listener.close()
    connect, subscribe = read_packets(got[0])[:2]
    assert isinstance(connect, p.Connect) and isinstance(subscribe, p.Subscribe)
    assert (connect.client_id, connect.keep_alive, connect.clean_start) == ("paho-5", 45, False)
    assert (connect.username, connect.password) == ("alice", b"secret")
    assert connect.properties.session_expiry_interval == 3600 and connect.properties.receive_maximum == 20
    assert connect.properties.user_properties == (("site", "north"), ("rack", "7"))
    assert connect.will == p.Will("wills/paho-5", b"gone", 1, False, Properties(will_delay_interval=10))
    assert subscribe.subscriptions == (p.Subscription("a/+/c", 1, True, True, 2),)
    assert subscribe.properties.subscription_identifiers == (42,)


def read_packets_safe(data: bytes) -> list[p.Packet]:
    """The whole packets at the front of ``data`` (a read may end mid-packet)."""
    out: list[p.Packet] = []
    pos = 0
    while pos < len(data):
        try:
            length, start = read_varint(data, pos + 1, len(data))
        except PacketError:
            break
        if start + length > len(data):
            break
        out.append(read_packet(data[pos], data[start : start + length]))
        pos = start + length
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=40),
    st.binary(max_size=200),
    st.integers(0, 2),
    st.booleans(),
    st.integers(1, 65535),
    st.booleans(),
    st.binary(max_size=200),
)
def test_a_delivered_publish_is_the_spec_layout_short_or_long(
    topic: str, payload: bytes, qos: int, retain: bool, packet_id: int, dup: bool, properties: bytes
) -> None:
    """outbound.publish packs a short PUBLISH in one step and a long one field by field;
    both are §3.3's layout: fixed header, topic, packet id (QoS 1 and 2), the property
    length and properties, the payload."""
    body = varint_by_the_spec(len(properties)) + properties + payload
    wire = publish_by_the_spec(topic, body, qos, retain, packet_id, dup)
    assert outbound.publish(topic, payload, qos, retain, packet_id, dup, properties) == wire
