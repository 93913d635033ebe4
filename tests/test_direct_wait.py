"""The dense engine's direct wait: passes started from an epoll wait of the engine's own
while trio has nothing else to do, and trio's loop given back for anything else.

These run on the system clock, as the wait turns itself off under any other (the
tests' ``MockClock`` among them); the peers are threads with blocking sockets, so
that nothing of theirs is in trio's loop. Each check of "given back" allows half a
second for what takes microseconds, where a wait that held the loop would take
:data:`~idlekeeper.direct_wait.MAX_WAIT` (a second) or forever.
"""

from __future__ import annotations

import logging
import math
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest
import trio
import trio.testing
from trio.testing import MockClock

import idlekeeper
from idlekeeper import Engine
from idlekeeper.direct_wait import MAX_WAIT, open_direct_wait
from idlekeeper.epochs import EpochClock
from tests.test_engine import Addr, Probe, collecting, serving

PROMPT = 0.5
"""Seconds within which trio's loop must have its turn (see the module)."""

assert PROMPT < MAX_WAIT


@asynccontextmanager
async def engine_of(
    make: Callable[[], Probe], *, direct_wait: bool = True
) -> AsyncIterator[tuple[Engine, list[Probe], Addr]]:
    """A keeper on the run's clock and an engine (no deadlines filed) serving ``make()``
    protocols on a fresh listener: the engine, its protocols, the address."""
    async with idlekeeper.open_keeper(tick=0.1) as keeper:
        probes, factory = collecting(make)
        async with serving(keeper, factory, direct_wait=direct_wait) as (engine, addr):
            yield engine, probes, addr


def echo_engine(*, direct_wait: bool = True) -> AbstractAsyncContextManager[tuple[Engine, list[Probe], Addr]]:
    """:func:`engine_of` echoing protocols."""
    return engine_of(lambda: Probe(echo=True), direct_wait=direct_wait)


