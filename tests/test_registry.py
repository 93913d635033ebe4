"""The registry's rules against a reference model: whatever order reports arrive in,
every session that went online is ended by exactly one published offline event."""

from __future__ import annotations

import base64
import itertools
import time
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servers.heartbeat.coordination.registry import Registry
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.presence.event import PresenceEvent


def online(client: str, epoch: str, worker: int) -> PresenceEvent:
    return PresenceEvent("online", client, "peer", None, 0.0, time.time(), worker=worker, epoch=epoch)


def offline(client: str, epoch: str, worker: int) -> PresenceEvent:
    return PresenceEvent(
        "offline", client, "peer", Offline.CONNECTION_LOST, 0.0, time.time(), worker=worker, epoch=epoch
    )


def held_by(worker: int, event: PresenceEvent) -> bool:
    return event.worker == worker


# An operation: (kind, client index, worker). Epochs are numbered as sessions start.
ops = st.lists(
    st.tuples(st.sampled_from(["connect", "end", "end-old", "die"]), st.integers(0, 3), st.integers(0, 2)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_session_gets_exactly_one_offline(operations: list[tuple[str, int, int]]) -> None:
    reg = Registry(max_records=1000)
    started: dict[str, tuple[str, int]] = {}  # epoch -> (client, worker)
    ended_by_holder: set[str] = set()
    dead: set[int] = set()
    published: list[PresenceEvent] = []
    n = 0
    for kind, c, w in operations:
        client = f"c{c}"
        live = [e for e, (cl, wk) in started.items() if cl == client and e not in ended_by_holder and wk not in dead]
        if kind == "connect" and w not in dead:
            n += 1
            epoch = f"e{n}"
            started[epoch] = (client, w)
            published += reg.online(online(client, epoch, w)).emit
        elif kind == "end" and live:
            epoch = live[-1]
            ended_by_holder.add(epoch)
            event = reg.offline(offline(client, epoch, started[epoch][1]))
            published += [event] if event else []
        elif kind == "end-old" and len(live) > 1:
            # A holder reports a session the registry already ended (a takeover crossed it).
            epoch = live[0]
            ended_by_holder.add(epoch)
            event = reg.offline(offline(client, epoch, started[epoch][1]))
            published += [event] if event else []
        elif kind == "die" and w not in dead:
            dead.add(w)
            published += reg.lose(partial(held_by, w), Offline.WORKER_LOST, "", time.time())
    # Finally every live worker reports its remaining sessions ended (a shutdown).
    for epoch, (client, w) in started.items():
        if epoch not in ended_by_holder and w not in dead:
            event = reg.offline(offline(client, epoch, w))
            published += [event] if event else []
    offs = [e.epoch for e in published if e.status == "offline"]
    ons = [e.epoch for e in published if e.status == "online"]
    assert sorted(ons) == sorted(started)  # every session's online is published once
    assert sorted(offs) == sorted(started)  # ... and exactly one offline ends it
    assert reg.online_count == 0
    # Per client, events alternate online/offline: no two sessions online at once.
    for c in range(4):
        seq = [e.status for e in published if e.client_id == f"c{c}"]
        assert all(a != b for a, b in itertools.pairwise(seq)), seq


def test_takeover_is_published_before_the_new_online_and_names_the_old_holder() -> None:
    reg = Registry()
    reg.online(online("d", "a1", 0))
    claim = reg.online(online("d", "b1", 1))
    assert [(e.status, e.epoch, e.reason) for e in claim.emit] == [
        ("offline", "a1", Offline.TAKEOVER),
        ("online", "b1", None),
    ]
    assert claim.evict is not None and claim.evict.epoch == "a1" and claim.evict.worker == 0
    assert reg.offline(offline("d", "a1", 0)) is None  # the old holder's own report comes too late
    assert reg.online(online("d", "b1", 1)).emit == []  # a resent report changes nothing


def test_bound_forgets_the_longest_offline_first_never_an_online_device() -> None:
    reg = Registry(max_records=3)
    reg.online(online("stays", "s", 0))
    for i in range(6):
        reg.online(online(f"gone-{i}", f"g{i}", 0))
        reg.offline(offline(f"gone-{i}", f"g{i}", 0))
    assert len(reg) <= 3
    assert reg.get("stays") is not None and reg.get("gone-5") is not None and reg.get("gone-0") is None


def test_a_claim_that_crossed_a_newer_one_loses_unpublished() -> None:
    reg = Registry()
    newer = online("d", "b1", 1)
    older = PresenceEvent("online", "d", "peer", None, 0.0, newer.time - 0.01, worker=0, epoch="a1")
    reg.online(newer)
    claim = reg.online(older)  # accepted first, reported last
    assert claim.emit == [] and claim.evict is older
    assert reg.get("d") is newer
    assert reg.offline(offline("d", "a1", 0)) is None  # its holder's report after closing it: nothing


def test_frames_carry_an_event_s_exact_time_for_ordering_claims() -> None:
    """Two accepts in one millisecond must keep their order across the wire (the
    presence log's milliseconds lost it: a newer session was taken over by an older)."""
    from servers.heartbeat.coordination.frames import Claimed, decode, encode

    older = PresenceEvent("online", "d", "peer", None, 0.0, 1795434098.1051, worker=0, epoch="a1")
    newer = PresenceEvent("online", "d", "peer", None, 0.0, 1795434098.1053, worker=1, epoch="b1")
    a, b = (decode(encode(Claimed(i, e))) for i, e in enumerate((older, newer)))
    assert isinstance(a, Claimed) and isinstance(b, Claimed)
    reg = Registry()
    reg.online(b.event)
    claim = reg.online(a.event)  # the older, reported last
    assert claim.emit == [] and claim.evict is not None and claim.evict.epoch == "a1"


def test_session_frames_cross_the_bus_whole_and_bad_fields_are_refused() -> None:
    from servers.heartbeat.broker.reports import Acked, AckedTogether, Attach, Detach, Push, Subscribed
    from servers.heartbeat.coordination.frames import (
        FrameError,
        OpenSession,
        Reported,
        RetainedPage,
        SessionOpened,
        Transmit,
        decode,
        encode,
    )
    from servers.heartbeat.coordination.retention import RetainedMessage

    frames = [
        Reported(1, Acked("dev", "0.1.2", "pubrec", 7)),
        Reported(2, Push("dev", "cfg/a", b"\x00\xff", 2)),
        Reported(3, Subscribed("dev", "a/#", None)),
        SessionOpened(4, True, (("$b64", 1), ("a/+", 2)), frozenset({3, 9})),  # any filter text is safe
        Transmit("dev", "0.1.2", [b"\x30\x00", b"\x62\x02\x00\x07"]),
        RetainedPage(5, [RetainedMessage(f"{PRESENCE}dev", b"{}", 0)], "p:1:500"),
        # MQTT 5's session expiry: what a CONNACK brings, what a DISCONNECT sets, a resume-only open.
        Reported(8, Attach("dev", "0.1.2", 3600)),
        Reported(9, Detach("dev", "0.1.2", 0)),
        Reported(10, Detach("dev", "0.1.2")),
        OpenSession(11, "dev", None, True, 0, False),
        SessionOpened(12, False, (), frozenset(), kept=False),
    ]
    for frame in frames:
        assert decode(encode(frame)) == frame
    bad = encode(Reported(1, Acked("dev", "e", "puback", 7))).replace(b'"packet_id":7', b'"packet_id":"7"')
    with pytest.raises(FrameError, match="packet_id"):
        decode(bad)
    # Acknowledgements read together travel as one report, and come out as they went in.
    acks = [("puback", 1), ("pubrec", 65535), ("pubcomp", 256), ("puback", 1)]
    together = Reported(6, AckedTogether.pack("dev", "0.1.2", acks))
    assert decode(encode(together)) == together
    assert together.report.unpack() == acks  # type: ignore[union-attr]
    good = b"\x00\x00\x01"
    for acks_field in (b"\x00\x00", b"\x03\x00\x01"):  # not three bytes each; no fourth kind
        with pytest.raises(ValueError, match="acks"):  # none is made so here...
            AckedTogether("dev", "e", acks_field)
        # ...nor read so off a worker's link
        wire = encode(Reported(7, AckedTogether("dev", "e", good)))
        wire = wire.replace(base64.b64encode(good), base64.b64encode(acks_field))
        with pytest.raises(FrameError, match="acks"):
            decode(wire)


def test_a_byte_budget_forgets_ids_seen_once_before_devices_that_come_back() -> None:
    # Issue 33: 60 KB ids, one session each, grew the records by the megabyte.
    from servers.heartbeat.coordination.registry import record_size

    budget = 4 * record_size("returning-0") + 2 * record_size("x" * 500)
    reg = Registry(max_bytes=budget)
    for i in range(4):  # devices that come back now and then
        for epoch in ("a", "b"):
            reg.online(online(f"returning-{i}", f"{epoch}{i}", 0))
            reg.offline(offline(f"returning-{i}", f"{epoch}{i}", 0))
    reg.online(online("alive-and-once", "l1", 0))  # online: never forgotten, even seen once
    for i in range(50):  # a flood of made-up ids, each seen once
        client = f"{i:03d}" + "x" * 497
        reg.online(online(client, f"f{i}", 0))
        reg.offline(offline(client, f"f{i}", 0))
    assert reg.bytes <= budget + record_size("alive-and-once")
    assert all(reg.get(f"returning-{i}") is not None for i in range(4))
    assert reg.get("alive-and-once") is not None
    assert reg.get("049" + "x" * 497) is not None  # the newest of the flood fits, the oldest went
    assert reg.get("000" + "x" * 497) is None
    # Forgetting keeps the count right.
    assert reg.bytes == sum(record_size(e.client_id or "") for e in reg)


def test_a_device_that_comes_back_is_no_longer_first_to_go() -> None:
    reg = Registry(max_records=3)
    for epoch in ("1", "2"):  # it came back once: no longer seen once
        reg.online(online("old-friend", epoch, 0))
        reg.offline(offline("old-friend", epoch, 0))
    for i in (1, 2):
        reg.online(online(f"stranger-{i}", f"s{i}", 0))
        reg.offline(offline(f"stranger-{i}", f"s{i}", 0))
    reg.online(online("stranger-3", "s3", 0))  # one too many
    # The longest offline is the old friend, but a stranger goes: the oldest of them.
    assert [e.client_id for e in reg] == ["old-friend", "stranger-2", "stranger-3"]
