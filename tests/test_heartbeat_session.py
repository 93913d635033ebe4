"""The sans-IO session: MQTT 3.1.1 packet order and replies, no sockets."""

from __future__ import annotations

import pytest

from servers.heartbeat import codec
from servers.heartbeat.broker import Subscriptions
from servers.heartbeat.codec import ProtocolError
from servers.heartbeat.session import Accept, Goodbye, Route, Send, Session, State, Subscribe, Unsubscribe


def connect(**kw: object) -> codec.Connect:
    (packet,) = codec.PacketReader().feed(codec.encode_connect(**kw))  # type: ignore[arg-type]
    assert isinstance(packet, codec.Connect)
    return packet


def test_handshake_then_packets() -> None:
    s = Session()
    (accept,) = s.receive(connect(client_id="d1", keep_alive=30, will_topic="w", will_message=b"m"))
    assert isinstance(accept, Accept)
    assert (accept.client_id, accept.keep_alive, accept.assigned) == ("d1", 30, False)
    assert s.accepted() == codec.encode_connack(False, 0)
    assert s.state is State.CONNECTED
    assert s.receive(codec.Pingreq()) == [Send(codec.encode_pingresp())]
    assert s.receive(codec.Publish("a/b", b"x", qos=1, packet_id=9)) == [
        Route("a/b", b"x", 1, False),
        Send(codec.encode_puback(9)),
    ]
    assert s.receive(codec.Subscribe(4, (("p/#", 2), ("q", 0)))) == [
        Subscribe("p/#", 1),
        Subscribe("q", 0),
        Send(codec.encode_suback(4, [1, 0])),
    ]
    assert s.receive(codec.Unsubscribe(5, ("q",))) == [Unsubscribe("q"), Send(codec.encode_unsuback(5))]
    assert s.will is not None
    assert s.receive(codec.Disconnect()) == [Goodbye()]
    assert s.will is None  # a clean goodbye discards the Will


def test_rules() -> None:
    with pytest.raises(ProtocolError, match="expected-connect"):
        Session().receive(codec.Pingreq())
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
    assert forger.receive(codec.Publish("presence/other", b"offline")) == []
    assert forger.denied_publishes == 1


def test_subscriptions_route_exact_and_wildcards() -> None:
    subs: Subscriptions[str] = Subscriptions(max_qos=1)
    assert subs.subscribe("a", "presence/#", 2) == 1
    subs.subscribe("b", "presence/dev-1", 0)
    subs.subscribe("c", "other/+", 0)
    assert subs.route("presence/dev-1") == {"a": 1, "b": 0}
    assert subs.route("other/x") == {"c": 0}
    assert subs.route("other/x/y") == {}
    subs.drop("a")
    assert subs.route("presence/dev-1") == {"b": 0}
    assert subs.unsubscribe("b", "presence/dev-1")
    assert not subs.unsubscribe("b", "presence/dev-1")
    assert len(subs) == 1 and not subs.has("b")


def test_limits_are_the_ones_given() -> None:
    s = Session(max_qos=0, presence_prefix="status/")
    s.receive(connect(client_id="d"))
    s.accepted()
    assert s.receive(codec.Publish("status/other", b"offline")) == []
    assert s.denied_publishes == 1
    assert s.receive(codec.Publish("presence/other", b"x", qos=1, packet_id=2)) == [
        Route("presence/other", b"x", 0, False),
        Send(codec.encode_puback(2)),
    ]
    assert s.receive(codec.Subscribe(3, (("a", 1),))) == [Subscribe("a", 0), Send(codec.encode_suback(3, [0]))]
    assert Subscriptions[str](max_qos=0).subscribe("k", "a", 1) == 0
