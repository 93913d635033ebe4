"""What crosses the supervisor's bus is applied exactly once: a numbered frame (a
session report, a retained message, a QoS 1 or 2 message routed to other workers)
is resent after a dropped link until acknowledged, and the authority applies each
worker's numbers once, however many times they arrive.

Issue 27 looked for a lost QoS 1 message on this path. The unit tests drive the
authority with frames as a worker's link would bring them; the cluster test runs
real links through a real hub, on the wall clock, each wait bounded."""

from __future__ import annotations

import socket

import trio

from servers.bus import Hub, Link
from servers.heartbeat.broker.reports import Attach, Detach, Push, Subscribed
from servers.heartbeat.coordination.authority import Authority
from servers.heartbeat.coordination.frames import (
    Ack,
    Claimed,
    Evict,
    Frame,
    Hello,
    OpenSession,
    Probe,
    Probed,
    Reported,
    Routed,
    SessionOpened,
    Transmit,
    decode,
    encode,
)
from servers.heartbeat.coordination.local import BusCoordinator
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.presence.event import PresenceEvent

from .coordinator_cluster import local_cluster
from .test_coordinators import until

PID = 4242


class FakeLink(Link):
    """A link whose lines are kept, for an authority driven without a hub."""

    def __init__(self, number: int, pid: int = PID) -> None:
        self.number = number
        self.pid = pid
        self.lines: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.lines.append(data)

    def frames(self) -> list[Frame]:
        return [decode(line) for line in b"".join(self.lines).splitlines()]


def session_event(client_id: str, epoch: str, at: float) -> PresenceEvent:
    return PresenceEvent("online", client_id, "127.0.0.1:1", None, 0.0, at, worker=int(epoch[0]), epoch=epoch)


def link_of(authority: Authority, number: int, incarnation: str, worker: int = 0) -> FakeLink:
    link = FakeLink(number)
    authority.connected(link)
    feed(authority, link, Hello(worker, PID, incarnation))
    return link


def feed(authority: Authority, link: FakeLink, *frames: Frame) -> None:
    for frame in frames:
        authority.received(link, encode(frame).rstrip(b"\n"))
    authority.batch_done(link)


def queued(authority: Authority, client_id: str) -> int:
    stored = authority.store.get(client_id)
    assert stored is not None
    return len(stored.outbox)


def test_a_report_resent_on_a_new_link_is_applied_once() -> None:
    authority = Authority()
    first = link_of(authority, 1, "w0-a")
    feed(authority, first, OpenSession(1, "dev", None), Reported(1, Push("dev", "t", b"kept", 1, retain=True)))
    assert Ack(1) in first.frames() and queued(authority, "dev") == 1
    # The link drops before the worker reads that acknowledgement: it resends on its next link.
    authority.disconnected(first, overflowed=True)
    second = link_of(authority, 2, "w0-a")
    feed(authority, second, Reported(1, Push("dev", "t", b"kept", 1, retain=True)))
    assert queued(authority, "dev") == 1  # the same report, not a second message
    assert Ack(1) in second.frames()  # still acknowledged, or the worker would resend it forever


def test_a_routed_message_resent_on_a_new_link_is_delivered_once() -> None:
    authority = Authority()
    holder = link_of(authority, 1, "w1-a", worker=1)
    feed(
        authority,
        holder,
        OpenSession(1, "dev", None),
        Claimed(1, session_event("dev", f"1.{PID}.7", at=1000.0)),
        Reported(2, Attach("dev", f"1.{PID}.7")),
        Reported(3, Subscribed("dev", "jobs/#", 1)),
    )
    sender = link_of(authority, 2, "w0-a")
    feed(authority, sender, Routed(1, Publication("jobs/1", b"run", 1)))
    authority.disconnected(sender, overflowed=True)
    again = link_of(authority, 3, "w0-a")
    feed(authority, again, Routed(1, Publication("jobs/1", b"run", 1)), Routed(2, Publication("jobs/2", b"run", 1)))
    sent = [packet for f in holder.frames() if isinstance(f, Transmit) for packet in f.packets]
    assert [b"jobs/1" in p for p in sent] == [True, False]  # jobs/1 once, then jobs/2
    assert queued(authority, "dev") == 2


def test_a_new_worker_process_starts_its_numbers_afresh() -> None:
    # Same pid (reused after a restart) and worker index, another process: its seq 1 is new.
    authority = Authority()
    old = link_of(authority, 1, "w0-old")
    feed(authority, old, OpenSession(1, "dev", None), Reported(1, Push("dev", "t", b"a", 1)))
    authority.disconnected(old, overflowed=False)
    authority.process_exited(PID, -9)
    new = link_of(authority, 2, "w0-new")
    feed(authority, new, Reported(1, Push("dev", "t", b"b", 1)))
    assert queued(authority, "dev") == 2


def test_only_the_session_holding_the_client_id_takes_its_messages() -> None:
    # Two connections of one device on two workers; the claim of the older CONNECT
    # (by its event's time) reaches the authority second and loses at once. Its attach,
    # which follows, must not take the persistent session from the newer connection.
    authority = Authority()
    newer_worker = link_of(authority, 1, "w1", worker=1)
    older_worker = link_of(authority, 2, "w0", worker=0)
    newer = session_event("dev", f"1.{PID}.1", at=2000.0)
    older = session_event("dev", f"0.{PID}.1", at=1000.0)
    for link, event in ((newer_worker, newer), (older_worker, older)):
        feed(authority, link, OpenSession(1, "dev", None), Claimed(1, event), Reported(2, Attach("dev", event.epoch)))
    stored = authority.store.get("dev")
    assert stored is not None and stored.holder == newer.epoch
    assert authority.stale_attaches == 1
    evicted = [f for f in older_worker.frames() if isinstance(f, Evict)]
    assert evicted == [Evict("dev", older.epoch, "reconnected on worker 1")]


