"""The sans-IO session: MQTT 3.1.1 packet order and replies, no sockets."""

from __future__ import annotations

import pytest

from servers.heartbeat.mqtt import encoders, packets
from servers.heartbeat.mqtt.effects import (
    Accept,
    Acknowledged,
    AddSubscription,
    Denied,
    Goodbye,
    HoldInbound,
    ReleaseInbound,
    RemoveSubscription,
    Send,
)
from servers.heartbeat.mqtt.packets import ProtocolError
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.policy import LEGACY_PRESENCE_PREFIX
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.mqtt.reader import PacketReader
from servers.heartbeat.mqtt.session import MAX_INBOUND_QOS2, Session, State


def connect(**kw: object) -> packets.Connect:
    (packet,) = PacketReader().feed(encoders.encode_connect(**kw))  # type: ignore[arg-type]
    assert isinstance(packet, packets.Connect)
    return packet


def test_handshake_then_packets() -> None:
    s = Session(max_qos=1)
    (accept,) = s.receive(connect(client_id="d1", keep_alive=30, will_topic="w", will_message=b"m"))
    assert isinstance(accept, Accept)
    assert (accept.client_id, accept.keep_alive, accept.assigned) == ("d1", 30, False)
    assert s.accepted() == encoders.encode_connack(False, 0)
    assert s.state is State.CONNECTED
    assert s.receive(packets.Pingreq()) == [Send(encoders.encode_pingresp())]
    assert s.receive(packets.Publish("a/b", b"x", qos=1, packet_id=9)) == [
        Publication("a/b", b"x", 1, False),
        Send(encoders.encode_puback(9)),
    ]
    assert s.receive(packets.Subscribe(4, (("p/#", 2), ("q", 0)))) == [
        AddSubscription("p/#", 1),
        AddSubscription("q", 0),
        Send(encoders.encode_suback(4, [1, 0])),
    ]
    assert s.receive(packets.Unsubscribe(5, ("q",))) == [RemoveSubscription("q"), Send(encoders.encode_unsuback(5))]
    assert s.will is not None
    assert s.receive(packets.Disconnect()) == [Goodbye()]
    assert s.will is None  # a clean goodbye discards the Will


def test_rules() -> None:
    with pytest.raises(ProtocolError, match="expected-connect"):
        Session().receive(packets.Pingreq())
    s = Session()
    s.receive(connect(client_id="x"))
    s.accepted()
    with pytest.raises(ProtocolError, match="second-connect"):
        s.receive(connect(client_id="x"))
    empty = Session()
    (accept,) = empty.receive(connect(client_id=""))
    assert isinstance(accept, Accept) and accept.assigned and accept.client_id.startswith("auto-")
    with pytest.raises(ProtocolError) as info:
        Session().receive(connect(client_id="", clean_session=False))
    assert info.value.connack_code == 2
    forger = Session()
    forger.receive(connect(client_id="f"))
    forger.accepted()
    assert forger.receive(packets.Publish(f"{PRESENCE}other", b"offline")) == [Denied(f"{PRESENCE}other")]
    assert forger.denied_publishes == 1


def test_limits_are_the_ones_given() -> None:
    s = Session(max_qos=0, presence_prefix="status/")
    s.receive(connect(client_id="d"))
    s.accepted()
    assert s.receive(packets.Publish("status/other", b"offline")) == [Denied("status/other")]
    assert s.denied_publishes == 1
    # Under another prefix, the old default's topics are a device's like any other.
    assert s.receive(packets.Publish(f"{LEGACY_PRESENCE_PREFIX}other", b"x", qos=1, packet_id=2)) == [
        Publication(f"{LEGACY_PRESENCE_PREFIX}other", b"x", 0, False),
        Send(encoders.encode_puback(2)),
    ]
    assert s.receive(packets.Subscribe(3, (("a", 1),))) == [
        AddSubscription("a", 0),
        Send(encoders.encode_suback(3, [0])),
    ]


def _connected(**kw: object) -> Session:
    s = Session()
    s.receive(connect(client_id="d"))
    s.accepted(**kw)  # type: ignore[arg-type]
    return s


