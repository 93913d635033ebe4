"""The MQTT reader: round trips, incremental parsing, every violation, topic filters and fuzzing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servers.heartbeat.mqtt.encoders import (
    encode_connack,
    encode_connect,
    encode_disconnect,
    encode_pingreq,
    encode_pingresp,
    encode_puback,
    encode_pubcomp,
    encode_publish,
    encode_pubrec,
    encode_pubrel,
    encode_remaining_length,
    encode_suback,
    encode_subscribe,
    encode_unsuback,
    encode_unsubscribe,
)
from servers.heartbeat.mqtt.packets import (
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    ProtocolError,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Subscribe,
    Unsubscribe,
)
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.reader import AnyPacket, PacketReader, idle_reader
from servers.heartbeat.mqtt.v5 import codec as v5_codec
from servers.heartbeat.mqtt.v5 import packets as v5_packets


def parse(data: bytes, max_packet_size: int = 256 * 1024) -> list[AnyPacket]:
    return PacketReader(max_packet_size).feed(data)


def parse_bytewise(data: bytes, max_packet_size: int = 256 * 1024) -> list[AnyPacket]:
    reader = PacketReader(max_packet_size)
    out: list[AnyPacket] = []
    for i in range(len(data)):
        out += reader.feed(data[i : i + 1])
    return out


def encode(packet: Packet) -> bytes:
    """What a client would send for ``packet``."""
    if isinstance(packet, Connect):
        return encode_connect(
            packet.client_id,
            keep_alive=packet.keep_alive,
            clean_session=packet.clean_session,
            will_topic=packet.will_topic,
            will_message=packet.will_message,
            will_qos=packet.will_qos,
            will_retain=packet.will_retain,
            username=packet.username,
            password=packet.password,
            protocol_level=packet.protocol_level,
            protocol_name=packet.protocol_name,
        )
    if isinstance(packet, Publish):
        return encode_publish(
            packet.topic,
            packet.payload,
            qos=packet.qos,
            retain=packet.retain,
            packet_id=packet.packet_id,
            dup=packet.dup,
        )
    if isinstance(packet, Subscribe):
        return encode_subscribe(packet.packet_id, packet.topics)
    if isinstance(packet, Unsubscribe):
        return encode_unsubscribe(packet.packet_id, packet.topics)
    if isinstance(packet, Puback):
        return encode_puback(packet.packet_id)
    if isinstance(packet, Pubrec):
        return encode_pubrec(packet.packet_id)
    if isinstance(packet, Pubrel):
        return encode_pubrel(packet.packet_id)
    if isinstance(packet, Pubcomp):
        return encode_pubcomp(packet.packet_id)
    if isinstance(packet, Pingreq):
        return encode_pingreq()
    return encode_disconnect()


# -- round trips ------------------------------------------------------------------------

ROUND_TRIPS: list[AnyPacket] = [
    Connect("MQTT", 4, True, 60, ""),
    Connect("MQTT", 4, False, 0, "dev-1", username="user", password=b""),
    Connect(
        "MQTT", 4, False, 30, "dev", "w/dev", b"\x00bye", will_qos=1, will_retain=True, username="u", password=b"p\xff"
    ),
    Connect("MQTT", 4, True, 65535, "ünïcødé-€-𝄞", will_topic="w", will_message=b"", will_qos=2),
    Publish("a/b", b"x"),
    Publish("a/b", b"", retain=True),
    Publish("/", b"\x00" * 300, qos=1, packet_id=9),
    Publish("sensors/ü", b"payload", qos=2, retain=True, dup=True, packet_id=65535),
    Puback(7),
    Pubrec(8),
    Pubrel(9),
    Pubcomp(10),
    Subscribe(3, (("a/+", 0), ("#", 2), ("+/b/#", 1), ("$SYS/#", 0))),
    Unsubscribe(4, ("a/+", "x", "#")),
    Pingreq(),
    Disconnect(),
]


@pytest.mark.parametrize("packet", ROUND_TRIPS, ids=lambda p: type(p).__name__)
def test_round_trip(packet: Packet) -> None:
    wire = encode(packet)
    assert parse(wire) == [packet]
    assert parse_bytewise(wire) == [packet]


def test_reader_takes_bytearray_and_memoryview() -> None:
    wire = encode_publish("t", b"x", qos=1, packet_id=1) + encode_pingreq()
    expected = [Publish("t", b"x", 1, packet_id=1), Pingreq()]
    assert PacketReader().feed(bytearray(wire)) == expected
    assert PacketReader().feed(memoryview(wire)) == expected
    reader = PacketReader()
    assert reader.feed(memoryview(wire)[:3]) == []
    assert reader.feed(bytearray(wire[3:])) == expected
    assert PacketReader().feed(bytearray(encode_pingreq())) == [Pingreq()]


def test_connect_as_mosquitto_and_paho_send_it() -> None:
    # mosquitto_pub 2.0.11 and paho-mqtt 2.2 with an empty client id, keep-alive 60, clean session.
    wire = bytes.fromhex("100c00044d5154540402003c0000")
    assert encode_connect("", keep_alive=60) == wire
    assert parse(wire) == [Connect("MQTT", 4, True, 60, "")]


# -- incremental parsing ----------------------------------------------------------------

CHUNKS = [
    encode_connect("s", keep_alive=10, will_topic="w/s", will_message=b"gone", username="u", password=b"p"),
    encode_subscribe(1, [(f"{PRESENCE}#", 0), ("cmd/s/+", 1)]),
    encode_publish("t/1", b"payload" * 30, qos=1, packet_id=2),  # a two-byte remaining length
    encode_pingreq(),
    encode_publish("t/2", b"last") + encode_disconnect(),  # two packets in one read
]
STREAM = b"".join(CHUNKS)
EXPECTED = [
    Connect("MQTT", 4, True, 10, "s", "w/s", b"gone", username="u", password=b"p"),
    Subscribe(1, ((f"{PRESENCE}#", 0), ("cmd/s/+", 1))),
    Publish("t/1", b"payload" * 30, qos=1, packet_id=2),
    Pingreq(),
    Publish("t/2", b"last"),
    Disconnect(),
]


def test_stream_as_the_reads_came() -> None:
    reader = PacketReader()
    got = [reader.feed(chunk) for chunk in CHUNKS]
    assert got == [[EXPECTED[0]], [EXPECTED[1]], [EXPECTED[2]], [EXPECTED[3]], EXPECTED[4:]]
    assert reader.buffered == 0


def test_every_split_point() -> None:
    for cut in range(len(STREAM) + 1):
        reader = PacketReader()
        first = reader.feed(STREAM[:cut])
        assert reader.buffered < len(STREAM)
        assert first + reader.feed(STREAM[cut:]) == EXPECTED, f"split at {cut}"
        assert reader.buffered == 0


def test_every_pair_of_split_points() -> None:
    # Three reads: covers a packet completed by a read that also starts the next one.
    for a in range(0, len(STREAM) + 1, 7):
        for b in range(a, len(STREAM) + 1, 5):
            reader = PacketReader()
            got = reader.feed(STREAM[:a]) + reader.feed(STREAM[a:b]) + reader.feed(STREAM[b:])
            assert got == EXPECTED, f"splits at {a} and {b}"


def test_one_byte_at_a_time() -> None:
    assert parse_bytewise(STREAM) == EXPECTED


def test_buffered_counts_the_unfinished_packet() -> None:
    reader = PacketReader()
    wire = encode_publish("t", b"x" * 1000)
    assert reader.feed(encode_pingreq() + wire[:1]) == [Pingreq()]
    assert reader.buffered == 1
    assert reader.feed(wire[1:600]) == []
    assert reader.buffered == 600
    assert reader.feed(wire[600:] + encode_pingreq()[:1]) == [Publish("t", b"x" * 1000)]
    assert reader.buffered == 1
    assert reader.feed(b"\x00") == [Pingreq()]
    assert reader.buffered == 0
    assert reader.feed(b"") == []


# -- violations -------------------------------------------------------------------------


def connect_wire(flags: int, payload: bytes = b"\x00\x00", name: bytes = b"MQTT", level: int = 4) -> bytes:
    """A CONNECT with keep-alive 60 and the given flags and payload, however wrong."""
    body = len(name).to_bytes(2, "big") + name + bytes((level, flags)) + b"\x00\x3c" + payload
    return bytes((0x10,)) + encode_remaining_length(len(body)) + body


def publish_wire(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_remaining_length(len(body)) + body


VIOLATIONS: list[tuple[str, bytes, str, int | None]] = [
    # Fixed header.
    ("varint-5-bytes", b"\x30\xff\xff\xff\xff\x01", "malformed-remaining-length", None),
    ("varint-4th-continues", b"\x30\x80\x80\x80\x80", "malformed-remaining-length", None),
    ("type-0", b"\x00\x00", "bad-packet-type", None),
    ("type-15", b"\xf0\x00", "bad-packet-type", None),
    ("connack-from-client", encode_connack(False, 0), "bad-packet-type", None),
    ("suback-from-client", encode_suback(1, [0]), "bad-packet-type", None),
    ("unsuback-from-client", encode_unsuback(1), "bad-packet-type", None),
    ("pingresp-from-client", encode_pingresp(), "bad-packet-type", None),
    ("subscribe-flags-0", b"\x80\x06\x00\x01\x00\x01a\x00", "reserved-flags", None),
    ("unsubscribe-flags-0", b"\xa0\x05\x00\x01\x00\x01a", "reserved-flags", None),
    ("pubrel-flags-0", b"\x60\x02\x00\x01", "reserved-flags", None),
    ("puback-flags-2", b"\x42\x02\x00\x01", "reserved-flags", None),
    ("connect-flags", b"\x11" + encode_connect("x")[1:], "reserved-flags", None),
    ("pingreq-flags", b"\xc1\x00", "reserved-flags", None),
    ("disconnect-flags", b"\xe8\x00", "reserved-flags", None),
    ("publish-qos-3", b"\x36\x03\x00\x01a", "bad-qos", None),
    ("publish-dup-qos-0", b"\x38\x03\x00\x01a", "reserved-flags", None),
    # Lengths the spec fixes.
    ("pingreq-with-body", b"\xc0\x01\x00", "bad-length", None),
    ("disconnect-with-body", b"\xe0\x01\x00", "bad-length", None),
    ("puback-3-bytes", b"\x40\x03\x00\x01\x00", "bad-length", None),
    ("pubcomp-1-byte", b"\x70\x01\x01", "bad-length", None),
    # PUBLISH.
    ("publish-topic-hash", encode_publish("a/#", b""), "bad-topic", None),
    ("publish-topic-plus", encode_publish("a/+/b", b"x"), "bad-topic", None),
    ("publish-empty-topic", encode_publish("", b"x"), "bad-topic", None),
    ("publish-qos1-id-0", publish_wire(0x32, b"\x00\x01a\x00\x00"), "bad-packet-id", None),
    ("publish-qos2-id-0", publish_wire(0x34, b"\x00\x01a\x00\x00x"), "bad-packet-id", None),
    ("publish-qos1-no-id", publish_wire(0x32, b"\x00\x01a\x00"), "truncated-packet", None),
    ("publish-topic-past-end", publish_wire(0x30, b"\x00\x09abc"), "truncated-packet", None),
    ("publish-bad-utf8", publish_wire(0x30, b"\x00\x02\xc3\x28"), "invalid-utf8", None),
    ("publish-surrogate", publish_wire(0x30, b"\x00\x03\xed\xa0\x80"), "invalid-utf8", None),
    ("publish-nul", publish_wire(0x30, b"\x00\x03a\x00b"), "invalid-utf8", None),
    ("pubrel-id-0", encode_pubrel(0), "bad-packet-id", None),
    ("puback-id-0", encode_puback(0), "bad-packet-id", None),
    # SUBSCRIBE / UNSUBSCRIBE.
    ("subscribe-empty", b"\x82\x02\x00\x01", "empty-subscribe", None),
    ("subscribe-id-0", encode_subscribe(0, [("a", 0)]), "bad-packet-id", None),
    ("subscribe-qos-3", encode_subscribe(1, [("a", 3)]), "bad-qos", None),
    ("subscribe-qos-upper-bits", encode_subscribe(1, [("a", 0x41)]), "bad-qos", None),
    ("subscribe-hash-not-last", encode_subscribe(1, [("a/#/b", 0)]), "bad-topic-filter", None),
    ("subscribe-hash-in-level", encode_subscribe(1, [("a/b#", 0)]), "bad-topic-filter", None),
    ("subscribe-plus-in-level", encode_subscribe(1, [("a+", 0)]), "bad-topic-filter", None),
    ("subscribe-empty-filter", encode_subscribe(1, [("ok", 0), ("", 0)]), "bad-topic-filter", None),
    ("subscribe-no-qos-byte", b"\x82\x05\x00\x01\x00\x01a", "truncated-packet", None),
    ("subscribe-no-id", b"\x82\x01\x00", "truncated-packet", None),
    ("subscribe-bad-utf8", b"\x82\x06\x00\x01\x00\x01\xff\x00", "invalid-utf8", None),
    ("unsubscribe-empty", b"\xa2\x02\x00\x01", "empty-unsubscribe", None),
    ("unsubscribe-id-0", encode_unsubscribe(0, ["a"]), "bad-packet-id", None),
    ("unsubscribe-bad-filter", encode_unsubscribe(1, ["a/#b"]), "bad-topic-filter", None),
    # CONNECT.
    ("mqisdp-level-4", encode_connect("x", protocol_level=4, protocol_name="MQIsdp"), "bad-protocol-level", 1),
    ("mqtt-6", encode_connect("x", protocol_level=6), "bad-protocol-level", 1),
    ("mqtt-5-marked-a-bridge", encode_connect("x", protocol_level=0x85), "bad-protocol-level", 1),
    (
        "mqisdp-4-marked-a-bridge",
        encode_connect("x", protocol_level=0x84, protocol_name="MQIsdp"),
        "bad-protocol-level",
        1,
    ),
    ("mqtt-level-3", encode_connect("x", protocol_level=3), "bad-protocol-level", 1),
    ("unknown-protocol", encode_connect("x", protocol_name="HTTP"), "unknown-protocol", None),
    ("protocol-name-case", encode_connect("x", protocol_name="mqtt"), "unknown-protocol", None),
    ("connect-reserved-flag", connect_wire(0x03), "connect-reserved-flag", None),
    ("will-retain-without-will", connect_wire(0x22), "bad-will-flags", None),
    ("will-qos-without-will", connect_wire(0x0A), "bad-will-flags", None),
    ("will-qos-3", connect_wire(0x1E), "bad-will-flags", None),
    ("password-without-username", connect_wire(0x42, b"\x00\x00\x00\x01p"), "password-without-username", None),
    ("will-flag-without-will", connect_wire(0x06), "truncated-packet", None),
    ("username-flag-without-username", connect_wire(0x82), "truncated-packet", None),
    ("connect-no-client-id", connect_wire(0x02, b""), "truncated-packet", None),
    ("connect-no-level", b"\x10\x06\x00\x04MQTT", "truncated-packet", None),
    ("connect-trailing-bytes", connect_wire(0x02, b"\x00\x00\xab"), "trailing-bytes", None),
    ("client-id-bad-utf8", connect_wire(0x02, b"\x00\x01\xff"), "invalid-utf8", None),
    ("client-id-nul", connect_wire(0x02, b"\x00\x01\x00"), "invalid-utf8", None),
    ("username-bad-utf8", connect_wire(0x82, b"\x00\x00\x00\x02\xc0\xaf"), "invalid-utf8", None),
    ("will-topic-wildcard", encode_connect("x", will_topic="w/#", will_message=b""), "bad-topic", None),
    # Not MQTT at all.
    ("http-request", b"GET / HTTP/1.1\r\n" + encode_connect("x"), "reserved-flags", None),  # 'G' = 0x47
    ("tls-client-hello", bytes.fromhex("160301020001"), "reserved-flags", None),  # 0x16: CONNECT, flags 6
    ("junk-after-connect", encode_connect("x") + b"\x00", "bad-packet-type", None),
]


@pytest.mark.parametrize(("data", "reason", "connack"), [v[1:] for v in VIOLATIONS], ids=[v[0] for v in VIOLATIONS])
def test_violation(data: bytes, reason: str, connack: int | None) -> None:
    with pytest.raises(ProtocolError) as info:
        parse(data)
    assert (info.value.reason, info.value.connack_code) == (reason, connack)
    # The same verdict however the bytes trickle in.
    with pytest.raises(ProtocolError) as info:
        parse_bytewise(data)
    assert (info.value.reason, info.value.connack_code) == (reason, connack)


def test_protocol_error_message() -> None:
    error = ProtocolError("bad-qos", detail="QoS 3")
    assert (str(error), error.reason, error.connack_code, error.detail) == ("bad-qos: QoS 3", "bad-qos", None, "QoS 3")
    assert str(ProtocolError("bad-protocol-level", 1)) == "bad-protocol-level"


def test_oversized_packet_refused_from_its_header_alone() -> None:
    wire = encode_publish("big", b"x" * 300_000)  # > 256 KiB
    reader = PacketReader()
    with pytest.raises(ProtocolError) as info:
        reader.feed(wire[:5])  # fixed header (4 bytes) and one byte of body
    assert info.value.reason == "packet-too-large"
    assert reader.buffered == 0


def test_packet_size_limit_is_inclusive() -> None:
    wire = encode_publish("t", b"x" * 1000)
    assert parse(wire, max_packet_size=len(wire)) == [Publish("t", b"x" * 1000)]
    with pytest.raises(ProtocolError, match="packet-too-large"):
        parse(wire[:3], max_packet_size=len(wire) - 1)


def test_header_longer_than_a_tiny_limit() -> None:
    reader = PacketReader(max_packet_size=3)
    assert reader.feed(b"\x30") == []
    with pytest.raises(ProtocolError, match="packet-too-large"):
        reader.feed(b"\x80\x80")  # remaining length still unknown, but already too big
    with pytest.raises(ValueError):
        PacketReader(max_packet_size=1)


def test_fixed_lengths_checked_before_the_body() -> None:
    reader = PacketReader()
    with pytest.raises(ProtocolError, match="bad-length"):
        reader.feed(b"\xc0\x80\x01")  # a PINGREQ announcing 128 bytes of body, none sent


def test_reader_is_spent_after_an_error() -> None:
    reader = PacketReader()
    with pytest.raises(ProtocolError, match="bad-packet-type"):
        reader.feed(encode_pingreq() + b"\xf0\x00" + b"z" * 1000)
    assert reader.buffered == 0
    with pytest.raises(ProtocolError) as info:
        reader.feed(encode_pingreq())
    assert info.value.reason == "bad-packet-type"


# -- topic filters ----------------------------------------------------------------------


@pytest.mark.parametrize("topic_filter", ["#", "+", "a/#", "+/+", "/+", "a/+/b/#", "/", "a//b", "$SYS/#", "+/#"])
def test_valid_filters(topic_filter: str) -> None:
    assert parse(encode_subscribe(1, [(topic_filter, 0)])) == [Subscribe(1, ((topic_filter, 0),))]
    assert parse(encode_unsubscribe(1, [topic_filter])) == [Unsubscribe(1, (topic_filter,))]


@pytest.mark.parametrize("topic_filter", ["", "#/", "#/a", "a/#/b", "a#", "a/b#", "++", "a/+b", "+a/b", "##"])
def test_invalid_filters(topic_filter: str) -> None:
    for wire in (encode_subscribe(1, [(topic_filter, 0)]), encode_unsubscribe(1, [topic_filter])):
        with pytest.raises(ProtocolError, match="bad-topic-filter"):
            parse(wire)


# -- fuzzing ----------------------------------------------------------------------------

FUZZ_LIMIT = 512


def feed_in_chunks(data: bytes, sizes: list[int], max_packet_size: int = FUZZ_LIMIT) -> list[AnyPacket]:
    """Feed ``data`` in chunks of ``sizes`` (then the rest), checking the buffer bound after each."""
    reader = PacketReader(max_packet_size)
    out: list[AnyPacket] = []
    pos = 0
    for size in [*sizes, len(data)]:
        try:
            out += reader.feed(data[pos : pos + size])
        finally:
            assert reader.buffered <= max_packet_size
        pos += size
    return out


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.integers(0, 300), max_size=20))
def test_fuzz_arbitrary_bytes(data: bytes, sizes: list[int]) -> None:
    try:
        packets = feed_in_chunks(data, sizes)
    except ProtocolError:
        return
    assert all(isinstance(p, Packet) for p in packets)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(STREAM) - 1), st.integers(0, 255)), min_size=1, max_size=4),
    st.lists(st.integers(1, 64), max_size=10),
)
def test_fuzz_corrupted_stream(edits: list[tuple[int, int]], sizes: list[int]) -> None:
    # Random bytes rarely get past the first header; corrupting a valid stream reaches the parsers.
    data = bytearray(STREAM)
    for index, value in edits:
        data[index] = value
    try:
        packets = feed_in_chunks(bytes(data), sizes, max_packet_size=1024)
    except ProtocolError:
        return
    assert all(isinstance(p, Packet) for p in packets)


# -- round trips of random valid packets ------------------------------------------------

text = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs", "Cc", "Cn"]), max_size=30)
topic_names = st.text(
    st.characters(exclude_characters="\x00+#", exclude_categories=["Cs", "Cc", "Cn"]), min_size=1, max_size=30
)
packet_ids = st.integers(1, 65535)
qos_levels = st.integers(0, 2)
plain_levels = st.text(st.characters(exclude_characters="\x00+#/", exclude_categories=["Cs", "Cc", "Cn"]), max_size=8)
topic_filters = st.builds(
    lambda levels, tail: "/".join([*levels, *tail]),
    st.lists(st.one_of(st.just("+"), plain_levels), min_size=1, max_size=5),
    st.sampled_from([[], ["#"]]),
).filter(bool)


@st.composite
def publishes(draw: st.DrawFn) -> Publish:
    qos = draw(qos_levels)
    return Publish(
        topic=draw(topic_names),
        payload=draw(st.binary(max_size=300)),
        qos=qos,
        retain=draw(st.booleans()),
        dup=draw(st.booleans()) if qos else False,
        packet_id=draw(packet_ids) if qos else None,
    )


@st.composite
def connects(draw: st.DrawFn) -> Connect:
    will = draw(st.none() | st.tuples(topic_names, st.binary(max_size=50), qos_levels, st.booleans()))
    username = draw(st.none() | text)
    return Connect(
        protocol_name="MQTT",
        protocol_level=4,
        clean_session=draw(st.booleans()),
        keep_alive=draw(st.integers(0, 65535)),
        client_id=draw(text),
        will_topic=will[0] if will else None,
        will_message=will[1] if will else None,
        will_qos=will[2] if will else 0,
        will_retain=will[3] if will else False,
        username=username,
        password=draw(st.none() | st.binary(max_size=20)) if username is not None else None,
    )


subscribes = st.builds(
    Subscribe, packet_ids, st.lists(st.tuples(topic_filters, qos_levels), min_size=1, max_size=5).map(tuple)
)
unsubscribes = st.builds(Unsubscribe, packet_ids, st.lists(topic_filters, min_size=1, max_size=5).map(tuple))
any_packet: st.SearchStrategy[Packet] = st.one_of(
    publishes(),
    connects(),
    subscribes,
    unsubscribes,
    st.builds(Puback, packet_ids),
    st.builds(Pubrec, packet_ids),
    st.builds(Pubrel, packet_ids),
    st.builds(Pubcomp, packet_ids),
    st.just(Pingreq()),
    st.just(Disconnect()),
)


@settings(max_examples=300, deadline=None)
@given(publishes())
def test_publish_round_trip(packet: Publish) -> None:
    assert parse(encode(packet)) == [packet]


@settings(max_examples=300, deadline=None)
@given(connects())
def test_connect_round_trip(packet: Connect) -> None:
    assert parse(encode(packet)) == [packet]


@settings(max_examples=300, deadline=None)
@given(st.one_of(subscribes, unsubscribes))
def test_subscribe_round_trip(packet: Subscribe | Unsubscribe) -> None:
    assert parse(encode(packet)) == [packet]


@settings(max_examples=200, deadline=None)
@given(st.lists(any_packet, max_size=12), st.lists(st.integers(0, 200), max_size=12))
def test_stream_round_trip(packets: list[Packet], sizes: list[int]) -> None:
    assert feed_in_chunks(b"".join(encode(p) for p in packets), sizes, max_packet_size=4096) == packets


def test_a_failed_reader_keeps_its_error_without_a_traceback() -> None:
    """Found by ``python -m loadtest fuzz``: the kept error's traceback held the
    reader's frame, a cycle; once gc.freeze() had frozen the reader (the servers do
    every 2 s) the collector never freed it, ~2.7 KB per protocol error."""
    reader = PacketReader(1024)
    with pytest.raises(ProtocolError) as raised:
        reader.feed(b"\xf0\x00")  # packet type 15: reserved
    assert reader._error is not None and reader._error.__traceback__ is None
    assert reader._error.reason == raised.value.reason
    with pytest.raises(ProtocolError, match="reader already failed"):
        reader.feed(b"\xc0\x00")


# -- idle readers shared between connections ----------------------------------------------

V5_STREAM = v5_codec.pack(v5_packets.Connect("v5-dev", 30)) + b"\xc0\x00" + encode(Publish("t/5", b"five", 0))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["3.1.1", "5.0", "corrupt"]), st.lists(st.integers(1, 40), max_size=12)),
        min_size=1,
        max_size=6,
    ),
    st.randoms(use_true_random=False),
)
def test_connections_sharing_idle_readers_read_what_their_own_would(
    connections: list[tuple[str, list[int]]], rng: random.Random
) -> None:
    """Each connection's stream, split at random and fed interleaved with the others': a
    connection that keeps ``settled()`` (sharing an idle reader while it has nothing to
    keep) gets the same packets and the same failure as one with a reader of its own,
    and the shared readers are left as new."""
    streams = []
    for kind, sizes in connections:
        data = bytearray(V5_STREAM if kind == "5.0" else STREAM)
        if kind == "corrupt":
            data[rng.randrange(len(data))] = rng.randrange(256)
        pieces, pos = [], 0
        for size in sizes:
            pieces.append(bytes(data[pos : pos + size]))
            pos += size
        pieces.append(bytes(data[pos:]))
        streams.append(pieces)
    own = [PacketReader(1024) for _ in streams]
    shared = [idle_reader(1024) for _ in streams]
    got_own: list[list[object]] = [[] for _ in streams]
    got_shared: list[list[object]] = [[] for _ in streams]
    turns = [i for i, pieces in enumerate(streams) for _ in pieces]
    rng.shuffle(turns)
    next_piece = [0] * len(streams)
    for i in turns:
        piece = streams[i][next_piece[i]]
        next_piece[i] += 1
        for readers, got in ((own, got_own), (shared, got_shared)):
            reader = readers[i]
            try:
                got[i] += reader.feed(piece)
            except ProtocolError as exc:
                got[i].append(("error", exc.reason))
            if readers is shared:
                readers[i] = reader.settled()
    assert got_shared == got_own
    assert [r.buffered for r in shared] == [r.buffered for r in own]
    for v5 in (False, True):
        home = idle_reader(1024, v5)
        assert home.buffered == 0 and home.v5 is v5 and home.feed(b"\xc0\x00") == [Pingreq()]


def test_a_shared_reader_is_left_for_one_of_the_connections_own_only_while_it_has_state() -> None:
    reader = idle_reader(1024)
    assert reader.settled() is reader  # nothing to keep
    reader.feed(STREAM[:3])  # a packet begun
    own = reader.settled()
    assert own is not reader and own.buffered == 3 and reader.buffered == 0
    assert reader.shared and not own.shared  # what the heartbeat's fast path reads
    assert own.feed(STREAM[3:]) and own.settled() is reader  # finished: back to sharing
    v5 = idle_reader(1024)
    v5.feed(v5_codec.pack(v5_packets.Connect("v5-dev", 30)))
    assert v5.settled() is idle_reader(1024, True) and not idle_reader(1024).v5


def test_connects_with_one_keep_alive_share_its_int() -> None:
    """A keep-alive above 256 is an int object of its own, held as long as the device is
    online: every CONNECT with it (3.1.1 or 5.0) shares one."""
    first = parse(encode_connect("a", keep_alive=600))[0]
    second = parse(encode_connect("b", keep_alive=int("600")))[0]
    third = parse(v5_codec.pack(v5_packets.Connect("c", int("600"))))[0]
    assert isinstance(first, Connect) and isinstance(second, Connect) and isinstance(third, v5_packets.Connect)
    assert first.keep_alive == 600 and first.keep_alive is second.keep_alive is third.keep_alive


def test_devices_with_one_keep_alive_share_their_receive_timeout() -> None:
    from servers.heartbeat.mqtt.sharing import silence_allowed

    assert silence_allowed(600) == 900.0 and silence_allowed(600) is silence_allowed(int("600"))
    assert silence_allowed(7) == 10.5
