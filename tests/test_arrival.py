"""Kernel receive stamps turned into keeper time: never early, declined when unsure.

The pure tests drive :class:`ArrivalClock` with made-up clocks and ancillary data,
including a hypothesis model with wall-clock steps. The last test is the one place
the real clock is used: the kernel stamps packets with wall-clock time, which a
mock clock cannot follow, and what it checks is that a packet read a coalescing
window late is stamped with when it came.
"""

from __future__ import annotations

import socket
import struct
import time

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import idlekeeper
from idlekeeper.arrival import MARGIN, SLACK, SO_TIMESTAMPNS, ArrivalClock
from tests.test_engine import Probe, connect, listening_socket

WALL = 1_790_000_000.0  # a wall clock far from the monotonic one, as on a real box


def stamp(wall_time: float) -> list[tuple[int, int, bytes]]:
    """The ancillary data recvmsg returns for a packet received at ``wall_time``."""
    sec = int(wall_time)
    nsec = round((wall_time - sec) * 1e9)
    return [(socket.SOL_SOCKET, SO_TIMESTAMPNS, struct.pack("@qq", sec, nsec))]


class Clocks:
    """A monotonic clock and a wall clock ``step``-able against it."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.offset = WALL

    def now(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.mono + self.offset


def steady() -> tuple[Clocks, ArrivalClock]:
    clocks = Clocks()
    arrivals = ArrivalClock(clocks.now, clocks.wall)
    arrivals.calibrate()
    return clocks, arrivals


def test_first_pass_only_measures() -> None:
    clocks, arrivals = steady()
    assert not arrivals.usable
    assert arrivals.arrival(stamp(clocks.wall() - 0.1)) is None
    assert arrivals.declined == 1 and arrivals.stamped == 0


def test_a_packet_between_passes_is_stamped_when_it_came_plus_the_margin() -> None:
    clocks, arrivals = steady()
    clocks.mono += 0.25
    arrivals.calibrate()
    clocks.mono += 0.25
    came = clocks.mono - 0.2  # after the previous pass, read 0.2 s later
    arrivals.calibrate()
    assert arrivals.usable
    got = arrivals.arrival(stamp(came + WALL))
    assert got is not None and came + MARGIN - 1e-6 <= got <= came + MARGIN + 1e-6
    assert arrivals.stamped == 1


def test_no_timestamp_means_stamp_the_read() -> None:
    clocks, arrivals = steady()
    clocks.mono += 1
    arrivals.calibrate()
    assert arrivals.arrival([]) is None
    assert arrivals.arrival([(socket.SOL_SOCKET, SO_TIMESTAMPNS, b"short")]) is None
    assert arrivals.declined == 0


def test_a_wall_clock_step_between_passes_is_not_trusted() -> None:
    clocks, arrivals = steady()
    clocks.mono += 1
    arrivals.calibrate()
    assert arrivals.usable
    came = clocks.mono + 0.1
    clocks.mono += 0.5
    clocks.offset += 2 * SLACK  # the wall clock is stepped forward
    arrivals.calibrate()
    assert not arrivals.usable
    assert arrivals.arrival(stamp(came + WALL)) is None
    clocks.mono += 0.5
    arrivals.calibrate()  # steady again from here
    assert arrivals.usable


def test_older_than_the_steady_run_or_newer_than_this_pass_is_declined() -> None:
    clocks, arrivals = steady()
    before_previous = clocks.mono + 0.5
    clocks.mono += 1
    arrivals.calibrate()
    clocks.mono += 1
    arrivals.calibrate()
    now = clocks.mono
    # Left unread across a pass, with the clocks steady since: stamped when it came.
    got = arrivals.arrival(stamp(before_previous + WALL))
    assert got is not None and abs(got - (before_previous + MARGIN)) < 1e-6
    assert arrivals.arrival(stamp(now + WALL)) is None  # came during the pass: stamp the read
    assert arrivals.arrival(stamp(now - 2 * MARGIN + WALL)) is not None
    clocks.offset += 2 * SLACK  # a step...
    clocks.mono += 1
    arrivals.calibrate()
    clocks.mono += 1
    arrivals.calibrate()  # ...and steady again, but the old packet may lie before the step
    assert arrivals.usable
    assert arrivals.arrival(stamp(before_previous + WALL)) is None
    assert arrivals.declined == 2 and arrivals.stamped == 2


def test_small_steps_that_add_up_end_the_steady_run() -> None:
    clocks, arrivals = steady()
    old = clocks.mono + 0.5
    for _ in range(4):  # each under SLACK, together past it
        clocks.mono += 1
        clocks.offset += 0.4 * SLACK
        arrivals.calibrate()
        assert arrivals.usable
    assert arrivals.arrival(stamp(old + WALL)) is None


def test_a_calibration_preempted_between_its_reads_is_not_trusted() -> None:
    clocks, arrivals = steady()
    clocks.mono += 1
    arrivals.calibrate()

    def slow_now() -> float:
        clocks.mono += 0.01  # every monotonic read 10 ms after the last
        return clocks.mono

    arrivals._now = slow_now
    arrivals.calibrate()
    assert not arrivals.usable
    arrivals._now = clocks.now
    arrivals.calibrate()
    assert not arrivals.usable  # nothing to compare with yet
    clocks.mono += 1
    arrivals.calibrate()
    assert arrivals.usable


# A pass every 1-500 ms, packets arriving in between (a pass may leave some unread,
# as when its batch of events is full), the wall clock stepped now and then by
# anything from a microsecond to a minute either way, or nudged by less than SLACK.
# Whatever happens, a stamp is never before the packet truly came, nor after the
# pass that reads it.
_event = st.one_of(
    st.tuples(st.just("pass"), st.floats(0.001, 0.5)),
    st.tuples(st.just("partial pass"), st.floats(0.001, 0.5)),
    st.tuples(st.just("packet"), st.floats(0.0, 0.5)),
    st.tuples(st.just("step"), st.floats(-60.0, 60.0).filter(lambda x: abs(x) >= 1e-6)),
    st.tuples(st.just("step"), st.floats(-SLACK, SLACK).filter(lambda x: abs(x) >= 1e-7)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, min_size=1, max_size=60))
def test_model_a_stamp_is_never_early(events: list[tuple[str, float]]) -> None:
    clocks, arrivals = steady()
    waiting: list[tuple[float, float]] = []  # (true mono arrival, kernel wall stamp)
    steps = 0
    for kind, value in events:
        if kind == "step":
            clocks.offset += value
            steps += 1
        elif kind == "packet":
            clocks.mono += value
            waiting.append((clocks.mono, clocks.wall()))
        else:
            clocks.mono += value
            arrivals.calibrate()
            read_at = clocks.mono
            left = waiting[len(waiting) // 2 :] if kind == "partial pass" else []
            for came, wall in waiting[: len(waiting) - len(left)]:
                got = arrivals.arrival(stamp(wall))
                if got is not None:
                    assert came <= got <= read_at, (came, got, read_at)
                    if not steps:
                        assert abs(got - (came + MARGIN)) <= 1e-6
            waiting[:] = left


# -- the engine: a packet gathered for a window is stamped when it came -------------------


class Signalling(Probe):
    """A probe that sets ``news`` on every callback, for a test on the real clock."""

    def __init__(self) -> None:
        super().__init__()
        self.news = trio.Event()

    def _note(self, event: str) -> None:
        super()._note(event)
        self.news.set()

    async def next_news(self) -> None:
        await self.news.wait()
        self.news = trio.Event()


async def test_engine_stamps_a_gathered_packet_with_its_arrival_not_its_read() -> None:
    window = 0.05
    made = trio.Event()
    probes: list[Signalling] = []

    def factory() -> Signalling:
        probes.append(Signalling())
        made.set()
        return probes[-1]

    async with (
        idlekeeper.open_keeper(tick=0.01) as keeper,
        idlekeeper.open_engine(keeper, coalesce=window) as engine,
    ):
        assert engine.arrivals is not None
        [listener] = engine.serve([listening_socket()], factory, receive=60.0)
        client = await connect(listener.getsockname())
        await made.wait()
        probe = probes[0]
        await probe.next_news()  # connection_made
        await client.send(b"a")
        await probe.next_news()
        # The engine read "a" and is gathering for a window: "b" waits in the kernel.
        sent_at = trio.current_time()
        await client.send(b"b")
        sent_by = trio.current_time()
        await probe.next_news()
        assert probe.received == b"ab"
        rx = probe.t._rx
        assert isinstance(rx, float)  # the arrival itself: no epoch object of its own
        seen = (sent_at, sent_by, rx, probe.last_rx_at, engine.arrivals.stamped, engine.arrivals.declined)
        # Stamped with its arrival, although it was read up to a window later (a
        # read's own stamp would be at or after the read).
        assert sent_at + MARGIN - 1e-5 <= rx <= sent_by + MARGIN + 1e-5, seen
        assert probe.last_rx_at > rx, seen
        assert engine.arrivals.stamped >= 1, seen
        client.close()


def test_wall_clock_helper_matches_the_kernel() -> None:
    """The stamp decoding above matches what Linux really sends.

    The kernel turns receive stamping on for the whole system asynchronously when the
    first socket asks, so the first packets after that may come unstamped (the engine
    then stamps the read): try a few packets, and check the first stamped one.
    """
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            conn.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            for _ in range(200):
                before = time.time()
                client.send(b"x")
                after = time.time()
                _data, ancillary, _flags, _addr = conn.recvmsg(16, socket.CMSG_SPACE(16))
                if ancillary:
                    break
                time.sleep(0.005)
            [(level, kind, raw)] = ancillary
            sec, nsec = struct.unpack("@qq", raw)
            assert (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPNS)
            assert before - 1e-6 <= sec + nsec * 1e-9 <= after + 1e-6
