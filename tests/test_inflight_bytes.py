"""The in-flight window bounded in bytes as well as in messages (``--max-inflight-bytes``,
Mosquitto's ``max_inflight_bytes``), sans-IO: the outbox, a persistent session's store,
and the Mosquitto directive that sets it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servers.heartbeat.__main__ import parser
from servers.heartbeat.broker.outbox import Message, Outbox, Stage
from servers.heartbeat.broker.persistent import SessionStore
from servers.heartbeat.conf import translate
from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.mqtt.encoders import encode_pubrel
from servers.heartbeat.mqtt.publication import Publication

from .mqtt_wire import parse_server_packets


def sized(n: int, size: int, qos: int = 1) -> Message:
    """Message ``n`` (topic ``t/n``) with ``size`` bytes of payload."""
    return Message(f"t/{n}", b"x" * size, qos)


def topics(packets: list[bytes]) -> list[str]:
    return [p.topic for p in parse_server_packets(packets)]


def test_count_and_bytes_bound_the_window_together() -> None:
    # As db__ready_for_flight: 0, 30, 60 and 90 bytes in flight are below 100, so a
    # fourth 30-byte message goes (the window ends at 120); at 120 none does.
    box = Outbox(window=10, window_bytes=100)
    sent = [p for n in range(8) for p in box.push(sized(n, 30))]
    assert topics(sent) == ["t/0", "t/1", "t/2", "t/3"]
    assert box.inflight_bytes == 120 and len(box.queued()) == 4 and not box.admits()
    # The count is the tighter bound here.
    box = Outbox(window=2, window_bytes=100)
    assert topics([p for n in range(4) for p in box.push(sized(n, 10))]) == ["t/0", "t/1"]
    assert box.inflight_bytes == 20 and not box.admits()
    # Exactly at the bound is not below it.
    box = Outbox(window=10, window_bytes=60)
    assert topics([p for n in range(4) for p in box.push(sized(n, 30))]) == ["t/0", "t/1"]


def test_one_message_always_goes_when_none_is_in_flight() -> None:
    box = Outbox(window=10, window_bytes=100)
    assert topics(box.push(sized(0, 500))) == ["t/0"]  # over the bound, alone
    assert box.push(sized(1, 1)) == []  # waits for it
    assert box.push(sized(2, 500)) == []
    [big] = box.inflight()
    assert topics(box.puback(big.packet_id)) == ["t/1", "t/2"]  # 0 and 1 bytes were below 100
    assert box.inflight_bytes == 501


def test_an_acknowledgement_frees_its_bytes_and_pubrec_does_not() -> None:
    box = Outbox(window=10, window_bytes=50)
    assert topics(box.push(sized(0, 60, qos=2))) == ["t/0"]
    assert box.push(sized(1, 10, qos=2)) == []
    [first] = box.inflight()
    # PUBREC: the message is still in flight (its PUBREL is), so its bytes stay counted.
    assert box.pubrec(first.packet_id) == [encode_pubrel(first.packet_id)]
    assert first.stage is Stage.RELEASED and box.inflight_bytes == 60 and len(box.queued()) == 1
    assert topics(box.pubcomp(first.packet_id)) == ["t/1"]
    assert box.inflight_bytes == 10
    [second] = box.inflight()
    box.pubrec(second.packet_id)
    assert box.pubcomp(second.packet_id) == [] and box.inflight_bytes == 0 and len(box) == 0


def test_a_reconnect_resends_in_order_before_what_the_bytes_let_through() -> None:
    box = Outbox(window=10, window_bytes=100)
    assert topics([p for n in range(3) for p in box.push(sized(n, 40))]) == ["t/0", "t/1", "t/2"]
    box.detach()
    for n in range(3, 6):
        assert box.push(sized(n, 40)) == []
    again = parse_server_packets(box.attach())
    # Everything in flight again, with DUP, and nothing new: 120 bytes are still out.
    assert [(p.topic, p.dup) for p in again] == [("t/0", True), ("t/1", True), ("t/2", True)]
    assert topics(box.puback(again[0].packet_id)) == ["t/3"]  # 80 below 100, then 120
    assert topics(box.puback(again[1].packet_id)) == ["t/4"]
    assert [m.topic for m in box.inflight()] == ["t/2", "t/3", "t/4"]


def test_what_a_durable_store_gives_back_counts_as_in_flight() -> None:
    kept = [sized(n, 60) for n in range(2)]
    for packet_id, message in enumerate(kept, start=1):
        message.packet_id = packet_id
    box = Outbox(window=10, window_bytes=100, attached=False)
    box.restore(kept, [sized(2, 1)])
    assert box.inflight_bytes == 120
    assert topics(box.attach()) == ["t/0", "t/1"]  # the resends only
    assert topics(box.puback(1)) == ["t/2"]


def test_a_persistent_session_keeps_the_byte_window() -> None:
    store = SessionStore(window=10, window_bytes=64)
    assert store.open("dev", False) is not None
    store.subscribe("dev", "cmd/dev", 1)
    store.attach("dev", "e1")
    store.detach("dev", "e1", now=1.0)
    for n in range(4):
        store.route(Publication("cmd/dev", b"%d" % n * 40, 1))
    assert store.open("dev", False) is not None
    delivery = store.attach("dev", "e2")
    assert delivery is not None
    window = parse_server_packets(delivery.packets)
    assert [p.payload[:1] for p in window] == [b"0", b"1"]  # 0 and 40 below 64, 80 is not


def test_no_bound_is_zero_and_a_negative_one_is_refused() -> None:
    box = Outbox(window=3)
    assert topics([p for n in range(4) for p in box.push(sized(n, 10_000))]) == ["t/0", "t/1", "t/2"]
    with pytest.raises(ValueError, match="bytes"):
        Outbox(window_bytes=-1)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        HeartbeatConfig(max_inflight_bytes=-1)


def test_the_directive_sets_the_option(tmp_path: Path) -> None:
    path = tmp_path / "mosquitto.conf"
    path.write_text("max_inflight_messages 5\nmax_inflight_bytes 4096\n")
    arguments, warnings = translate(str(path))
    assert arguments == ["--max-inflight", "5", "--max-inflight-bytes", "4096"] and warnings == []
    args = parser().parse_args(arguments)
    assert (args.max_inflight, args.max_inflight_bytes) == (5, 4096)
    assert parser().parse_args([]).max_inflight_bytes == 0
    assert "--max-inflight-bytes" in parser().format_help()


# ------------------------------------------------------------------ the reference


class Reference:
    """The window as Mosquitto's db__ready_for_flight words it, kept as plain lists."""

    def __init__(self, window: int, window_bytes: int) -> None:
        self.window, self.window_bytes = window, window_bytes
        self.inflight: list[Message] = []
        self.queue: list[Message] = []
        self.attached = True

    def fill(self) -> None:
        while self.attached and self.queue and len(self.inflight) < self.window:
            if self.window_bytes and sum(len(m.payload) for m in self.inflight) >= self.window_bytes:
                return
            self.inflight.append(self.queue.pop(0))


