"""``--retain-available false`` and ``--message-size-limit`` in the sans-IO sessions,
3.1.1 and 5.0: what each answers, and that nothing refused reaches the router (so
neither subscribers nor the retained store), as Mosquitto 2.0.11 answers (the same
answers from the real broker: tests/test_mosquitto_retain_size_peer.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from servers.heartbeat.mqtt import encoders, packets
from servers.heartbeat.mqtt.effects import Accept, HoldInbound, ReleaseInbound, Send, TooLarge
from servers.heartbeat.mqtt.packets import ProtocolError
from servers.heartbeat.mqtt.policy import SessionPolicy
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.mqtt.reader import PacketReader
from servers.heartbeat.mqtt.session import Session, State
from servers.heartbeat.mqtt.v5.codec import pack, read_packets
from servers.heartbeat.mqtt.v5.packets import PUBACK, PUBREC, PUBREL, Ack, Connack, Connect, Disconnect, Publish, Will
from servers.heartbeat.mqtt.v5.reason_codes import PacketError, ReasonCode
from servers.heartbeat.mqtt.v5.session import Session5

R = ReasonCode
NO_RETAIN = SessionPolicy(retain_available=False)
LIMIT = SessionPolicy(message_size_limit=10)


def connect311(**kw: object) -> packets.Connect:
    (packet,) = PacketReader().feed(encoders.encode_connect(**kw))  # type: ignore[arg-type]
    assert isinstance(packet, packets.Connect)
    return packet


def session311(policy: SessionPolicy) -> Session:
    s = Session(policy)
    (accept,) = s.receive(connect311(client_id="dev"))
    assert isinstance(accept, Accept)
    s.accepted()
    return s


def session5(policy: SessionPolicy) -> tuple[Session5, Connack]:
    s = Session5(policy)
    (accept,) = s.receive(Connect("dev", 30))
    assert isinstance(accept, Accept)
    (connack,) = read_packets(s.accepted())
    assert isinstance(connack, Connack)
    return s, connack


def sent5(effects: Sequence[object]) -> list[object]:
    return [p for e in effects if isinstance(e, Send) for p in read_packets(e.data)]


def routed(effects: Sequence[object]) -> list[Publication]:
    return [e for e in effects if isinstance(e, Publication)]


# -- retain_available false ------------------------------------------------------------------


def test_by_default_retained_messages_are_taken_and_no_5_0_connack_mentions_them() -> None:
    s = session311(SessionPolicy())
    assert routed(s.receive(packets.Publish("t", b"x", retain=True))) == [Publication("t", b"x", 0, True)]
    s5, connack = session5(SessionPolicy())
    assert connack.properties.retain_available is None
    assert routed(s5.receive(Publish("t", b"x", retain=True))) == [Publication("t", b"x", 0, True)]


def test_a_retained_publish_closes_a_3_1_1_connection_unanswered() -> None:
    s = session311(NO_RETAIN)
    assert routed(s.receive(packets.Publish("t", b"x"))) == [Publication("t", b"x", 0, False)]
    with pytest.raises(ProtocolError) as caught:
        s.receive(packets.Publish("t", b"x", qos=1, retain=True, packet_id=3))
    assert caught.value.reason == "retain-not-supported"
    assert s.violated(caught.value) is None  # 3.1.1 has nothing to say it with: Mosquitto closes


def test_a_5_0_client_is_told_retain_is_unavailable_and_disconnected_0x9a_when_it_retains() -> None:
    s, connack = session5(NO_RETAIN)
    assert connack.properties.retain_available == 0
    for qos in (0, 1, 2):
        s, _ = session5(NO_RETAIN)
        with pytest.raises(PacketError) as caught:
            s.receive(Publish("t", b"x", qos=qos, retain=True, packet_id=qos or None))
        assert caught.value.code == R.RETAIN_NOT_SUPPORTED
        (goodbye,) = read_packets(s.violated(caught.value) or b"")
        assert isinstance(goodbye, Disconnect) and goodbye.reason_code == R.RETAIN_NOT_SUPPORTED
        assert s.reason_code == R.RETAIN_NOT_SUPPORTED and s.state is State.CLOSED


def test_a_retained_will_refuses_the_connect() -> None:
    s = Session(NO_RETAIN)
    with pytest.raises(ProtocolError) as caught:
        s.receive(connect311(client_id="d", will_topic="w", will_message=b"m", will_retain=True))
    assert s.violated(caught.value) is None  # Mosquitto closes a 3.1.1 client unanswered
    # An unretained Will is fine.
    (accept,) = Session(NO_RETAIN).receive(connect311(client_id="d", will_topic="w", will_message=b"m"))
    assert isinstance(accept, Accept) and accept.will is not None
    s5 = Session5(NO_RETAIN)
    with pytest.raises(PacketError) as caught5:
        s5.receive(Connect("d", 30, will=Will("w", b"m", retain=True)))
    (connack,) = read_packets(s5.violated(caught5.value) or b"")
    assert isinstance(connack, Connack) and connack.reason_code == R.RETAIN_NOT_SUPPORTED


# -- message_size_limit ----------------------------------------------------------------------


def test_3_1_1_a_payload_over_the_limit_is_acknowledged_and_dropped() -> None:
    s = session311(LIMIT)
    big = b"y" * 11
    assert s.receive(packets.Publish("t", big, retain=True)) == [TooLarge("t", 11)]
    assert s.receive(packets.Publish("t", big, qos=1, packet_id=6)) == [
        TooLarge("t", 11),
        Send(encoders.encode_puback(6)),
    ]
    assert s.receive(packets.Publish("t", big, qos=2, packet_id=7, retain=True)) == [
        TooLarge("t", 11),
        Send(encoders.encode_pubrec(7)),
    ]
    # Never held: its PUBREL gets a PUBCOMP and releases nothing, as Mosquitto answers it.
    assert s.inbound is None or 7 not in s.inbound
    assert s.receive(packets.Pubrel(7)) == [Send(encoders.encode_pubcomp(7))]
    # At the limit it goes, and an empty payload (a retained message's deletion) too.
    assert routed(s.receive(packets.Publish("t", b"y" * 10, qos=1, packet_id=8))) == [
        Publication("t", b"y" * 10, 1, False)
    ]
    assert routed(s.receive(packets.Publish("t", b"", retain=True))) == [Publication("t", b"", 0, True)]
    # The size is judged first, as Mosquitto: a too large payload on a reserved topic is TooLarge.
    assert s.receive(packets.Publish("$SYS/x", big)) == [TooLarge("$SYS/x", 11)]


def test_5_0_a_payload_over_the_limit_is_answered_0x97_and_the_exchange_ends() -> None:
    """0x97 (quota exceeded: an administrative limit), where Mosquitto sends 0x95, which
    MQTT 5 does not allow in a PUBACK or PUBREC (paho reads it as a malformed packet)."""
    s, connack = session5(LIMIT)
    assert connack.properties.retain_available is None
    big = b"y" * 11
    assert s.receive(Publish("t", big)) == [TooLarge("t", 11)]
    effects = s.receive(Publish("t", big, qos=1, packet_id=6))
    assert TooLarge("t", 11) in effects and not routed(effects)
    assert sent5(effects) == [Ack(PUBACK, 6, R.QUOTA_EXCEEDED)]
    effects = s.receive(Publish("t", big, qos=2, packet_id=7, retain=True))
    assert not routed(effects) and not any(isinstance(e, HoldInbound) for e in effects)
    assert sent5(effects) == [Ack(PUBREC, 7, R.QUOTA_EXCEEDED)]
    # A PUBREL for it anyway (the client should not send one) releases nothing.
    assert not any(isinstance(e, ReleaseInbound) for e in s.receive(Ack(PUBREL, 7)))
    effects = s.receive(Publish("t", b"y" * 10, qos=2, packet_id=8))
    assert routed(effects) == [Publication("t", b"y" * 10, 2, False)] and HoldInbound(8) in effects
    assert sent5(effects) == [Ack(PUBREC, 8)]


def test_a_will_over_the_limit_refuses_the_connect_5_or_0x95() -> None:
    s = Session(LIMIT)
    with pytest.raises(ProtocolError) as caught:
        s.receive(connect311(client_id="d", will_topic="w", will_message=b"m" * 11))
    assert s.violated(caught.value) == encoders.encode_connack(False, 5)
    (accept,) = Session(LIMIT).receive(connect311(client_id="d", will_topic="w", will_message=b"m" * 10))
    assert isinstance(accept, Accept)
    s5 = Session5(LIMIT)
    with pytest.raises(PacketError) as caught5:
        s5.receive(Connect("d", 30, will=Will("w", b"m" * 11)))
    assert s5.violated(caught5.value) == pack(Connack(False, R.PACKET_TOO_LARGE))
