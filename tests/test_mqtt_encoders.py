"""The MQTT encoders: exact bytes of every packet, and what they refuse to encode."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from servers.heartbeat.mqtt.encoders import (
    encode_connack,
    encode_disconnect,
    encode_held,
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
from servers.heartbeat.mqtt.packets import ProtocolError
from servers.heartbeat.mqtt.reader import PacketReader

# -- exact bytes ------------------------------------------------------------------------


def test_fixed_layouts() -> None:
    assert encode_connack(False, 0) == bytes.fromhex("20020000")
    assert encode_connack(True, 0) == bytes.fromhex("20020100")
    assert encode_connack(False, 5) == bytes.fromhex("20020005")
    assert encode_pingresp() == bytes.fromhex("d000")
    assert encode_puback(7) == bytes.fromhex("40020007")
    assert encode_pubrec(0x1234) == bytes.fromhex("50021234")
    assert encode_pubrel(1) == bytes.fromhex("62020001")
    assert encode_pubcomp(65535) == bytes.fromhex("7002ffff")
    assert encode_suback(1, [0, 1, 2, 0x80]) == bytes.fromhex("9006000100010280")
    assert encode_unsuback(258) == bytes.fromhex("b0020102")
    assert encode_pingreq() == bytes.fromhex("c000")
    assert encode_disconnect() == bytes.fromhex("e000")


def test_variable_layouts() -> None:
    assert encode_publish("a/b", b"hi") == bytes.fromhex("30070003612f626869")
    assert encode_publish("a", b"", qos=1, packet_id=10, retain=True, dup=True) == bytes.fromhex("3b05000161000a")
    assert encode_publish("a", b"", qos=2, packet_id=1) == bytes.fromhex("34050001610001")
    assert encode_subscribe(1, [("a/+", 1)]) == bytes.fromhex("820800010003612f2b01")
    assert encode_unsubscribe(2, ["#"]) == bytes.fromhex("a2050002000123")
    # A long payload takes a two-byte remaining length: 2 + 1 + 200 = 203 = 0xcb 0x01.
    assert encode_publish("t", b"x" * 200)[:5] == bytes.fromhex("30cb010001")


def test_encoders_refuse_what_cannot_be_sent() -> None:
    with pytest.raises(ValueError):
        encode_publish("t", b"", qos=1)  # QoS 1 without a packet id
    with pytest.raises(ValueError):
        encode_publish("t", b"", qos=3, packet_id=1)
    with pytest.raises(ValueError):
        encode_publish("t" * 65536, b"")


# -- remaining length -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "wire"),
    [
        (0, "00"),
        (1, "01"),
        (127, "7f"),
        (128, "8001"),
        (321, "c102"),
        (16383, "ff7f"),
        (16384, "808001"),
        (2097151, "ffff7f"),
        (2097152, "80808001"),
        (268435455, "ffffff7f"),
    ],
)
def test_remaining_length(n: int, wire: str) -> None:
    header = encode_remaining_length(n)
    assert header == bytes.fromhex(wire)
    if n:
        # The reader decodes it to the same number: it admits exactly that much and no less.
        total = 1 + len(header) + n
        reader = PacketReader(max_packet_size=total)
        assert reader.feed(b"\x30" + header) == []
        assert reader.buffered == 1 + len(header)
        with pytest.raises(ProtocolError, match="packet-too-large"):
            PacketReader(max_packet_size=total - 1).feed(b"\x30" + header)


@pytest.mark.parametrize("n", [-1, 268435456, 2**40])
def test_remaining_length_range(n: int) -> None:
    with pytest.raises(ValueError):
        encode_remaining_length(n)


# -- PUBLISH against the spec's layout --------------------------------------------------


def varint_by_the_spec(n: int) -> bytes:
    """MQTT-1.5.5's variable byte integer, seven bits a byte, low first."""
    out = bytearray()
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def publish_by_the_spec(topic: str, payload: bytes, qos: int, retain: bool, packet_id: int, dup: bool) -> bytes:
    """MQTT-3.3 written out field by field: fixed header, topic name, packet id, payload."""
    name = topic.encode("utf-8")
    body = len(name).to_bytes(2, "big") + name + (packet_id.to_bytes(2, "big") if qos else b"") + payload
    return bytes((0x30 | dup << 3 | qos << 1 | retain,)) + varint_by_the_spec(len(body)) + body


@settings(max_examples=300, deadline=None)
@given(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=40),
    st.binary(max_size=300),
    st.integers(0, 2),
    st.booleans(),
    st.integers(1, 65535),
    st.booleans(),
)
@example("t", b"x" * 123, 1, False, 7, False)  # a remaining length of 128: two bytes
@example("t", b"x" * 122, 1, True, 7, True)  # of 127: one
@example("t", b"on", 0, True, 7, False)  # a retained QoS 0 message: no packet id
def test_publish_is_laid_out_as_the_spec_says_and_reads_back(
    topic: str, payload: bytes, qos: int, retain: bool, packet_id: int, dup: bool
) -> None:
    """Both header forms (a remaining length of one byte, and more), every flag; the
    same from encode_held, which a Message sends with (an outbox's QoS 1 and 2, a
    retained QoS 0 one)."""
    wire = encode_publish(topic, payload, qos=qos, retain=retain, packet_id=packet_id, dup=dup)
    assert wire == publish_by_the_spec(topic, payload, qos, retain, packet_id, dup)
    assert encode_held(topic, payload, qos, retain, packet_id, dup) == wire
    if topic.isprintable() and topic and "+" not in topic and "#" not in topic and not (dup and not qos):
        [packet] = PacketReader().feed(wire)
        assert (packet.topic, packet.payload, packet.qos, packet.retain) == (topic, payload, qos, retain)  # type: ignore[union-attr]
