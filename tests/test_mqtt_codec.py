"""The MQTT codec: exact bytes, incremental parsing, every violation, and a fuzz test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servers.heartbeat import codec
from servers.heartbeat.codec import PacketReader, ProtocolError


def parse(data: bytes, max_packet_size: int = 256 * 1024) -> list[codec.Packet]:
    return PacketReader(max_packet_size).feed(data)


def test_fixed_layouts() -> None:
    assert codec.encode_connack(False, 0) == bytes.fromhex("20020000")
    assert codec.encode_connack(True, 5) == bytes.fromhex("20020105")
    assert codec.encode_pingresp() == bytes.fromhex("d000")
    assert codec.encode_puback(7) == bytes.fromhex("40020007")
    assert codec.encode_unsuback(258) == bytes.fromhex("b0020102")
    assert codec.encode_suback(1, [0, 1, 0x80]) == bytes.fromhex("9005000100 0180".replace(" ", ""))
    assert codec.encode_pingreq() == bytes.fromhex("c000")
    assert codec.encode_disconnect() == bytes.fromhex("e000")


def test_connect_as_mosquitto_and_paho_send_it() -> None:
    wire = bytes.fromhex("100c00044d5154540402003c0000")
    assert codec.encode_connect("", keep_alive=60) == wire
    (packet,) = parse(wire)
    assert packet == codec.Connect("MQTT", 4, True, 60, "")


def test_round_trips() -> None:
    connect = codec.encode_connect(
        "dev",
        keep_alive=30,
        clean_session=False,
        will_topic="w/dev",
        will_message=b"\x00bye",
        will_qos=1,
        will_retain=True,
        username="u",
        password=b"p\xff",
    )
    (c,) = parse(connect)
    assert c == codec.Connect("MQTT", 4, False, 30, "dev", "w/dev", b"\x00bye", 1, True, "u", b"p\xff")
    assert parse(codec.encode_publish("a/b", b"x", qos=1, packet_id=9, retain=True)) == [
        codec.Publish("a/b", b"x", 1, True, False, 9)
    ]
    assert parse(codec.encode_subscribe(3, [("a/+", 0), ("#", 2)])) == [codec.Subscribe(3, (("a/+", 0), ("#", 2)))]
    assert parse(codec.encode_unsubscribe(4, ["a/+"])) == [codec.Unsubscribe(4, ("a/+",))]
    assert parse(codec.encode_pubrel(5)) == [codec.Pubrel(5)]
    assert parse(codec.encode_pingreq() + codec.encode_disconnect()) == [codec.Pingreq(), codec.Disconnect()]


STREAM = (
    codec.encode_connect("s", keep_alive=10)
    + codec.encode_subscribe(1, [("presence/#", 0)])
    + codec.encode_publish("t/1", b"payload" * 30, qos=1, packet_id=2)
    + codec.encode_pingreq()
    + codec.encode_publish("t/2", b"last")
    + codec.encode_disconnect()
)


def test_every_split_point_and_byte_by_byte() -> None:
    whole = parse(STREAM)
    assert len(whole) == 6
    for cut in range(len(STREAM) + 1):
        reader = PacketReader()
        assert reader.feed(STREAM[:cut]) + reader.feed(STREAM[cut:]) == whole
        assert reader.buffered == 0
    reader = PacketReader()
    out: list[codec.Packet] = []
    for i in range(len(STREAM)):
        out += reader.feed(STREAM[i : i + 1])
    assert out == whole


VIOLATIONS: list[tuple[bytes, str, int | None]] = [
    (b"\x30\xff\xff\xff\xff\x01", "malformed-remaining-length", None),
    (b"\x82\x05\x00\x01\x00\x01a", "truncated-packet", None),
    (b"\x80\x06\x00\x01\x00\x01a\x00", "reserved-flags", None),  # SUBSCRIBE without 0b0010
    (b"\xc1\x00", "reserved-flags", None),
    (b"\xc0\x01\x00", "bad-length", None),
    (b"\x20\x02\x00\x00", "bad-packet-type", None),  # CONNACK from a client
    (b"\x00\x00", "bad-packet-type", None),
    (b"\xf0\x00", "bad-packet-type", None),
    (b"\x36\x03\x00\x01a", "bad-qos", None),
    (b"\x38\x03\x00\x01a", "reserved-flags", None),  # DUP with QoS 0
    (codec.encode_publish("a/#", b""), "bad-topic", None),
    (codec.encode_publish("", b""), "bad-topic", None),
    (b"\x32\x05\x00\x01a\x00\x00", "bad-packet-id", None),
    (codec.encode_subscribe(1, [("a/#/b", 0)]), "bad-topic-filter", None),
    (codec.encode_subscribe(1, [("a+", 0)]), "bad-topic-filter", None),
    (codec.encode_subscribe(1, [("a", 3)]), "bad-qos", None),
    (b"\x82\x02\x00\x01", "empty-subscribe", None),
    (b"\xa2\x02\x00\x01", "empty-unsubscribe", None),
    (codec.encode_connect("x", protocol_level=3, protocol_name="MQIsdp"), "bad-protocol-level", 1),
    (codec.encode_connect("x", protocol_level=5), "bad-protocol-level", 1),
    (codec.encode_connect("x", protocol_name="HTTP"), "unknown-protocol", None),
    (bytes.fromhex("100c00044d5154540403003c0000"), "connect-reserved-flag", None),
    (bytes.fromhex("100c00044d5154540422003c0000"), "bad-will-flags", None),  # will retain, no will
    (bytes.fromhex("100c00044d5154540442003c0000"), "password-without-username", None),
    (codec.encode_connect("x") + b"\x00", "bad-packet-type", None),  # junk after a good packet
    (bytes.fromhex("100d00044d5154540402003c0001ff"), "invalid-utf8", None),
    (bytes.fromhex("100d00044d5154540402003c000100"), "invalid-utf8", None),
    (bytes.fromhex("100d00044d5154540402003c0000ab"), "trailing-bytes", None),
    (b"GET / HTTP/1.1\r\n\r\n", "reserved-flags", None),  # 'G' reads as PUBACK with flags 7
]


@pytest.mark.parametrize(("data", "reason", "connack"), VIOLATIONS)
def test_violations(data: bytes, reason: str, connack: int | None) -> None:
    with pytest.raises(ProtocolError) as info:
        parse(data)
    assert info.value.reason == reason
    assert info.value.connack_code == connack


def test_oversized_packet_refused_from_its_header_alone() -> None:
    reader = PacketReader(max_packet_size=1024)
    with pytest.raises(ProtocolError, match="packet-too-large"):
        reader.feed(b"\x30\x80\x10")  # declares 2048 bytes; no body sent yet


@pytest.mark.parametrize(
    ("n", "wire"),
    [
        (0, "00"),
        (127, "7f"),
        (128, "8001"),
        (16383, "ff7f"),
        (16384, "808001"),
        (2097151, "ffff7f"),
        (2097152, "80808001"),
        (268435455, "ffffff7f"),
    ],
)
def test_remaining_length(n: int, wire: str) -> None:
    assert codec.encode_remaining_length(n) == bytes.fromhex(wire)


def test_remaining_length_range() -> None:
    with pytest.raises(ValueError):
        codec.encode_remaining_length(268435456)
    with pytest.raises(ValueError):
        codec.encode_remaining_length(-1)


@pytest.mark.parametrize(
    ("topic_filter", "topic", "match"),
    [
        ("sport/tennis/player1/#", "sport/tennis/player1", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
        ("sport/#", "sport", True),
        ("sport/tennis/+", "sport/tennis/player1", True),
        ("sport/tennis/+", "sport/tennis/player1/ranking", False),
        ("sport/+", "sport", False),
        ("+/+", "/finance", True),
        ("/+", "/finance", True),
        ("+", "/finance", False),
        ("#", "$SYS/x", False),
        ("+/monitor/Clients", "$SYS/monitor/Clients", False),
        ("$SYS/#", "$SYS/x", True),
        ("presence/#", "presence/dev-1", True),
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
    ],
)
def test_topic_matches(topic_filter: str, topic: str, match: bool) -> None:
    assert codec.topic_matches(topic_filter, topic) is match


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.integers(1, 300), max_size=20))
def test_fuzz_only_packets_or_protocol_errors(data: bytes, cuts: list[int]) -> None:
    reader = PacketReader(max_packet_size=512)
    pos = 0
    try:
        for size in [*cuts, len(data)]:
            reader.feed(data[pos : pos + size])
            pos += size
            assert reader.buffered <= 512
    except ProtocolError:
        pass


topics = st.text(st.characters(exclude_characters="+#\x00", exclude_categories=["Cs"]), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(
    topic=topics,
    payload=st.binary(max_size=300),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    packet_id=st.integers(1, 65535),
)
def test_publish_round_trip(topic: str, payload: bytes, qos: int, retain: bool, packet_id: int) -> None:
    wire = codec.encode_publish(topic, payload, qos=qos, retain=retain, packet_id=packet_id if qos else None)
    assert parse(wire) == [codec.Publish(topic, payload, qos, retain, False, packet_id if qos else None)]


@settings(max_examples=200, deadline=None)
@given(
    client_id=st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=40),
    keep_alive=st.integers(0, 65535),
    will=st.one_of(st.none(), st.tuples(topics, st.binary(max_size=50), st.integers(0, 2), st.booleans())),
    username=st.one_of(st.none(), st.text(max_size=20).filter(lambda s: "\x00" not in s)),
    password=st.binary(max_size=20),
)
def test_connect_round_trip(
    client_id: str,
    keep_alive: int,
    will: tuple[str, bytes, int, bool] | None,
    username: str | None,
    password: bytes,
) -> None:
    kw: dict[str, object] = {}
    if will is not None:
        kw.update(will_topic=will[0], will_message=will[1], will_qos=will[2], will_retain=will[3])
    pw = password if username is not None else None
    wire = codec.encode_connect(client_id, keep_alive=keep_alive, username=username, password=pw, **kw)  # type: ignore[arg-type]
    (packet,) = parse(wire)
    assert isinstance(packet, codec.Connect)
    assert (packet.client_id, packet.keep_alive, packet.username, packet.password) == (
        client_id,
        keep_alive,
        username,
        pw,
    )
    assert packet.will_topic == (will[0] if will else None)