def test_an_open_of_a_session_another_worker_holds_waits_for_that_workers_reports() -> None:
    # MQTT 5: a device sends DISCONNECT with Session Expiry 0 on worker 0 and reconnects
    # at once (Clean Start 0) on worker 1. Worker 1's open may reach the authority before
    # worker 0's detach, on another link: the open waits for a probe of worker 0, which
    # answers after its earlier reports, so the session has ended when it is answered.
    authority = Authority()
    w0 = link_of(authority, 1, "w0", worker=0)
    w1 = link_of(authority, 2, "w1", worker=1)
    event = session_event("dev", f"0.{PID}.1", at=1000.0)
    feed(
        authority,
        w0,
        OpenSession(1, "dev", None, True, 60),
        Claimed(1, event),
        Reported(2, Attach("dev", event.epoch, 0)),
    )
    w0.lines.clear()
    feed(authority, w1, OpenSession(7, "dev", None, True, 0, False))
    assert not [f for f in w1.frames() if isinstance(f, SessionOpened)]  # not yet
    (probe,) = [f for f in w0.frames() if isinstance(f, Probe)]
    feed(authority, w0, Reported(3, Detach("dev", event.epoch)), Probed(probe.token))
    (answer,) = [f for f in w1.frames() if isinstance(f, SessionOpened)]
    assert answer == SessionOpened(7, False, (), frozenset(), kept=False)  # it ended with its connection
    assert authority.store.get("dev") is None
    # A session held on the asking worker itself needs no probe (its reports come in order).
    event2 = session_event("dev2", f"1.{PID}.2", at=1001.0)
    feed(authority, w1, OpenSession(8, "dev2", None, True, 60), Claimed(4, event2))
    feed(authority, w1, Reported(5, Attach("dev2", event2.epoch, 60)), OpenSession(9, "dev2", None, True, 0, False))
    assert [f.present for f in w1.frames() if isinstance(f, SessionOpened) and f.request == 9] == [True]


async def test_qos_1_messages_routed_across_a_dropped_link_arrive_once_and_in_order() -> None:
    async with local_cluster(2) as cluster:
        a, b = cluster.members
        b.host.subscribed.add("jobs/#")
        b.coordinator.filters_changed(b.host.filters())
        assert await b.coordinator.settle()  # a routes by b's filter from here on
        for i in range(10):
            a.coordinator.route(Publication("jobs/x", b"%d" % i, 1))
        assert cluster.drop_link is not None
        cluster.drop_link(0)  # a is not scheduled meanwhile: it has not seen its link go
        for i in range(10, 20):
            a.coordinator.route(Publication("jobs/x", b"%d" % i, 1))  # into a link that is gone, PUBACK already sent
        bus = a.coordinator
        assert isinstance(bus, BusCoordinator)
        await until(lambda: bus.reconnects >= 1, "a to reconnect")
        for i in range(20, 30):
            a.coordinator.route(Publication("jobs/x", b"%d" % i, 1))
        with trio.move_on_after(5):
            while len(b.host.delivered) < 30:  # noqa: ASYNC110 (what the other member's link delivers)
                await trio.sleep(0.01)
        await trio.sleep(0.2)  # and no more
        assert [p for _, p, _ in b.host.delivered] == [b"%d" % i for i in range(30)]


def test_a_batch_s_answers_leave_the_hub_in_one_send_each_link() -> None:
    """The hub gathers what its handler sends while a batch of lines is handled (to the
    link that sent them and to others) and writes each link's share once the batch is
    done: the answers and the batch's acknowledgement in one send, all of it delivered."""

    class Echo:
        def __init__(self) -> None:
            self.links: dict[int, Link] = {}

        def connected(self, link: Link) -> None:
            self.links[link.number] = link

        def received(self, link: Link, line: bytes) -> None:
            for other in self.links.values():
                other.send(b"to " + str(other.number).encode() + b": " + line + b"\n")

        def batch_done(self, link: Link) -> None:
            link.send(b"done\n")

        def disconnected(self, link: Link, overflowed: bool) -> None:
            self.links.pop(link.number, None)

        def process_exited(self, pid: int, code: int | None) -> None:
            return None

    hub = Hub(Echo())
    flushes: list[int] = []
    flush = hub._flush

    def counting(link: Link, drop_on_error: bool = True) -> None:
        flushes.append(link.number)
        flush(link, drop_on_error)

    hub._flush = counting  # type: ignore[method-assign]
    a, b = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2))
    try:
        for sock in (a, b):
            sock.connect(hub.path)
            sock.settimeout(5)
            while len(hub.links) < (1 if sock is a else 2):
                hub.poll(0.1)
        a.sendall(b"one\ntwo\nthree\n")
        while not flushes:
            hub.poll(0.1)
        assert sorted(flushes) == [1, 2]  # one write per link for the whole batch
        got_a, got_b = b"", b""
        while not got_a.endswith(b"done\n"):
            got_a += a.recv(4096)
        while got_b.count(b"\n") < 3:
            got_b += b.recv(4096)
        assert got_a == b"to 1: one\nto 1: two\nto 1: three\ndone\n"
        assert got_b == b"to 2: one\nto 2: two\nto 2: three\n"
    finally:
        a.close()
        b.close()
        hub.close()
