"""Bytes queued for subscribers are bounded, per subscriber and per worker (issue 11,
item 1): the byte budget's rules as pure logic (a fake clock; hypothesis against a
model of the engine's queues), the broker applying them, and the server as its own
process on both engines, with raw-socket subscribers that never read and a publisher
sending 256 KiB QoS 0 messages. The process tests run on the wall clock and assert
no timings; every server is stopped by its PID (the ``start_server`` fixture)."""

from __future__ import annotations

import socket
import threading
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servers.heartbeat.broker.budget import SUBSCRIBER_BYTES, TOTAL_BYTES, Offer, SendBudget
from servers.heartbeat.broker.outbox import Outbox
from servers.heartbeat.broker.routing import EXPIRED, MAX_QUEUED, TOO_LARGE, Broker, Limits5
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.publication import Publication

from .conftest import wait_closed
from .test_heartbeat_clients import Server, start_server
from .test_mqtt_state import Raw

__all__ = ["start_server"]  # the fixture, used here by name

ENGINES = ["dense", "streams"]
KIB = 1024
MIB = 1024 * 1024
PINGRESP = b"\xd0\x00"


class Clock:
    """A clock the test moves by hand (the budget reads it only when it drops)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Queues:
    """What an engine holds per subscriber: the budget's ``measure``."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def __call__(self, key: str) -> int:
        return self.held.get(key, 0)


def budget(
    per: int = 100, total: int = 1000, grace: float = 30.0, recount_every: float = 0.0
) -> tuple[SendBudget[str], Queues, Clock]:
    queues, clock = Queues(), Clock()
    return SendBudget(queues, clock, per, total, grace, recount_every=recount_every), queues, clock


def queue(b: SendBudget[str], queues: Queues, key: str, size: int, held: bool = False) -> Offer:
    """Offer a packet as the broker does; if it is let in, the engine holds it."""
    verdict = b.offer(key, queues(key), size, held=held)
    if verdict is Offer.QUEUE:
        queues.held[key] = queues(key) + size
        b.settle(key, queues(key))
    return verdict


# -- the budget's rules ------------------------------------------------------------------


def test_a_qos0_message_past_the_subscriber_bound_is_dropped_and_counted() -> None:
    b, q, _ = budget(per=100)
    assert [queue(b, q, "s", 30) for _ in range(3)] == [Offer.QUEUE] * 3
    assert queue(b, q, "s", 30) is Offer.DROP  # 90 + 30 > 100
    assert queue(b, q, "s", 10) is Offer.QUEUE  # 100 fits exactly
    assert q("s") == 100 and b.peak_subscriber == 100
    assert b.dropped == {SUBSCRIBER_BYTES: 1}
    assert b.backlog("s") == 130 and b.behind == 1


def test_an_empty_queue_takes_one_message_larger_than_the_bound() -> None:
    b, q, _ = budget(per=100)
    assert queue(b, q, "s", 150) is Offer.QUEUE  # a bound below the largest packet starves nobody
    assert queue(b, q, "s", 1) is Offer.DROP
    q.held["s"] = 0  # it read everything
    assert queue(b, q, "s", 150) is Offer.QUEUE


def test_held_packets_are_never_dropped_and_past_the_hard_cap_cut() -> None:
    b, q, _ = budget(per=100)
    queue(b, q, "s", 100)
    assert [queue(b, q, "s", 2, held=True) for _ in range(50)] == [Offer.QUEUE] * 50  # PINGRESPs at the bound
    assert q("s") == 200 and b.dropped == {}
    assert queue(b, q, "s", 1, held=True) is Offer.CUT  # 201 > 2 x 100
    assert [(key, why.split(",")[0]) for key, why in b.take_cut()] == [("s", "200 bytes queued")]
    assert b.take_cut() == [] and b.cuts == 1 and b.total == 0


def test_a_subscriber_that_loses_a_whole_bound_in_one_stretch_is_cut() -> None:
    b, q, _ = budget(per=100)
    queue(b, q, "s", 100)
    verdicts = [queue(b, q, "s", 25) for _ in range(5)]
    # 100 queued + 100 dropped is the hard cap; the next drop passes it.
    assert verdicts == [Offer.DROP] * 4 + [Offer.CUT]
    ((key, why),) = b.take_cut()
    assert key == "s" and "100 bytes queued and 125 dropped" in why
    assert b.dropped == {SUBSCRIBER_BYTES: 5}


