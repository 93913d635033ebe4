"""The outbound QoS 1/2 bookkeeping (sans-IO): window, queue, acknowledgements, resends
with DUP after a reconnect, and the persistent session store that keeps it between
connections. A hypothesis model plays a client that acknowledges, vanishes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from servers.heartbeat.broker.outbox import Message, Outbox, Stage
from servers.heartbeat.broker.persistent import SessionStore
from servers.heartbeat.broker.reports import AckedTogether, Opened
from servers.heartbeat.mqtt.encoders import encode_held
from servers.heartbeat.mqtt.publication import Publication

from .mqtt_wire import parse_server_packets


def opened(store: SessionStore, client_id: str, clean: bool) -> Opened:
    """``store.open``, which refuses only past its bound (not reached here)."""
    result = store.open(client_id, clean)
    assert result is not None
    return result


def _msg(n: int, qos: int = 1) -> Message:
    return Message(f"t/{n}", f"m{n}".encode(), qos)


def test_window_then_queue_then_acks_release_in_order() -> None:
    box = Outbox(window=2, max_queued=10)
    sent = [p for n in range(5) for p in box.push(_msg(n))]
    assert [x.topic for x in parse_server_packets(sent)] == ["t/0", "t/1"]  # the window is full
    assert len(box) == 5 and len(box.queued()) == 3
    first, second = (m.packet_id for m in box.inflight())
    assert [x.topic for x in parse_server_packets(box.puback(second))] == ["t/2"]
    assert [x.topic for x in parse_server_packets(box.puback(first))] == ["t/3"]
    assert box.puback(first) == []  # acknowledged twice: nothing more
    assert box.puback(9999) == []


def test_a_refill_writes_what_encode_held_does_for_every_flag_and_length() -> None:
    """The refill encodes its commonest case inline: its bytes must be encode_held's,
    with retain and DUP (a message taken back into a queue after it was written), for
    topics that change or repeat, and for packets too long for a one-byte length."""
    cases = [
        ("a/b", b"x", 1, False, False),
        ("a/b", b"y", 2, True, False),
        ("a/b", b"z", 1, False, True),
        ("c", b"", 1, True, True),
        ("é/ü", b"p" * 119, 1, False, False),  # remaining length 127: the last one-byte
        ("é/ü", b"p" * 120, 1, False, False),  # 128: two bytes
        ("a/b", b"q" * 300, 2, True, True),
    ]
    box = Outbox(window=1, max_queued=100)
    [blocker] = box.push(Message("block", b"", 1))
    for topic, payload, qos, retain, sent in cases:
        message = Message(topic, payload, qos, retain)
        message.sent = sent
        assert box.push(message) == []  # behind the full window
    last = parse_server_packets([blocker])[0].packet_id
    box.window = len(cases)
    refill = box.puback(last)
    expected = [
        encode_held(topic, payload, qos, retain, m.packet_id, sent)
        for (topic, payload, qos, retain, sent), m in zip(cases, box.inflight(), strict=True)
    ]
    assert refill == expected
    assert len({m.packet_id for m in box.inflight()}) == len(cases)


def test_qos2_pubrec_gives_pubrel_and_pubcomp_completes() -> None:
    box = Outbox(window=1)
    [publish] = box.push(_msg(0, qos=2))
    [pkt] = parse_server_packets([publish])
    assert pkt.qos == 2 and not pkt.dup
    assert box.puback(pkt.packet_id) == []  # a PUBACK is not what QoS 2 waits for
    assert box.pubcomp(pkt.packet_id) == []  # nor a PUBCOMP before PUBREC
    assert box.pubrec(pkt.packet_id) == [bytes((0x62, 2, 0, pkt.packet_id))]
    box.push(_msg(1, qos=2))  # queued behind the one in flight
    [nxt] = parse_server_packets(box.pubcomp(pkt.packet_id))
    assert nxt.topic == "t/1"


def test_reconnect_resends_with_dup_and_pubrel_in_order() -> None:
    box = Outbox(window=3)
    for n in range(3):
        box.push(_msg(n, qos=2))
    ids = [m.packet_id for m in box.inflight()]
    box.pubrec(ids[1])  # the second one is past PUBREC
    box.detach()
    assert box.push(_msg(3)) == []  # away: queued
    resent = box.attach()
    assert resent[1] == bytes((0x62, 2, 0, ids[1]))  # PUBREL again, not the PUBLISH
    pkts = parse_server_packets([resent[0], resent[2]])
    assert [(p.topic, p.dup, p.packet_id) for p in pkts] == [("t/0", True, ids[0]), ("t/2", True, ids[2])]
    assert len(resent) == 3  # the window is full: t/3 waits
    assert [p.topic for p in parse_server_packets(box.pubcomp(ids[1]))] == ["t/3"]


def test_queue_bounds_drop_the_newest_and_count() -> None:
    box = Outbox(window=1, max_queued=2, max_queued_bytes=1000, attached=False)
    for n in range(4):
        box.push(_msg(n))
    assert [m.topic for m in box.queued()] == ["t/0", "t/1"] and box.dropped == 2
    small = Outbox(window=1, max_queued=100, max_queued_bytes=10, attached=False)
    small.push(Message("a", b"12345678", 1))
    small.push(Message("b", b"12345678", 1))  # 9 + 9 bytes > 10
    assert len(small) == 1 and small.dropped == 1 and small.queued_bytes == 9
    with pytest.raises(ValueError):
        box.push(_msg(9, qos=0))


def test_packet_ids_skip_those_in_flight() -> None:
    box = Outbox(window=3)
    for n in range(3):
        box.push(_msg(n))
    ids = [m.packet_id for m in box.inflight()]
    assert len(set(ids)) == 3 and all(1 <= i <= 65535 for i in ids)
    box.puback(ids[0])
    box.push(_msg(3))
    assert len({m.packet_id for m in box.inflight()}) == 3


# -- the client model ---------------------------------------------------------------


@dataclass
class _Client:
    """What a well-behaved client sees: it acknowledges any in-flight message it holds."""

    received: list[str] = field(default_factory=list)  # topics whose exchange completed, in order
    holding: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (topic, qos) not yet acked
    released: set[int] = field(default_factory=set)
    firsts: list[str] = field(default_factory=list)  # topics seen without DUP, in order

    def take(self, packets: list[bytes]) -> None:
        for data in packets:
            if data[0] & 0xF0 == 0x60:  # PUBREL
                self.released.add(int.from_bytes(data[2:4], "big"))
                continue
            [p] = parse_server_packets([data])
            assert p.packet_id not in self.holding or p.dup, "an id reused while in flight"
            if not p.dup:
                self.firsts.append(p.topic)
            self.holding[p.packet_id] = (p.topic, p.qos)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(1, 2)),
        st.tuples(st.just("ack"), st.integers(0, 30)),
        st.tuples(st.sampled_from(["detach", "attach"]), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 4), st.integers(0, 6))
def test_every_message_is_delivered_once_in_order_whatever_the_client_does(
    steps: list[tuple[str, int]], window: int, max_queued: int
) -> None:
    box = Outbox(window=window, max_queued=max_queued)
    client = _Client()
    connected = True
    pushed: list[str] = []
    for n, (op, arg) in enumerate(steps):
        if op == "push":
            before = box.dropped
            out = box.push(Message(f"t/{n}", b"x", arg))
            if box.dropped == before:
                pushed.append(f"t/{n}")
            if connected:
                client.take(out)
        elif op == "ack" and connected and client.holding:
            pid = sorted(client.holding)[arg % len(client.holding)]
            topic, qos = client.holding[pid]
            if qos == 1:
                out = box.puback(pid)
                done = True
            elif pid in client.released:
                out = box.pubcomp(pid)
                client.released.discard(pid)
                done = True
            else:
                out = box.pubrec(pid)
                done = False
            if done:
                del client.holding[pid]
                client.received.append(topic)
            client.take(out)
        elif op == "detach" and connected:
            box.detach()
            connected = False
        elif op == "attach" and not connected:
            connected = True
            client.take(box.attach())
        assert len(box.inflight()) <= window
        if connected:
            assert {m.packet_id for m in box.inflight()} == set(client.holding)
    # Drain: the client acknowledges everything left.
    if not connected:
        client.take(box.attach())
    for _ in range(3 * len(pushed) + 3):
        if not client.holding:
            break
        pid = min(client.holding, key=lambda i: [m.packet_id for m in box.inflight()].index(i))
        topic, qos = client.holding[pid]
        if qos == 2 and pid not in client.released:
            client.take(box.pubrec(pid))
            continue
        out = box.puback(pid) if qos == 1 else box.pubcomp(pid)
        client.released.discard(pid)
        del client.holding[pid]
        client.received.append(topic)
        client.take(out)
    assert client.firsts == pushed  # first sends in publish order
    assert sorted(client.received) == sorted(pushed) and len(client.received) == len(set(client.received))
    assert len(box) == 0


def _seen(packets: list[bytes], ids: dict[int, str]) -> list[tuple[str, str, bool]]:
    """What a client reads in ``packets``: each PUBLISH's topic and DUP, and each PUBREL's
    message by its topic (``ids``: packet id -> topic of what was in flight before)."""
    out = []
    for data in packets:
        if data[0] & 0xF0 == 0x60:
            out.append(("pubrel", ids[int.from_bytes(data[2:4], "big")], False))
        else:
            [p] = parse_server_packets([data])
            out.append(("publish", p.topic, p.dup))
    return out


batches = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(1, 2)),
        st.tuples(st.just("acks"), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=8)),
        st.tuples(st.sampled_from(["detach", "attach"]), st.just(0)),
    ),
    max_size=60,
)


@dataclass
class _Reference:
    """The outbox as the spec reads, by topic, with no packet ids: ``window`` in flight
    in send order, a queue of at most ``max_queued`` behind, refilled once a batch."""

    window: int
    max_queued: int
    attached: bool = True
    flight: list[list[object]] = field(default_factory=list)  # [topic, qos, released]
    queue: list[tuple[str, int]] = field(default_factory=list)
    dropped: int = 0

    def push(self, topic: str, qos: int) -> list[tuple[str, str, bool]]:
        if self.attached and not self.queue and len(self.flight) < self.window:
            self.flight.append([topic, qos, False])
            return [("publish", topic, False)]
        if len(self.queue) >= self.max_queued:
            self.dropped += 1
        else:
            self.queue.append((topic, qos))
        return []

    def acknowledge(self, acks: list[tuple[str, str | None]]) -> list[tuple[str, str, bool]]:
        out: list[tuple[str, str, bool]] = []
        freed = False
        for kind, topic in acks:
            entry = next((e for e in self.flight if e[0] == topic), None)
            if entry is None:
                continue
            if (kind == "puback" and entry[1] == 1) or (kind == "pubcomp" and entry[2]):
                self.flight.remove(entry)
                freed = True
            elif kind == "pubrec" and entry[1] == 2:
                entry[2] = True
                out.append(("pubrel", str(topic), False))
        return out + (self._fill() if freed else [])

    def attach(self) -> list[tuple[str, str, bool]]:
        self.attached = True
        resent = [("pubrel" if released else "publish", str(topic), not released) for topic, _, released in self.flight]
        return resent + self._fill()

    def _fill(self) -> list[tuple[str, str, bool]]:
        out = []
        while self.queue and len(self.flight) < self.window:
            topic, qos = self.queue.pop(0)
            self.flight.append([topic, qos, False])
            out.append(("publish", topic, False))
        return out


@settings(max_examples=300, deadline=None)
@given(batches, st.integers(1, 4), st.integers(0, 6), st.booleans())
@example([("push", 2), ("push", 1), ("push", 1), ("acks", [(0, 1), (1, 0)])], 2, 2, False)  # PUBREL, then refill
def test_acknowledgements_taken_together_release_what_the_reference_does(
    steps: list[tuple[str, object]], window: int, max_queued: int, one_by_one: bool
) -> None:
    """Outbox.acknowledge (or, with ``one_by_one``, puback/pubrec/pubcomp one call each)
    against a model with no packet ids: the PUBRELs, then the PUBLISHes that take the
    freed places, in order; the same messages left in flight and queued. Acknowledgements
    may be stale, repeated or of the wrong kind; packet ids stay unique in flight."""
    box = Outbox(window=window, max_queued=max_queued)
    model = _Reference(window, max_queued)
    kinds = ("puback", "pubrec", "pubcomp", "pubrec")
    for n, (op, arg) in enumerate(steps):
        if op == "push":
            assert isinstance(arg, int)
            assert _seen(box.push(Message(f"t/{n}", b"x", arg)), {}) == model.push(f"t/{n}", arg)
        elif op == "acks" and model.attached:
            assert isinstance(arg, list)
            ids = {m.packet_id: m.topic for m in box.inflight()}
            id_of = {topic: pid for pid, topic in ids.items()}
            flight = [m.topic for m in box.inflight()]
            # An index past the window names a message not in flight: a stale id.
            chosen = [(kinds[k], flight[i] if i < len(flight) else None) for i, k in arg]
            acks = [(kind, id_of[topic] if topic else 40000) for kind, topic in chosen]
            if one_by_one:
                # One call each refills after each. An id freed by one call may be
                # given at once to the next message, which a repeated ack then names.
                got: list[tuple[str, str, bool]] = []
                want: list[tuple[str, str, bool]] = []
                for kind, pid in acks:
                    now = {m.packet_id: m.topic for m in box.inflight()}
                    step = box.puback if kind == "puback" else box.pubrec if kind == "pubrec" else box.pubcomp
                    got += _seen(step(pid), now)
                    want += model.acknowledge([(kind, now.get(pid))])
            else:
                got = _seen(box.acknowledge(acks), ids)
                want = model.acknowledge(chosen)
            assert got == want
        elif op == "detach" and model.attached:
            box.detach()
            model.attached = False
        elif op == "attach" and not model.attached:
            ids = {m.packet_id: m.topic for m in box.inflight()}
            assert _seen(box.attach(), ids) == model.attach()
        assert [[m.topic, m.qos, m.stage is Stage.RELEASED] for m in box.inflight()] == model.flight
        assert [(m.topic, m.qos) for m in box.queued()] == model.queue
        assert box.dropped == model.dropped
        assert len({m.packet_id for m in box.inflight()}) == len(box.inflight())


def test_an_unknown_acknowledgement_kind_is_refused() -> None:
    box = Outbox(window=1)
    [publish] = box.push(_msg(0))
    [pkt] = parse_server_packets([publish])
    with pytest.raises(ValueError, match="not an acknowledgement"):
        box.acknowledge([("pubrel", pkt.packet_id)])


# -- the store ---------------------------------------------------------------------------


def test_store_keeps_a_persistent_session_and_clean_discards_it() -> None:
    store = SessionStore(window=2)
    assert not opened(store, "dev", clean=False).present
    store.subscribe("dev", "cmd/dev", 1)
    store.attach("dev", "e1")
    store.detach("dev", "e1", now=10.0)
    assert store.route(Publication("cmd/dev", b"a", 1)) == []  # away: queued
    assert store.route(Publication("cmd/dev", b"z", 0)) == []  # QoS 0 is not queued
    again = opened(store, "dev", clean=False)
    assert again.present and again.subscriptions == {"cmd/dev": 1}
    delivery = store.attach("dev", "e2")
    assert delivery is not None and [p.payload for p in parse_server_packets(delivery.packets)] == [b"a"]
    assert not opened(store, "dev", clean=True).present
    assert store.get("dev") is None and store.route(Publication("cmd/dev", b"b", 1)) == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["puback", "pubrec", "pubcomp"]), st.integers(0, 65535)), max_size=40),
    st.integers(0, 12),
)
def test_acknowledgements_reported_together_are_what_the_connection_read(
    acks: list[tuple[str, int]], queued: int
) -> None:
    """An AckedTogether report (one for a read's acknowledgements, from a worker to the
    sessions' owner) unpacks to the acknowledgements packed, in order, and the store
    applies it as acknowledge_all: the same refill from a twin store."""
    report = AckedTogether.pack("dev", "e1", acks)
    assert report.unpack() == acks
    stores = [SessionStore(window=4), SessionStore(window=4)]
    for store in stores:
        opened(store, "dev", clean=False)
        store.subscribe("dev", "cmd/dev", 1)
        store.attach("dev", "e1")
        for i in range(queued):
            store.route(Publication("cmd/dev", b"%d" % i, 1))
    # Acknowledge what is in flight too, not only the drawn (mostly stale) ids.
    inflight = [("puback", m.packet_id) for m in stores[0].get("dev").outbox.inflight()]  # type: ignore[union-attr]
    report = AckedTogether.pack("dev", "e1", inflight + acks)
    applied = stores[0].apply(report, now=0.0)
    direct = stores[1].acknowledge_all("dev", "e1", inflight + acks)
    assert applied == direct
    assert (applied is None) == (queued <= 4)  # a refill only where messages waited


def test_store_ignores_a_superseded_connection_and_expires_absent_sessions() -> None:
    store = SessionStore(expiry=100.0)
    opened(store, "dev", clean=False)
    store.subscribe("dev", "cmd/#", 2)
    store.attach("dev", "old")
    [d] = store.route(Publication("cmd/x", b"1", 2))
    pid = parse_server_packets(d.packets)[0].packet_id
    store.attach("dev", "new")  # reconnected before the old one's end was reported
    assert store.acknowledge("dev", "old", "pubrec", pid) is None
    store.detach("dev", "old", now=5.0)  # late report of the old connection: ignored
    assert store.get("dev") is not None and store.get("dev").holder == "new"  # type: ignore[union-attr]
    store.detach("dev", "new", now=10.0)
    assert store.expire(109.0) == []
    opened(store, "dev", clean=False)
    store.attach("dev", "newer")
    assert store.expire(200.0) == []  # back before its expiry
    store.detach("dev", "newer", now=300.0)
    assert store.expire(400.0) == ["dev"] and len(store) == 0 and store.expired == 1


def test_store_total_bound_drops_and_names_each_session_once() -> None:
    store = SessionStore(total_queued_bytes=30)
    for dev in ("a", "b"):
        opened(store, dev, clean=False)
        store.subscribe(dev, "t", 1)
    for _ in range(4):
        store.route(Publication("t", b"0123456789", 1))  # 11 bytes per copy
    assert store.queued_bytes <= 30 and store.dropped > 0
    assert sorted(store.newly_dropping) == ["a", "b"]


def test_a_bridges_session_is_queued_by_bytes_where_a_devices_is_also_by_count() -> None:
    # The server's own bridge carries what a remote broker is owed: no count bound, the
    # byte bound still holds. A device's session with the same bounds keeps 3.
    store = SessionStore(window=1, max_queued=3, max_queued_bytes=100, bridges=["local.edge"])
    for dev in ("local.edge", "dev"):
        opened(store, dev, clean=False)
        store.subscribe(dev, "t", 1)
    for _ in range(20):
        store.route(Publication("t", b"0123456789", 1))

    def held(client_id: str) -> int:
        session = store.get(client_id)
        assert session is not None
        return len(session.outbox.inflight()) + len(session.outbox.queued())

    assert held("dev") == 3  # away: all of it queued, none in flight
    assert 3 < held("local.edge") <= 100 // 10
    assert store.dropped == (20 - held("dev")) + (20 - held("local.edge"))


def test_store_qos2_inbound_ids_survive_in_the_session() -> None:
    store = SessionStore()
    opened(store, "dev", clean=False)
    store.hold_inbound("dev", 7)
    assert opened(store, "dev", clean=False).inbound == frozenset({7})
    store.release_inbound("dev", 7)
    assert opened(store, "dev", clean=False).inbound == frozenset()


def test_a_message_carries_dup_only_once_it_was_written() -> None:
    box = Outbox(window=1)
    [first] = box.push(Message("a/b", b"p", 1))
    box.detach()
    [again] = box.attach()
    one, two = parse_server_packets([first, again])
    assert (one.dup, two.dup) == (False, True) and one.packet_id == two.packet_id


def test_the_store_keeps_at_most_its_bound_of_sessions_and_a_stored_one_still_resumes() -> None:
    store = SessionStore(max_sessions=2)
    opened(store, "a", False)
    opened(store, "b", False)
    assert store.open("c", False) is None  # a third: refused
    assert store.refused == 1
    assert opened(store, "a", False).present  # stored ones resume
    store.discard("b")
    assert not opened(store, "c", False).present  # room again