def test_qos2_from_the_client_is_routed_once_until_pubrel() -> None:
    s = _connected()
    first = packets.Publish("a", b"x", qos=2, packet_id=7)
    assert s.receive(first) == [HoldInbound(7), Publication("a", b"x", 2, False), Send(encoders.encode_pubrec(7))]
    resent = packets.Publish("a", b"x", qos=2, packet_id=7, dup=True)  # PUBREC was lost
    assert s.receive(resent) == [Send(encoders.encode_pubrec(7))]  # acknowledged, not routed again
    assert s.receive(packets.Pubrel(7)) == [ReleaseInbound(7), Send(encoders.encode_pubcomp(7))]
    assert s.receive(packets.Pubrel(7)) == [Send(encoders.encode_pubcomp(7))]  # PUBCOMP was lost
    assert s.receive(first)[1] == Publication("a", b"x", 2, False)  # released: the id is free again


def test_a_resumed_session_remembers_its_held_qos2_ids() -> None:
    s = Session()
    s.receive(connect(client_id="d", clean_session=False))
    assert s.accepted(True, frozenset({3})) == encoders.encode_connack(True, 0)
    assert s.receive(packets.Publish("a", b"x", qos=2, packet_id=3, dup=True)) == [Send(encoders.encode_pubrec(3))]


def test_acknowledgements_of_what_the_server_sent_are_effects() -> None:
    s = _connected()
    assert s.receive(packets.Puback(1)) == [Acknowledged("puback", 1)]
    assert s.receive(packets.Pubrec(2)) == [Acknowledged("pubrec", 2)]
    assert s.receive(packets.Pubcomp(2)) == [Acknowledged("pubcomp", 2)]


class _Rules:
    def may_subscribe(self, topic_filter: str) -> bool:
        return topic_filter.startswith("mine/")

    def may_publish(self, topic: str) -> bool:
        return topic.startswith("mine/")

    def may_read(self, topic: str) -> bool:
        return topic.startswith("mine/")


def test_permissions_refuse_a_subscription_and_drop_a_publish() -> None:
    s = _connected()
    s.permissions = _Rules()
    assert s.receive(packets.Subscribe(4, (("mine/#", 1), ("theirs/#", 1)))) == [
        AddSubscription("mine/#", 1),
        Send(encoders.encode_suback(4, [1, 0x80])),
    ]
    assert s.receive(packets.Publish("theirs/x", b"1", qos=1, packet_id=2)) == [
        Denied("theirs/x"),
        Send(encoders.encode_puback(2)),
    ]
    assert s.denied_publishes == 1


def test_a_client_cannot_make_the_server_hold_qos2_ids_without_bound() -> None:
    s = _connected()
    for packet_id in range(1, MAX_INBOUND_QOS2 + 1):
        s.receive(packets.Publish("a", b"x", qos=2, packet_id=packet_id))
    with pytest.raises(ProtocolError, match="qos2-window"):
        s.receive(packets.Publish("a", b"x", qos=2, packet_id=MAX_INBOUND_QOS2 + 1))


def test_a_bridge_marked_connect_subscribes_with_no_local_and_retain_as_published() -> None:
    # Mosquitto's try_private: protocol level 0x84 (0x83 for 3.1). Its subscriptions
    # take what Mosquitto gives a bridge; a device's take none. It may write its state
    # under $SYS/broker/connection/, and no other $SYS topic.
    wire = encoders.encode_connect("edge", protocol_level=0x84, will_topic="$SYS/broker/connection/edge/state")
    (packet,) = PacketReader(1024).feed(wire)
    assert isinstance(packet, packets.Connect)
    assert (packet.protocol_level, packet.bridge) == (4, True)
    (old,) = PacketReader(1024).feed(encoders.encode_connect("old", protocol_level=0x83, protocol_name="MQIsdp"))
    assert isinstance(old, packets.Connect) and (old.protocol_level, old.bridge) == (3, True)
    bridge, device = Session(), Session()
    (accept,) = bridge.receive(packet)
    assert isinstance(accept, Accept) and accept.will is not None
    bridge.accepted()
    device.receive(connect(client_id="device"))
    device.accepted()
    assert bridge.receive(packets.Subscribe(1, (("up/#", 1),)))[0] == AddSubscription("up/#", 1, options=0b11)
    assert device.receive(packets.Subscribe(1, (("up/#", 1),)))[0] == AddSubscription("up/#", 1)
    assert bridge.receive(packets.Publish("$SYS/broker/connection/edge/state", b"1", retain=True))[0] == Publication(
        "$SYS/broker/connection/edge/state", b"1", 0, True
    )
    for topic in ("$SYS/broker/uptime", "$SYS/broker/connection/edge/other", f"{PRESENCE}x"):
        assert bridge.receive(packets.Publish(topic, b"1")) == [Denied(topic)]