def test_a_subscriber_behind_for_longer_than_the_grace_is_cut() -> None:
    b, q, clock = budget(per=100, grace=30.0)
    queue(b, q, "s", 100)
    assert queue(b, q, "s", 10) is Offer.DROP  # behind from now
    q.held["s"] = 60  # it reads, slowly: still over half its bound
    clock.now = 30.0
    assert queue(b, q, "s", 50) is Offer.DROP  # 60 + 50 > 100; behind for exactly the grace
    clock.now = 30.5
    assert queue(b, q, "s", 50) is Offer.CUT
    ((_, why),) = b.take_cut()
    assert "behind for 30.5 s" in why


def test_a_subscriber_that_catches_up_is_forgiven() -> None:
    b, q, clock = budget(per=100, grace=30.0)
    queue(b, q, "s", 100)
    for _ in range(3):
        assert queue(b, q, "s", 30) is Offer.DROP
    q.held["s"] = 50  # half its bound: caught up
    clock.now = 100.0
    assert queue(b, q, "s", 30) is Offer.QUEUE
    assert b.behind == 0 and b.backlog("s") == 80
    assert queue(b, q, "s", 30) is Offer.DROP  # 80 + 30: a new stretch begins, not cut
    assert b.take_cut() == []


def test_the_worker_total_drops_and_sheds_only_the_largest_holder_behind() -> None:
    b, q, _ = budget(per=100, total=250)
    queue(b, q, "a", 100)
    queue(b, q, "b", 90)
    queue(b, q, "c", 40)
    assert b.total == 230
    # Nobody is behind yet: the message is dropped, nobody is cut.
    assert queue(b, q, "c", 30) is Offer.DROP
    assert b.dropped == {TOTAL_BYTES: 1} and b.take_cut() == []
    # "a" (the largest) falls behind on its own bound, then the worker is full again.
    assert queue(b, q, "a", 10) is Offer.DROP
    assert queue(b, q, "d", 30) is Offer.DROP  # d keeps up: dropped, never cut
    assert [key for key, _ in b.take_cut()] == ["a"]
    q.held["a"] = 0  # the engine closed it
    assert b.total == 130 and queue(b, q, "d", 30) is Offer.QUEUE
    assert b.dropped == {TOTAL_BYTES: 2, SUBSCRIBER_BYTES: 1}
    assert b.peak_total == 230


def test_a_subscriber_that_caught_up_unseen_is_not_shed() -> None:
    b, q, _ = budget(per=100, total=100)
    queue(b, q, "a", 100)
    assert queue(b, q, "a", 90) is Offer.DROP  # behind by 190
    q.held["a"] = 40  # it read, and the engine did not say so
    queue(b, q, "b", 30)
    queue(b, q, "c", 30)
    # The worker is full on a recount; "a" holds the most, but it is keeping up now.
    assert queue(b, q, "d", 40) is Offer.DROP
    assert b.take_cut() == [] and b.behind == 0


def test_a_stale_total_is_recounted_at_most_every_so_often() -> None:
    b, q, clock = budget(per=100, total=200, recount_every=0.05)
    queue(b, q, "a", 100)
    queue(b, q, "b", 100)
    q.held["a"] = q.held["b"] = 0  # drained without the engine saying so
    assert b.total == 200
    assert queue(b, q, "c", 50) is Offer.QUEUE  # recounted: the worker is nearly empty
    assert b.total == 50 and len(b) == 1
    queue(b, q, "a", 100)
    queue(b, q, "b", 50)
    q.held["a"] = q.held["b"] = 0
    assert queue(b, q, "c", 50) is Offer.DROP  # too soon to look again: the stale total stands
    clock.now = 0.05
    assert queue(b, q, "c", 50) is Offer.QUEUE


def test_forget_takes_a_subscriber_out_of_the_total() -> None:
    b, q, _ = budget()
    queue(b, q, "a", 60)
    queue(b, q, "a", 60)
    queue(b, q, "b", 10)
    b.forget("a")
    assert b.total == 10 and len(b) == 1 and b.backlog("a") == 0


