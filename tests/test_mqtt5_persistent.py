"""A lasting MQTT 5 session (Session Expiry > 0; issue 28): its subscriptions' options
are session state (§4.1), and the QoS 1 and 2 messages its store keeps, while the
device is connected or away, carry the publisher's properties, the Subscription
Identifiers, Retain As Published and No Local, and a Message Expiry counted down
while they wait. In the pure store, and through the server on one worker and on two
(where the supervisor keeps the sessions) and on a Redis fleet's gateway (where the
session script does), with raw 5.0 sockets."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from servers.heartbeat.broker.outbox import Message
from servers.heartbeat.broker.persistent import TAKEOVER_GRACE, SessionStore
from servers.heartbeat.broker.reports import Opened, Push
from servers.heartbeat.mqtt.filters import pack_options
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.mqtt.v5.codec import read_packets
from servers.heartbeat.mqtt.v5.outbound import forwarded, subscription_identifier
from servers.heartbeat.mqtt.v5.packets import PUBACK, Ack, Connect, Disconnect, Publish, Suback, Subscribe, Subscription
from servers.heartbeat.mqtt.v5.properties import Properties

from .redis_server import RedisServer
from .test_fleet import redis_server as redis_server  # the fixture, used by name
from .test_heartbeat_clients import Server
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name
from .test_mqtt5_retained import fleet_gateway
from .test_mqtt5_server import Raw5, raw5


def publishes(packets: list[bytes]) -> list[Publish]:
    out = [p for data in packets for p in read_packets(data)]
    assert all(isinstance(p, Publish) for p in out)
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------- the pure store


def test_a_5_0_session_keeps_properties_options_and_no_local() -> None:
    store = SessionStore()
    assert store.open("dev", False, 0.0, v5=True) is not None
    store.subscribe("dev", "cmd/#", 1, pack_options(no_local=True, retain_as_published=True, identifier=7))
    store.attach("dev", "e1")
    props = forwarded(Properties(content_type="text/plain", user_properties=(("k", "v"),)))
    (delivery,) = store.route(Publication("cmd/on", b"go", 1, True, props), "other")
    assert delivery.v5
    (got,) = publishes(delivery.packets)
    assert (got.topic, got.payload, got.retain) == ("cmd/on", b"go", True)  # Retain As Published
    assert got.properties.content_type == "text/plain" and got.properties.user_properties == (("k", "v"),)
    assert got.properties.subscription_identifiers == (7,)
    assert store.route(Publication("cmd/echo", b"mine", 1, False, props), "dev") == []  # No Local: its own
    assert store.get("dev") is not None and len(store.get("dev").outbox) == 1  # type: ignore[union-attr]
    # Its options come back with the session.
    store.detach("dev", "e1", 1.0)
    opened = store.open("dev", False, 2.0, v5=True)
    assert opened is not None and opened.present
    assert opened.options == {"cmd/#": pack_options(no_local=True, retain_as_published=True, identifier=7)}


def test_each_session_keeps_its_own_expiry_to_the_second() -> None:
    # MQTT 5.0 §3.1.2.11.2: the session outlives its connection by the client's interval
    # (the server's, ``expiry``, for 3.1.1); a client back later finds none, and what the
    # session held is counted as dropped with it.
    store = SessionStore(expiry=3600)
    assert store.open("short", False, 0.0, v5=True, expiry=5) == Opened(False, {}, frozenset())
    assert store.open("old", False, 0.0) is not None  # 3.1.1: the store's
    for client_id in ("short", "old"):
        store.subscribe(client_id, "cmd/#", 1)
        store.attach(client_id, "e1")
        store.detach(client_id, "e1", 10.0)
    store.route(Publication("cmd/x", b"m1", 1))
    store.route(Publication("cmd/y", b"m2", 1))
    assert store.expire(14.9) == []
    resumed = store.open("short", False, 12.0, v5=True, expiry=5)  # back in time: present
    assert resumed is not None and resumed.present and resumed.subscriptions == {"cmd/#": 1}
    store.attach("short", "e2", 5)
    store.detach("short", "e2", 20.0)  # away again, from 20: due at 25, to the second
    assert store.get("short") is not None and len(store.get("short").outbox) == 2  # type: ignore[union-attr]
    assert store.expire(24.99) == []
    late = store.open("short", False, 25.0, v5=True, expiry=5)  # due: gone, even unswept
    assert late is not None and not late.present and late.subscriptions == {}
    assert store.expired == 1 and store.expired_messages == 2  # its two queued messages went with it
    assert store.expire(3609.0) == ["short"]  # the new one, never attached: its 5 s from the open
    assert store.expire(3610.0) == ["old"]  # the 3.1.1 one lived the store's hour


def test_clean_start_0_with_expiry_0_resumes_and_the_session_ends_with_the_connection() -> None:
    store = SessionStore()
    # Nothing stored: a resume-only open makes nothing (the worker serves it as a clean session).
    assert store.open("dev", False, 0.0, v5=True, expiry=0, create=False) == Opened(False, {}, frozenset(), kept=False)
    assert len(store) == 0
    store.open("dev", False, 0.0, v5=True, expiry=60)
    store.subscribe("dev", "cmd/#", 1)
    store.attach("dev", "e1")
    store.detach("dev", "e1", 1.0)
    store.route(Publication("cmd/x", b"queued", 1))
    opened = store.open("dev", False, 2.0, v5=True, expiry=0, create=False)
    assert opened is not None and opened.present and opened.kept and opened.subscriptions == {"cmd/#": 1}
    delivery = store.attach("dev", "e2", 0)  # its CONNACK is out: expiry 0 from now on
    assert delivery is not None and [p.payload for p in publishes(delivery.packets)] == [b"queued"]
    store.detach("dev", "e2", 3.0)  # the connection ended: so did the session
    assert store.get("dev") is None and store.expired == 1 and store.expired_messages == 1  # never acknowledged


def test_a_disconnect_sets_the_expiry_and_0_ends_the_session_at_once() -> None:
    store = SessionStore()
    for client_id, expiry in (("ends", 0), ("longer", 100)):
        store.open(client_id, False, 0.0, v5=True, expiry=10)
        store.attach(client_id, "e1", 10)
        store.detach(client_id, "e1", 1.0, expiry)
    assert store.get("ends") is None
    assert store.expire(50.0) == [] and store.get("longer") is not None
    assert store.expire(101.0) == ["longer"]


def test_a_takeover_keeps_the_session_the_new_connection_resumed() -> None:
    # The old connection (expiry 0) still holds the session when the new one resumes it;
    # it ends after that open and before the new CONNACK. Its end must not end the session.
    store = SessionStore()
    store.open("dev", False, 0.0, v5=True, expiry=60)
    store.subscribe("dev", "cmd/#", 1)
    store.attach("dev", "old", 0)
    opened = store.open("dev", False, 5.0, v5=True, expiry=0, create=False)
    assert opened is not None and opened.present
    store.detach("dev", "old", 5.0)  # its Detach comes now
    assert store.expire(5.0 + TAKEOVER_GRACE - 1) == []
    assert store.get("dev") is not None
    store.attach("dev", "new", 0)
    assert store.get("dev").holder == "new"  # type: ignore[union-attr]
    store.detach("dev", "new", 70.0)
    assert store.get("dev") is None


def test_a_session_follows_the_version_its_client_comes_back_with() -> None:
    store = SessionStore()
    store.open("dev", False, 0.0, v5=False)
    store.subscribe("dev", "t/#", 1)
    props = forwarded(Properties(user_properties=(("a", "b"),)))
    assert store.route(Publication("t/1", b"x", 1, False, props)) == []  # away: queued, 3.1.1 has no room for them
    store.open("dev", False, 1.0, v5=True)  # back as 5.0
    delivery = store.attach("dev", "e2")
    assert delivery is not None and delivery.v5
    (got,) = publishes(delivery.packets)
    assert got.payload == b"x" and got.properties.user_properties == ()  # kept without them
    (live,) = store.route(Publication("t/2", b"y", 1, False, props))
    assert publishes(live.packets)[0].properties.user_properties == (("a", "b"),)
    # A retained message pushed for a new subscription keeps its own properties.
    pushed = store.apply(Push("dev", "t/r", b"r", 1, True, props + subscription_identifier(3)), 2.0)
    assert pushed is not None
    (retained,) = publishes(pushed.packets)
    assert retained.retain and retained.properties.subscription_identifiers == (3,)
    assert retained.properties.user_properties == (("a", "b"),)
    # Back as 3.1.1: what waits is written without properties.
    store.detach("dev", "e2", 3.0)
    store.open("dev", False, 4.0, v5=False)
    again = store.attach("dev", "e3")
    assert again is not None and not again.v5
    assert all(isinstance(m, Message) and m.properties is None for m in store.get("dev").outbox.inflight())  # type: ignore[union-attr]


# ---------------------------------------------------------------- through the server


def lasting(port: int, client_id: str) -> Raw5:
    return Raw5(port, Connect(client_id, 30, False, Properties(session_expiry_interval=600)))


@pytest.mark.parametrize("coordinator", ["one", "workers", "fleet"])
def test_a_lasting_5_0_session_gets_properties_and_identifiers_connected_or_away(
    start_server: Any, redis_server: RedisServer, tmp_path: Path, coordinator: str
) -> None:
    if coordinator == "fleet":  # the sessions are kept in Redis, by the session script
        server = fleet_gateway(redis_server, tmp_path, [])
    else:
        server = start_server(workers=2 if coordinator == "workers" else 1)
    try:
        lasting_session(server)
    finally:
        if coordinator == "fleet":
            server.proc.kill()  # by PID
            server.proc.wait()


def lasting_session(server: Server) -> None:
    dev = lasting(server.port, "lasting")
    options = {"no_local": True, "retain_as_published": True}
    dev.send(Subscribe(1, (Subscription("cmd/#", 1, **options),), Properties(subscription_identifiers=(7,))))
    assert dev.read() == Suback(1, (1,))
    time.sleep(0.3)  # the subscription reaches the store (the supervisor's, on two workers)
    pub = raw5(server.port, "commander")
    props = Properties(content_type="text/plain", user_properties=(("k", "v"),))
    pub.send(Publish("cmd/light", b"on", 1, retain=True, packet_id=1, properties=props))
    assert pub.read() == Ack(PUBACK, 1)
    (live,) = dev.publishes(1)
    dev.send(Publish("cmd/light", b"own", 1, packet_id=1))  # No Local: not sent back
    assert dev.read() == Ack(PUBACK, 1)
    assert (live.topic, live.payload, live.retain) == ("cmd/light", b"on", True)
    assert live.properties.content_type == "text/plain" and live.properties.user_properties == (("k", "v"),)
    assert live.properties.subscription_identifiers == (7,)
    dev.send(Ack(PUBACK, live.packet_id or 0))
    dev.sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        dev.read()  # its own message never comes back
    dev.send(Disconnect())
    dev.close()
    time.sleep(0.3)

    for i, expiry in enumerate((60, 1), start=2):
        away = Properties(message_expiry_interval=expiry, correlation_data=b"\x01")
        pub.send(Publish(f"cmd/q{i}", b"while away", 1, packet_id=i, properties=away))
        assert pub.read() == Ack(PUBACK, i)
    time.sleep(2.2)  # the second's lifetime runs out while it waits
    back = lasting(server.port, "lasting")
    assert back.connack.session_present
    (queued,) = back.publishes(1)
    assert queued.topic == "cmd/q2"  # cmd/q3 expired in the store
    assert queued.properties.correlation_data == b"\x01" and queued.properties.subscription_identifiers == (7,)
    assert queued.properties.message_expiry_interval in (57, 58)
    back.send(Ack(PUBACK, queued.packet_id or 0))
    # Its options came back with the session: a QoS 0 message, through the worker's broker.
    time.sleep(0.2)
    pub.send(Publish("cmd/zero", b"0"))
    (zero,) = back.publishes(1)
    assert zero.properties.subscription_identifiers == (7,)