def echo_client(addr: Addr, rounds: int, then: Callable[[], None] | None = None) -> threading.Thread:
    """A thread that echoes ``rounds`` messages one at a time, calls ``then``, and holds
    its connection open a little longer."""

    def run() -> None:
        with socket.create_connection(addr, timeout=5) as s:
            for i in range(rounds):
                message = b"m%04d" % i
                s.sendall(message)
                got = b""
                while len(got) < len(message):
                    got += s.recv(64)
                assert got == message
            if then is not None:
                then()
            time.sleep(0.2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def joined(thread: threading.Thread) -> None:
    await trio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()


async def test_passes_start_without_trio_while_it_is_idle() -> None:
    """One request at a time, each waking the process: served from the engine's own wait."""
    async with echo_engine() as (engine, probes, addr):
        await joined(echo_client(addr, 60))
        assert len(probes) == 1 and bytes(probes[0].received) == b"".join(b"m%04d" % i for i in range(60))
        # The keeper's timers and the thread's hand-back take a few through trio.
        assert engine.direct_passes >= 40, (engine.direct_passes, engine.passes)
        assert engine.direct_passes <= engine.passes


async def test_off_when_asked() -> None:
    async with echo_engine(direct_wait=False) as (engine, probes, addr):
        await joined(echo_client(addr, 20))
        assert bytes(probes[0].received).endswith(b"m0019")
        assert engine.direct_passes == 0 and engine.passes >= 20


async def test_off_under_a_clock_other_than_the_systems(clock: MockClock) -> None:
    """A wait on a real epoll would not let a virtual clock jump: the engine waits through trio."""
    assert open_direct_wait(EpochClock(), 16) is None
    async with echo_engine() as (engine, _probes, addr):
        client = trio.socket.socket()
        await client.connect(addr)
        for _ in range(5):
            await client.send(b"ping")
            assert await client.recv(16) == b"ping"
        client.close()
        assert engine.direct_passes == 0 and engine.passes >= 5


async def test_a_timer_fires_on_time_while_the_engine_waits() -> None:
    """A sleep that ends while the engine is in its own wait ends on time: the wait is
    bounded by trio's earliest deadline."""
    async with echo_engine() as (engine, _probes, addr):
        thread = echo_client(addr, 3)
        start = trio.current_time()
        await trio.sleep(0.3)
        late = trio.current_time() - start - 0.3
        await joined(thread)
        assert engine.direct_passes >= 2
        assert late < PROMPT


async def test_another_tasks_socket_gives_the_loop_back() -> None:
    """A task waiting on its own socket hears from it at once, though the engine held
    the wait when the bytes came."""
    async with echo_engine() as (engine, _probes, addr):
        mine, theirs = socket.socketpair()
        with mine, theirs:
            sent_at: list[float] = []

            def send() -> None:
                time.sleep(0.05)  # the engine is back in its own wait by now
                sent_at.append(trio_clock.current_time())
                theirs.send(b"!")

            trio_clock = trio.lowlevel.current_clock()
            thread = echo_client(addr, 5, then=send)
            trio_mine = trio.socket.from_stdlib_socket(mine)
            assert await trio_mine.recv(1) == b"!"
            heard = trio.current_time() - sent_at[0]
            await joined(thread)
        assert engine.direct_passes >= 4
        assert heard < PROMPT


async def test_a_call_from_another_thread_gives_the_loop_back() -> None:
    """``trio.from_thread`` reaches trio through its wake-up socket, a member of trio's set."""
    async with echo_engine() as (engine, _probes, addr):
        done = trio.Event()
        delays: list[float] = []
        trio_clock = trio.lowlevel.current_clock()
        token = trio.lowlevel.current_trio_token()

        def call() -> None:
            time.sleep(0.05)
            asked = trio_clock.current_time()
            trio.from_thread.run_sync(lambda: delays.append(trio_clock.current_time() - asked), trio_token=token)
            trio.from_thread.run_sync(done.set, trio_token=token)

        thread = echo_client(addr, 5, then=call)
        with trio.fail_after(5):
            await done.wait()
        await joined(thread)
        assert engine.direct_passes >= 4
        assert delays and delays[0] < PROMPT


async def test_a_pass_that_wakes_a_task_lets_it_run_first() -> None:
    """A protocol callback that wakes a task (a channel send) leaves it runnable: the
    engine goes back through trio's loop instead of its own wait."""
    send, receive = trio.open_memory_channel[bytes](100)

    class Forwarding(Probe):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            send.send_nowait(data)

    got: list[tuple[bytes, float]] = []

    async def consume() -> None:
        async for data in receive:
            got.append((data, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        async with engine_of(Forwarding) as (_engine, _probes, addr):
            sent: list[float] = []
            trio_clock = trio.lowlevel.current_clock()

            def run() -> None:
                with socket.create_connection(addr, timeout=5) as s:
                    for i in range(10):
                        sent.append(trio_clock.current_time())
                        s.sendall(b"%d" % i)
                        time.sleep(0.01)
                    time.sleep(0.1)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            await joined(thread)
        nursery.cancel_scope.cancel()
    assert len(got) == 10
    assert max(at - sent[i] for i, (_data, at) in enumerate(got)) < PROMPT


async def test_each_direct_pass_stamps_an_epoch_sealed_before_the_next_wait() -> None:
    """What a direct pass stamps is sealed before the engine waits again, as trio's loop
    seals before its own wait: a new epoch each pass, never ending before its bytes came."""
    seen: list[tuple[bytes, object, int]] = []
    engines: list[Engine] = []

    class Stamped(Probe):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            rx = self.t._rx
            assert not isinstance(rx, float) and rx.end == math.inf  # the running pass's
            seen.append((data, rx, engines[0].direct_passes))

    words = [b"w%d" % i for i in range(8)]
    async with engine_of(lambda: Stamped(echo=True)) as (engine, _probes, addr):
        engines.append(engine)
        trio_clock = trio.lowlevel.current_clock()
        sent: list[float] = []

        def run() -> None:
            with socket.create_connection(addr, timeout=5) as s:
                for word in words:
                    sent.append(trio_clock.current_time())
                    s.sendall(word)
                    assert s.recv(16) == word

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        await joined(thread)
    assert [data for data, _, _ in seen] == words
    # Each read that a direct pass served, and the one before it:
    pairs = [(i, seen[i - 1][1], seen[i][1]) for i in range(1, len(seen)) if seen[i][2] > seen[i - 1][2]]
    assert pairs, "no direct pass served a read"
    for i, before, this in pairs:
        assert before is not this
        end = before.end  # type: ignore[attr-defined]
        assert math.isfinite(end) and sent[i - 1] <= end <= sent[i] + PROMPT


@pytest.mark.parametrize(
    "case", ["runnable", "in-the-batch", "trio-ready-too", "deadline", "stale-deadline", "idle-waiter"]
)
async def test_the_wait_declines_whenever_trio_has_something_to_do(case: str) -> None:
    """The wait itself (this test's task standing for the engine's): none while another
    task can run, waits its turn in trio's batch, or waits for all to block; none past
    trio's earliest deadline, and none at all once it is due; and when trio's set was
    ready with the sockets, their pass first and then the loop back."""
    a, b = socket.socketpair()
    with a, b:
        direct = open_direct_wait(EpochClock(), 16)
        assert direct is not None
        direct.set.register(a.fileno(), select.EPOLLIN)
        try:
            b.send(b"x")
            assert direct.wait() is None  # not known to be alone in its batch yet
            await trio.lowlevel.checkpoint()
            assert direct.wait() == [(a.fileno(), select.EPOLLIN)]  # the control: alone, only a socket ready
            async with trio.open_nursery() as nursery:
                if case == "runnable":
                    nursery.start_soon(trio.sleep, 0)
                    assert direct.wait() is None  # the new task goes first
                elif case == "in-the-batch":
                    assert a.recv(1) == b"x"

                    async def other(done: trio.Event) -> None:
                        await trio.lowlevel.checkpoint()
                        done.set()

                    # The other task's first step and this one's return in one batch: in
                    # half of them the other runs after this, from no queue at all.
                    for _ in range(12):
                        done = trio.Event()
                        nursery.start_soon(other, done)
                        await trio.lowlevel.checkpoint()
                        started = time.monotonic()
                        assert direct.wait() is None
                        assert time.monotonic() - started < PROMPT
                        await done.wait()
                elif case == "trio-ready-too":
                    c, d = socket.socketpair()
                    with c, d:
                        nursery.start_soon(trio.lowlevel.wait_readable, c)  # armed in trio's set
                        await trio.testing.wait_all_tasks_blocked()
                        await trio.lowlevel.checkpoint()  # alone in a batch again
                        d.send(b"z")
                        # The socket's events go to the pass; then the loop back, at once.
                        assert direct.wait() == [(a.fileno(), select.EPOLLIN)]
                        assert direct.wait() is None
                        nursery.cancel_scope.cancel()
                elif case == "idle-waiter":
                    nursery.start_soon(trio.testing.wait_all_tasks_blocked, 10)
                    await trio.lowlevel.checkpoint()
                    await trio.lowlevel.checkpoint()
                    assert direct.wait() is None  # trio must see every task blocked
                    nursery.cancel_scope.cancel()
                elif case == "stale-deadline":
                    assert a.recv(1) == b"x"
                    with trio.CancelScope(deadline=trio.current_time() + 0.05):  # noqa: ASYNC100
                        pass  # left at once: its entry stays in trio's heap until trio's loop prunes it
                    started = time.monotonic()
                    assert direct.wait() is None  # read unpruned, it ends the wait: sooner, never later
                    assert 0.045 <= time.monotonic() - started < PROMPT
                else:
                    assert a.recv(1) == b"x"
                    # A deadline of trio's, not a cancellation: nothing here awaits.
                    with trio.CancelScope(deadline=trio.current_time() + 0.05):  # noqa: ASYNC100
                        started = time.monotonic()
                        assert direct.wait() is None  # nothing came before the deadline
                        waited = time.monotonic() - started
                        assert 0.045 <= waited < PROMPT
                        b.send(b"y")
                        started = time.monotonic()
                        assert direct.wait() is None  # the deadline is due: no wait at all
                        assert time.monotonic() - started < 0.01
        finally:
            direct.close()


@pytest.mark.parametrize("where, name", [("runner", "waiting_for_idle"), ("deadlines", "_heap")])
async def test_a_trio_it_does_not_recognise_turns_it_off_and_says_so(
    caplog: pytest.LogCaptureFixture, where: str, name: str
) -> None:
    """Trio's run state is not public API: where it is not what this reads, the engine
    waits through trio, and the log says why its wake-ups cost what they do."""
    from trio._core._run import GLOBAL_RUN_CONTEXT

    runner = GLOBAL_RUN_CONTEXT.runner
    holder = runner if where == "runner" else runner.deadlines
    saved = getattr(holder, name)
    setattr(holder, name, None)  # no await until it is back
    try:
        with caplog.at_level(logging.INFO, logger="idlekeeper.engine"):
            assert open_direct_wait(EpochClock(), 16) is None
    finally:
        setattr(holder, name, saved)
    assert "waits through trio's loop only" in caplog.text
    direct = open_direct_wait(EpochClock(), 16)
    assert direct is not None  # the control
    direct.close()