def test_the_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SendBudget(Queues(), Clock(), 0, 10)
    with pytest.raises(ValueError, match="hard cap"):
        SendBudget(Queues(), Clock(), 10, 10, hard_factor=0)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), st.sampled_from("abcd"), st.integers(1, 120), st.booleans()),
        st.tuples(st.just("drain"), st.sampled_from("abcd"), st.integers(0, 200), st.booleans()),
        st.tuples(st.just("tick"), st.just(""), st.integers(0, 20), st.just(False)),
        st.tuples(st.just("end"), st.sampled_from("abcd"), st.just(0), st.just(False)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 150), st.integers(1, 500))
def test_the_budget_against_a_model_of_the_engine_queues(
    ops: list[tuple[str, str, int, bool]], per: int, total: int
) -> None:
    b, q, clock = budget(per=per, total=total, grace=30.0, recount_every=3.0)
    drops = 0
    for op, key, n, flag in ops:
        if op == "offer":
            held = flag
            queued = q(key)
            verdict = b.offer(key, queued, n, held=held)
            if verdict is Offer.QUEUE:
                q.held[key] = queued + n
                b.settle(key, q(key))
                if not held:
                    # Within the subscriber's bound (or the one message an empty queue takes),
                    # and the worker's total after it within the worker's bound.
                    assert q(key) <= per or queued == 0
                    assert b.total <= total
            else:
                assert not held or verdict is Offer.CUT  # held packets are never dropped
                if held:
                    assert queued + n > b.hard and queued > per // 2
                else:
                    drops += 1
                if verdict is Offer.DROP:
                    assert b.backlog(key) <= b.hard
            for cut, _ in b.take_cut():
                # Only a subscriber holding over half its bound is ever cut.
                assert q(cut) > per // 2
                q.held[cut] = 0  # the engine closes it
        elif op == "drain":
            q.held[key] = max(0, q(key) - n)
            if flag:  # the engine says so (a streams writer, a dense resume_writing)
                b.settle(key, q(key))
        elif op == "tick":
            clock.now += n
        else:
            b.forget(key)
            q.held[key] = 0
        # The total is an upper bound of what the engine holds, and the sum of what it knows.
        assert b.total >= sum(q.held.values())
        assert b.total == sum(b._queued.values())
    assert sum(b.dropped.values()) == drops


# -- the broker -----------------------------------------------------------------------


class FakeSubscriber:
    """A subscriber whose queue never drains (a client that does not read)."""

    def __init__(self) -> None:
        self.persistent = False
        self.held: Outbox | None = None
        self.sent: list[bytes] = []
        self.cut: list[str] = []
        self.v5: Limits5 | None = None

    def push(self, data: bytes, *, held: bool = False) -> None:
        self.sent.append(data)

    def queued(self) -> int:
        return sum(map(len, self.sent))

    def overflow(self, detail: str) -> None:
        self.cut.append(detail)

    def may_read(self, topic: str) -> bool:
        return True


def test_the_broker_drops_qos0_keeps_replies_and_cuts_a_subscriber_that_lost_a_bound() -> None:
    clock = Clock()
    b: SendBudget[FakeSubscriber] = SendBudget(lambda s: s.queued(), clock, 1000, 10_000)
    broker: Broker[FakeSubscriber] = Broker(2, b, window=2, max_queued=1)
    stuck, healthy = FakeSubscriber(), FakeSubscriber()
    broker.subscriptions.subscribe(stuck, "t", 1)
    broker.subscriptions.subscribe(healthy, "t", 0)
    assert len(encoders.encode_publish("t", b"x" * 95)) == 100
    healthy_got = 0

    def deliver(payload: bytes, qos: int) -> None:
        nonlocal healthy_got
        broker.deliver(Publication("t", payload, qos))
        healthy_got += len(healthy.sent)
        healthy.sent.clear()  # it reads

    for _ in range(10):
        deliver(b"x" * 95, 0)
    assert stuck.queued() == 1000 and broker.dropped == 0
    deliver(b"x" * 95, 0)
    assert broker.dropped_by == {SUBSCRIBER_BYTES: 1, TOTAL_BYTES: 0, MAX_QUEUED: 0, TOO_LARGE: 0, EXPIRED: 0}
    assert stuck.cut == []
    # The replies to its own packets, and QoS 1 messages its outbox releases, still go out.
    broker.write(stuck, [PINGRESP, encoders.encode_suback(2, [0])])
    deliver(b"y", 1)
    deliver(b"z", 1)
    deliver(b"w", 1)  # its outbox: two in flight, one queued
    deliver(b"v", 1)  # and this one beyond its queue
    assert stuck.sent[10] == PINGRESP + encoders.encode_suback(2, [0])  # in one piece, in order
    assert [p[0] & 0xF6 for p in stuck.sent[11:]] == [0x32, 0x32]  # two QoS 1 PUBLISHes
    assert broker.dropped_by == {SUBSCRIBER_BYTES: 1, TOTAL_BYTES: 0, MAX_QUEUED: 1, TOO_LARGE: 0, EXPIRED: 0}
    # Another bound's worth lost: it is cut, once, and says why.
    for _ in range(10):
        deliver(b"x" * 95, 0)
    assert len(stuck.cut) == 1 and "dropped since it fell behind" in stuck.cut[0]
    assert b.cuts == 1 and broker.dropped == 11 + 1
    assert healthy_got == 11 + 4 + 10  # the healthy one lost nothing


