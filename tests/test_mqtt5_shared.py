"""Shared subscriptions (``$share/<group>/<filter>``, MQTT 5 §4.8.2; issue 28): each
message to one member of each group, on one worker, across ``--workers 2`` and across
a Redis fleet's gateways; members that stop reading are passed over, and the QoS 1
messages a member leaves unacknowledged go to another. Presence consumers scale out
this way. Real clients: paho-mqtt (5.0 and 3.1.1) and raw 5.0 sockets."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.broker.budget import SendBudget
from servers.heartbeat.broker.outbox import Message
from servers.heartbeat.broker.routing import Broker
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.mqtt.v5.aliases import OutboundAliases
from servers.heartbeat.mqtt.v5.codec import read_packets
from servers.heartbeat.mqtt.v5.packets import PUBACK, Ack, Connect, Publish, Suback, Subscribe, Subscription
from servers.heartbeat.mqtt.v5.properties import Properties

from .redis_server import RedisServer
from .test_fleet import redis_server as redis_server  # the fixture, used by name
from .test_heartbeat_clients import ROOT, Server
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name
from .test_mqtt5_server import Paho5, Raw5
from .test_mqtt5_server import clients as clients  # the fixture, used by name
from .test_subscriber_bounds import FakeSubscriber


def wait_until(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def payloads(member: Paho5, prefix: str) -> list[bytes]:
    return [bytes(m.payload) for m in member.messages if m.topic.startswith(prefix)]


def spread(server: Server, members: list[Paho5], make: Any, workers: int, at_most: int = 16) -> None:
    """Connect members until every worker holds one (the kernel spreads connections)."""
    seen: set[int] = set()
    for i in range(at_most):
        member = make(i)
        members.append(member)
        name = m_name(member)
        (event,) = server.wait_for(lambda e, n=name: e.get("client_id") == n and e["status"] == "online")
        seen.add(int(str(event["worker"])))
        if len(seen) == workers and len(members) >= workers:
            return
    raise AssertionError(f"members reached only workers {seen}")


@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_each_message_goes_to_one_member_of_each_group(start_server: Any, clients: list[Paho5], engine: str) -> None:
    server: Server = start_server("--engine", engine)
    members = [
        Paho5(server.port, "m5-a").start(),
        Paho5(server.port, "m5-b").start(),
        Paho5(server.port, "m311-c", protocol=mqtt.MQTTv311).start(),  # Mosquitto serves $share to 3.1.1 too
    ]
    solo = Paho5(server.port, "solo").start()
    plain = Paho5(server.port, "plain").start()
    clients.extend([*members, solo, plain])
    for member in members:
        member.subscribe(("$share/workers/jobs/#", 1))
    solo.subscribe(("$share/audit/jobs/#", 1))
    plain.subscribe(("jobs/#", 1))
    device = Paho5(server.port, "producer").start()
    clients.append(device)
    sent = [f"job-{i}".encode() for i in range(30)]
    for body in sent:
        device.client.publish("jobs/x", body, qos=1).wait_for_publish(5)
    wait_until(lambda: sum(len(payloads(m, "jobs/")) for m in members) == 30, 10, "the group's 30 messages")
    wait_until(lambda: len(payloads(plain, "jobs/")) == 30 and len(payloads(solo, "jobs/")) == 30, 10, "the others")
    time.sleep(0.3)
    got = [p for m in members for p in payloads(m, "jobs/")]
    assert sorted(got) == sorted(sent)  # each exactly once across the group
    assert [len(payloads(m, "jobs/")) for m in members] == [10, 10, 10]  # in turn
    assert payloads(plain, "jobs/") == sent and payloads(solo, "jobs/") == sent  # every other subscriber: all


def test_members_on_two_workers_share_the_messages_and_the_presence(start_server: Any, clients: list[Paho5]) -> None:
    server: Server = start_server(workers=2)
    members: list[Paho5] = []

    def member(i: int) -> Paho5:
        made = Paho5(server.port, f"consumer-{i}").start()
        clients.append(made)
        made.subscribe(("$share/workers/jobs/#", 1), (f"$share/presence/{PRESENCE}#", 0))
        return made

    spread(server, members, member, workers=2)
    plain = Paho5(server.port, "plain").start()
    clients.append(plain)
    plain.subscribe(("jobs/#", 1))
    time.sleep(0.5)  # the shared filters reach the other worker
    device = Paho5(server.port, "producer").start()
    clients.append(device)
    sent = [f"job-{i}".encode() for i in range(40)]
    for body in sent:
        device.client.publish("jobs/x", body, qos=1).wait_for_publish(5)
    wait_until(lambda: sum(len(payloads(m, "jobs/")) for m in members) >= 40, 10, "the group's 40 messages")
    wait_until(lambda: len(payloads(plain, "jobs/")) >= 40, 10, "the plain subscriber's 40")
    time.sleep(0.5)
    got = [p for m in members for p in payloads(m, "jobs/")]
    assert sorted(got) == sorted(sent)  # once each, whichever worker
    assert payloads(plain, "jobs/") == sent  # once each too: a group's copy is the group's alone
    worker_of = {e["client_id"]: e["worker"] for e in server.events() if e["status"] == "online"}
    served = {worker_of[m_name(m)] for m in members if payloads(m, "jobs/")}
    assert len(served) == 2, "one worker's members got every message"
    # Presence: each device's online event once across the consumers.
    ids = [json.loads(m.payload)["client_id"] for c in members for m in c.messages if m.topic.startswith(PRESENCE)]
    counts = collections.Counter(ids)
    assert counts["producer"] == 1 and counts["plain"] == 1


def m_name(member: Paho5) -> str:
    return str(member.client._client_id.decode())


def test_a_member_that_stops_reading_is_passed_over_and_its_unacknowledged_go_to_another(
    start_server: Any, clients: list[Paho5]
) -> None:
    server: Server = start_server()
    stuck = Raw5(server.port, Connect("stuck", 30, properties=Properties(receive_maximum=2)))
    stuck.send(Subscribe(1, (Subscription("$share/g/q/#", 1),)))
    assert stuck.read() == Suback(1, (1,))
    healthy = Paho5(server.port, "healthy").start()
    clients.append(healthy)
    healthy.subscribe(("$share/g/q/#", 1))
    producer = Raw5(server.port, Connect("producer", 30))
    for i in range(6):
        producer.send(Publish("q/x", f"m{i}".encode(), qos=1, packet_id=i + 1))
        assert producer.read() == Ack(PUBACK, i + 1)
    got = stuck.publishes(2)  # it takes two and never acknowledges them
    wait_until(lambda: len(payloads(healthy, "q/")) >= 3, 5, "the healthy member's share")
    stuck.close()  # gone with two unacknowledged: they go to the other member
    wait_until(lambda: len(payloads(healthy, "q/")) == 6, 10, "every message at the healthy member")
    assert sorted(payloads(healthy, "q/")) == [f"m{i}".encode() for i in range(6)]  # the two passed on among them
    assert {p.payload for p in got} <= set(payloads(healthy, "q/"))


def test_members_on_two_gateways_share_messages_and_presence(
    redis_server: RedisServer, tmp_path: Path, clients: list[Paho5]
) -> None:
    gateways = []
    try:
        ports = []
        for i in range(2):
            port = free_port()
            log = tmp_path / f"gw{i}.jsonl"
            args = ["--cluster", redis_server.url, "--node", f"gw{i}", "--tick", "0.05", "--presence-log", str(log)]
            gateways.append(start_heartbeat(port, 1, args, cwd=str(ROOT)))
            ports.append(port)
        members = []
        for i, port in enumerate(ports * 2):
            member = Paho5(port, f"consumer-{i}").start()
            clients.append(member)
            member.subscribe(("$share/workers/jobs/#", 1), (f"$share/presence/{PRESENCE}#", 0))
            members.append(member)
        time.sleep(1.0)  # each gateway's filters reach the other through Redis
        device = Paho5(ports[0], "producer").start()
        clients.append(device)
        sent = [f"job-{i}".encode() for i in range(40)]
        for body in sent:
            device.client.publish("jobs/x", body, qos=1).wait_for_publish(5)
        wait_until(lambda: sum(len(payloads(m, "jobs/")) for m in members) >= 40, 15, "the group's 40 messages")
        time.sleep(0.5)
        got = [p for m in members for p in payloads(m, "jobs/")]
        assert sorted(got) == sorted(sent)
        by_gateway = [sum(len(payloads(m, "jobs/")) for m in members[g::2]) for g in range(2)]
        assert all(by_gateway), f"one gateway got every message: {by_gateway}"
        ids = [json.loads(m.payload)["client_id"] for c in members for m in c.messages if m.topic.startswith(PRESENCE)]
        assert collections.Counter(ids)["producer"] == 1  # its online event, once fleet-wide
    finally:
        for proc in gateways:
            proc.kill()  # by PID
            proc.wait()


class _Limits:
    max_packet_size = 0
    receive_maximum = 65535
    sent_aliases: OutboundAliases | None = None


def test_a_message_passed_on_from_a_3_1_1_member_reaches_a_5_0_member_in_5_0s_form() -> None:
    """Sans-IO: a shared subscription's message held for a 3.1.1 member (no properties)
    and passed on to a 5.0 member must be written as 5.0 (a property length), or the
    5.0 client misreads it."""
    budget: SendBudget[FakeSubscriber] = SendBudget(lambda s: s.queued(), lambda: 0.0, 1 << 20, 1 << 24)
    broker: Broker[FakeSubscriber] = Broker(2, budget)
    old, new = FakeSubscriber(), FakeSubscriber()
    new.v5 = _Limits()
    for sub in (old, new):
        broker.subscriptions.subscribe(sub, "$share/g/t/#", 1)
    broker.deliver(Publication("t/1", b"a", 1))  # the 3.1.1 member's turn: its outbox holds it without properties
    (held,) = old.held.inflight() if old.held else []
    assert held.properties is None and held.group == "$share/g/t/#"
    copy = Message(held.topic, held.payload, 1, held.retain, held.properties, held.group)
    assert broker.give_message(new, copy) == 1
    (packet,) = read_packets(new.sent[-1])
    assert packet == Publish("t/1", b"a", 1, packet_id=1)


@pytest.mark.parametrize("coordinator", ["workers", "fleet"])
def test_a_leaving_members_unacknowledged_go_to_a_member_on_another_worker_or_gateway(
    start_server: Any, clients: list[Paho5], redis_server: RedisServer, tmp_path: Path, coordinator: str
) -> None:
    """The only other member is elsewhere: the QoS 1 messages a member left
    unacknowledged (in flight and queued behind its Receive Maximum) cross to it."""
    gateways = []
    try:
        if coordinator == "fleet":
            ports = []
            for i in range(2):
                port = free_port()
                args = ["--cluster", redis_server.url, "--node", f"gw{i}", "--tick", "0.05"]
                args += ["--presence-log", str(tmp_path / f"gw{i}.jsonl")]
                gateways.append(start_heartbeat(port, 1, args, cwd=str(ROOT)))
                ports.append(port)
            stuck_port, healthy_port = ports
        else:
            server: Server = start_server(workers=2)
            healthy_probe = Paho5(server.port, "healthy").start()
            clients.append(healthy_probe)
            (seen,) = server.wait_for(lambda e: e.get("client_id") == "healthy" and e["status"] == "online")
            stuck_port = healthy_port = server.port
        healthy = clients[-1] if coordinator == "workers" else Paho5(healthy_port, "healthy").start()
        if coordinator == "fleet":
            clients.append(healthy)
        healthy.subscribe(("$share/g/q/#", 1))
        stuck: Raw5 | None = None
        for i in range(16):  # on another worker than the healthy member (the kernel spreads them)
            candidate = Raw5(stuck_port, Connect(f"stuck-{i}", 30, properties=Properties(receive_maximum=2)))
            if coordinator == "fleet":
                stuck = candidate
                break
            name = f"stuck-{i}"
            (event,) = server.wait_for(lambda e, n=name: e.get("client_id") == n and e["status"] == "online")
            if event["worker"] != seen["worker"]:
                stuck = candidate
                break
            candidate.close()
        assert stuck is not None, "every member landed on the healthy one's worker"
        stuck.send(Subscribe(1, (Subscription("$share/g/q/#", 1),)))
        assert stuck.read() == Suback(1, (1,))
        time.sleep(1.0)  # each side's filters reach the other (through Redis for the fleet)
        producer = Raw5(stuck_port, Connect("producer", 30))
        sent = [f"m{i}".encode() for i in range(12)]
        for i, body in enumerate(sent):
            producer.send(Publish("q/x", body, qos=1, packet_id=i + 1))
            assert producer.read() == Ack(PUBACK, i + 1)
        got = stuck.publishes(2)  # it takes two and never acknowledges them; more wait behind
        wait_until(lambda: len(payloads(healthy, "q/")) >= 4, 10, "the healthy member's share")
        stuck.close()
        try:
            wait_until(lambda: len(payloads(healthy, "q/")) >= 12, 15, "every message at the healthy member")
        except AssertionError as exc:
            # Rare (2 fresh suites of 18 on record, never alone): say which are missing.
            arrived = payloads(healthy, "q/")
            missing = sorted(set(sent) - set(arrived))
            taken = [p.payload for p in got]
            raise AssertionError(
                f"{exc}: {len(arrived)} arrived; missing {missing}; the stuck member took {taken}"
            ) from exc
        assert sorted(payloads(healthy, "q/")) == sorted(sent)
        assert {p.payload for p in got} <= set(payloads(healthy, "q/"))
    finally:
        for proc in gateways:
            proc.kill()  # by PID
            proc.wait()