OPS = st.one_of(
    # Sizes that add up to the bounds exactly, where < and <= part.
    st.tuples(st.just("push"), st.sampled_from([0, 1, 10, 25, 50, 100, 130]), st.sampled_from([1, 2])),
    st.tuples(st.just("ack"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("away"), st.just(0), st.just(0)),
    st.tuples(st.just("back"), st.just(0), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.sampled_from([0, 1, 50, 100, 250]), st.lists(OPS, max_size=60))
def test_the_window_is_the_references_whatever_the_client_does(
    window: int, window_bytes: int, ops: list[tuple[str, int, int]]
) -> None:
    """In flight are always the reference's messages, in order; their bytes are counted
    right; past the bound only by the newest; and the first sends follow push order."""
    box = Outbox(window=window, max_queued=1000, max_queued_bytes=1 << 30, window_bytes=window_bytes)
    ref = Reference(window, window_bytes)
    first_sends: list[str] = []
    for n, (op, arg, qos) in enumerate(ops):
        packets: list[bytes] = []
        if op == "push":
            message = sized(n, arg, qos)
            packets = box.push(message)
            ref.queue.append(message)
            ref.fill()
        elif op == "ack" and box.inflight():
            message = box.inflight()[arg % len(box.inflight())]
            if message.qos == 1:
                packets = box.puback(message.packet_id)
            elif message.stage is Stage.PUBLISHED:
                packets = box.pubrec(message.packet_id)
            else:
                packets = box.pubcomp(message.packet_id)
            if all(m is not message for m in box.inflight()):  # its id may be taken again
                ref.inflight.remove(message)
                ref.fill()
        elif op == "away":
            box.detach()
            ref.attached = False
        elif op == "back" and not box.attached:
            packets = box.attach()
            ref.attached = True
            ref.fill()
        publishes = [p for p in packets if p[0] >> 4 == 3]
        first_sends += [p.topic for p in parse_server_packets(publishes) if not p.dup]
        assert box.inflight() == ref.inflight
        assert box.queued() == ref.queue
        assert box.inflight_bytes == sum(len(m.payload) for m in ref.inflight)
        if window_bytes and box.inflight():
            assert box.inflight_bytes - len(box.inflight()[-1].payload) < window_bytes
        if box.attached and box.queued():
            assert not box.admits()
    pushed = [f"t/{n}" for n, (op, _, _) in enumerate(ops) if op == "push"]
    assert first_sends == pushed[: len(first_sends)]