# -- the server as a process, on both engines ---------------------------------------------

PAYLOAD = 256 * KIB
BOUND = 4 * MIB


def metrics(server: Server) -> dict[str, float]:
    """Every sample of ``/metrics``, by its name and labels as printed."""
    assert server.status_port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{server.status_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sample(server: Server, name: str, **labels: str) -> float:
    """One family's samples summed, those with ``labels`` only."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        value for key, value in metrics(server).items() if key.split("{", 1)[0] == name and all(w in key for w in want)
    )


def peak_rss(pid: int) -> int:
    """The process's peak resident set so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def stuck_subscriber(port: int, client_id: str, topic_filter: str = "feed") -> socket.socket:
    """A client that subscribes, then never reads again (a small receive buffer, so the
    kernel takes little of what is meant for it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KIB)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(encoders.encode_connect(client_id, keep_alive=60))
    assert sock.recv(4) == encoders.encode_connack(False, 0)
    sock.sendall(encoders.encode_subscribe(1, [(topic_filter, 0)]))
    assert sock.recv(5) == encoders.encode_suback(1, [0])
    return sock


def message(seq: int, size: int = PAYLOAD) -> bytes:
    """A QoS 0 PUBLISH on ``feed`` whose payload (``size`` bytes, at least 4) starts with ``seq``."""
    return encoders.encode_publish("feed", seq.to_bytes(4, "big") + bytes(size - 4))


def seq_of(packet: bytes) -> int:
    """The sequence number of a QoS 0 PUBLISH made by :func:`message`."""
    assert packet[0] == 0x30, packet[:8]
    i = 1
    while packet[i] & 0x80:  # the remaining length's varint
        i += 1
    start = i + 3 + int.from_bytes(packet[i + 1 : i + 3], "big")
    return int.from_bytes(packet[start : start + 4], "big")


def offline_events(server: Server, client_id: str) -> list[dict[str, object]]:
    return [e for e in server.events() if e["client_id"] == client_id and e["status"] == "offline"]


def synced_publish(pub: Raw, data: bytes) -> None:
    """Publish, then ping: once PINGRESP is back, the server has routed the message."""
    pub.send(data + encoders.encode_pingreq())
    assert pub.read_packet() == PINGRESP


@pytest.mark.parametrize("engine", ENGINES)
def test_a_subscriber_that_never_reads_is_bounded_and_cut_while_a_healthy_one_gets_everything(
    start_server: object, engine: str
) -> None:
    server: Server = start_server(  # type: ignore[operator]
        "--engine", engine, "--max-packet-size", str(MIB), "--max-subscriber-bytes", str(BOUND), status=True
    )
    stuck = stuck_subscriber(server.port, "stuck")
    healthy = Raw(server.port, "healthy")
    assert healthy.subscribe("feed", 0) == encoders.encode_suback(1, [0])
    pub = Raw(server.port, "publisher")
    before = peak_rss(server.proc.pid)
    count = 320  # 80 MiB: unbounded, the stuck subscriber's queue would hold nearly all of it
    for seq in range(count):
        pub.send(message(seq))
        assert seq_of(healthy.read_packet()) == seq  # in order, nothing lost
    # Cut off, as for any other end: exactly one offline event, with its reason.
    (event,) = server.wait_for(lambda e: e["client_id"] == "stuck" and e["status"] == "offline")
    assert event["reason"] == "send-overflow"
    wait_closed(stuck, 5.0)
    growth = peak_rss(server.proc.pid) - before
    assert growth < 32 * MIB, f"peak RSS grew by {growth / MIB:.1f} MiB"
    assert sample(server, "heartbeat_subscriber_bytes_peak") <= BOUND
    assert sample(server, "heartbeat_messages_dropped_total", reason="subscriber-bytes") >= 1
    assert sample(server, "heartbeat_offline_total", reason="send-overflow") == 1
    assert sample(server, "heartbeat_outbox_bytes") <= BOUND
    # The healthy one is still served, and heard the stuck one's end only once.
    healthy.send(encoders.encode_pingreq())
    assert healthy.read_packet() == PINGRESP
    assert len(offline_events(server, "stuck")) == 1
    assert offline_events(server, "healthy") == []
    for c in (healthy, pub):
        c.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_worker_total_bounds_every_subscriber_together(start_server: object, engine: str) -> None:
    total = 6 * MIB
    server: Server = start_server(  # type: ignore[operator]
        "--engine",
        engine,
        "--max-packet-size",
        str(MIB),
        "--max-subscriber-bytes",
        str(BOUND),
        "--max-outbox-bytes",
        str(total),
        status=True,
    )
    stuck = [stuck_subscriber(server.port, f"stuck-{i}") for i in range(2)]
    healthy = Raw(server.port, "healthy")
    assert healthy.subscribe("feed", 0) == encoders.encode_suback(1, [0])
    got: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seq = seq_of(healthy.read_packet())
            got.append(seq)
            if seq == 9999:
                done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pub = Raw(server.port, "publisher")
    for seq in range(200):  # 50 MiB, paced by the server's replies
        synced_publish(pub, message(seq))
    for i in range(2):
        (event,) = server.wait_for(lambda e, i=i: e["client_id"] == f"stuck-{i}" and e["status"] == "offline")
        assert event["reason"] == "send-overflow"
    synced_publish(pub, message(9999))  # with both gone, the healthy one gets what follows
    assert done.wait(10)
    reader.join(5)
    assert got == sorted(set(got)) and got[-1] == 9999  # in order, never twice
    assert sample(server, "heartbeat_messages_dropped_total", reason="total-bytes") >= 1
    assert sample(server, "heartbeat_outbox_bytes_peak") <= total
    assert sample(server, "heartbeat_subscriber_bytes_peak") <= BOUND
    assert sample(server, "heartbeat_offline_total", reason="send-overflow") == 2
    for sock in stuck:
        wait_closed(sock, 5.0)
    healthy.send(encoders.encode_pingreq())
    assert healthy.read_packet() == PINGRESP
    for c in (healthy, pub):
        c.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_subscriber_at_its_bound_still_gets_its_pingresp_and_suback(start_server: object, engine: str) -> None:
    server: Server = start_server(  # type: ignore[operator]
        "--engine", engine, "--max-packet-size", str(MIB), "--max-subscriber-bytes", str(BOUND), status=True
    )
    slow = stuck_subscriber(server.port, "slow")
    pub = Raw(server.port, "publisher")
    seq = 0
    dropped: list[int] = []
    # Filled to the byte: 256 KiB messages until one is dropped, then each size halved
    # until one of it is dropped too, down to 12-byte packets; fewer than 12 bytes are left.
    for size in [PAYLOAD >> k for k in range(17)]:
        while True:
            assert seq < 200, "never reached its bound"
            synced_publish(pub, message(seq, max(size, 4)))
            seq += 1
            if sample(server, "heartbeat_messages_dropped_total", reason="subscriber-bytes") > len(dropped):
                dropped.append(seq - 1)
                break
    # At its bound, it asks for ten pings and a second subscription: 25 bytes of replies.
    slow.sendall(encoders.encode_pingreq() * 10 + encoders.encode_subscribe(2, [("other", 0)]))
    client = Raw.__new__(Raw)  # read it with Raw's packet reader, as it is
    client.sock, client.pending = slow, b""
    seqs: list[int] = []
    while (packet := client.read_packet())[0] == 0x30:
        seqs.append(seq_of(packet))
    assert [packet] + [client.read_packet() for _ in range(9)] == [PINGRESP] * 10
    assert client.read_packet() == encoders.encode_suback(2, [0])
    # In order; only those that found it full were dropped.
    assert seqs == [s for s in range(seq) if s not in dropped]
    assert offline_events(server, "slow") == []  # not cut: it lost less than a bound
    client.send(encoders.encode_pingreq())
    assert client.read_packet() == PINGRESP
    pub.close()
    client.close()
