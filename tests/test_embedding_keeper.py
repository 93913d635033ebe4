"""The keeper as a trio library (issue 34, items 1, 2, 4, 6 and 8): callbacks in the
trio thread by one rule, a close that leaves nothing unguarded, deadlines changed only
through the keeper, a reaper pass that lets the program run, and an API named and
guarded as trio's (MockClock throughout)."""

from __future__ import annotations

import inspect
import itertools
import logging
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import trio
from trio.testing import MockClock

import idlekeeper
from idlekeeper.deadlines import Reason
from idlekeeper.keeper import REAP_CHUNK

# -- 1. callbacks: the trio thread, one rule ------------------------------------------


async def test_a_plain_hook_runs_in_the_trio_thread_and_may_touch_trio_objects(clock: MockClock) -> None:
    # It ran in a worker thread: send_nowait() there failed once the receiver had gone
    # from waiting to not, and trio objects are not thread-safe at all.
    send, receive = trio.open_memory_channel[idlekeeper.Watch](10)
    threads: list[int] = []

    def hook(w: idlekeeper.Watch) -> None:
        threads.append(threading.get_ident())
        trio.lowlevel.current_task()  # raises RuntimeError outside the trio thread
        send.send_nowait(w)

    async with idlekeeper.open_keeper() as keeper:
        watches = [keeper.watch(idle=1 + i, on_expire=hook) for i in range(3)]
        for w in watches:
            w.start()
        with trio.fail_after(60):  # a hook that failed in a thread sent nothing
            got = [await receive.receive() for _ in range(3)]
        await keeper.wait_hooks()
    assert got == watches
    assert threads == [threading.get_ident()] * 3
    assert keeper.stats.hook_errors == 0


async def test_a_plain_hook_does_not_move_the_mock_clock(clock: MockClock) -> None:
    # In a worker thread, a 50 ms hook let autojump move the clock from 1.5 s to 100 s,
    # and an unrelated idle=100 watch expired.
    def slow(w: idlekeeper.Watch) -> None:
        time.sleep(0.05)

    async with idlekeeper.open_keeper() as keeper:
        bystander = keeper.watch(idle=100)
        bystander.start()
        with keeper.watch(idle=1.5, on_expire=slow) as w:
            await trio.sleep_forever()
        assert w.reason is Reason.IDLE
        await keeper.wait_hooks()
        assert trio.current_time() < 2
        assert bystander.active


async def test_callbacks_that_raise_are_reported_alike_and_never_reach_the_keepers_block(
    clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # An async timer callback that raised was not wrapped: it killed the keeper and the
    # whole `async with` body, where a failing hook was only logged.
    async def async_timer() -> None:
        raise ValueError("async timer")

    def plain_timer() -> None:
        raise ValueError("plain timer")

    def plain_hook(w: idlekeeper.Watch) -> None:
        raise ValueError("plain hook")

    async def async_hook(w: idlekeeper.Watch) -> None:
        raise ValueError("async hook")

    caplog.set_level(logging.ERROR, logger="idlekeeper")
    async with idlekeeper.open_keeper() as keeper:
        keeper.call_later(1, async_timer)
        keeper.call_later(1, plain_timer)
        for hook in (plain_hook, async_hook):
            keeper.watch(idle=1, on_expire=hook).start()
        await trio.sleep(2)
        await keeper.wait_hooks()
        assert keeper.stats.hook_errors == 4
        with keeper.watch(idle=1) as w:  # the reaper is alive
            await trio.sleep_forever()
        assert w.reason is Reason.IDLE
    reported = sorted(r.getMessage() for r in caplog.records if "raised" in r.getMessage())
    assert len(reported) == 4
    for name in ("async_timer", "plain_timer", "plain_hook", "async_hook"):
        assert sum(name in line for line in reported) == 1, reported


async def test_a_hook_in_a_thread_only_on_request_at_most_once_and_never_after_close(clock: MockClock) -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []
    threads: list[int] = []

    def blocking(w: idlekeeper.Watch) -> None:
        threads.append(threading.get_ident())
        started.set()
        release.wait(timeout=30)
        finished.set()

    def queued_behind(w: idlekeeper.Watch) -> None:
        ran.append("queued_behind")

    async with idlekeeper.open_keeper(hook_threads=1) as keeper:
        keeper.watch(idle=1, on_expire=idlekeeper.in_thread(blocking)).start()
        keeper.watch(idle=1.2, on_expire=idlekeeper.in_thread(queued_behind)).start()
        await trio.sleep(1.5)
        await trio.to_thread.run_sync(started.wait, 30)
        assert keeper.hooks_pending == 2
        # The close cannot cut the running thread off: it waits for it, and the hook
        # queued behind it never starts.
        threading.Timer(0.05, release.set).start()
    assert finished.is_set()
    assert threads and threads[0] != threading.get_ident()
    assert ran == []
    assert keeper.stats.hooks_cancelled == 1  # the one behind; the running one was waited for
    assert keeper.hooks_pending == 0
    with pytest.raises(TypeError, match="plain function"):
        idlekeeper.in_thread(_async_noop)


async def _async_noop(w: idlekeeper.Watch) -> None:
    pass


# -- 2. closing the keeper -------------------------------------------------------------


async def test_closing_the_keeper_cancels_every_watch_it_still_holds(clock: MockClock) -> None:
    # A watch still inside its `with` stayed active=True and unguarded: an idle=1 watch
    # was still "watching" after 3,600 s.
    hooks: list[idlekeeper.Watch] = []
    exits: list[str] = []
    a, b = socket.socketpair()
    b.setblocking(False)
    fired: list[str] = []

    async def holder(watch: idlekeeper.Watch, name: str) -> None:
        with watch:
            await trio.sleep_forever()
        exits.append(name)

    async with trio.open_nursery() as outer:
        async with idlekeeper.open_keeper() as keeper:
            filed = keeper.watch(idle=1, on_expire=hooks.append)
            unfiled = keeper.watch(on_expire=hooks.append)  # no deadline: not in the wheel
            stream = keeper.watch(trio.SocketStream(trio.socket.from_stdlib_socket(a)), idle=1)
            for watch, name in ((filed, "filed"), (unfiled, "unfiled"), (stream, "stream")):
                outer.start_soon(holder, watch, name)
            keeper.call_later(5, fired.append, "timer")
            await trio.sleep(0.5)
            assert keeper.stats.watched == 3
        assert keeper.closed
        await trio.sleep(3600)
        assert sorted(exits) == ["filed", "stream", "unfiled"]
    for watch in (filed, unfiled, stream):
        assert watch.state is idlekeeper.WatchState.DONE
        assert not watch.active and not watch.expired
    assert hooks == [] and fired == []  # nothing expired; the timer was cancelled
    assert b.recv(10) == b""  # its socket was closed
    await stream.stream.aclose()  # quiet, as after an expiry
    assert keeper.stats.watched == 0 and keeper.stats.closed_watches == 3
    with pytest.raises(trio.ClosedResourceError):
        keeper.call_later(1, fired.append, "late")
    late = keeper.watch  # a method of a closed keeper
    with pytest.raises(trio.ClosedResourceError):
        late(idle=1)
    b.close()


async def test_a_watch_made_before_close_and_entered_after_is_refused_cleanly(clock: MockClock) -> None:
    async with idlekeeper.open_keeper() as keeper:
        early = keeper.watch(idle=1)
    with pytest.raises(trio.ClosedResourceError), early:
        pass
    assert early.state is idlekeeper.WatchState.DONE
    # The refused block left no cancel scope behind: trio would say so here.
    await trio.sleep(1)


async def test_hooks_queued_at_close_run_and_unfinished_ones_are_reported(
    clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # 20 expired, 0 hooks: the hooks queued in the last pass never ran.
    ran: list[idlekeeper.Watch] = []

    async def forever(w: idlekeeper.Watch) -> None:
        await trio.sleep_forever()

    caplog.set_level(logging.WARNING, logger="idlekeeper")
    async with idlekeeper.open_keeper() as keeper:
        for _ in range(19):
            keeper.watch(idle=1, on_expire=ran.append).start()
        keeper.watch(idle=1, on_expire=forever).start()
        with keeper.watch(idle=1, on_expire=ran.append):
            await trio.sleep_forever()
        # Straight out of the block the pass's expiries ended: no checkpoint between.
    assert len(ran) == 20
    assert keeper.stats.expired[Reason.IDLE] == 21
    assert keeper.hooks_pending == 0
    assert keeper.stats.hooks_cancelled == 1
    assert any(
        "forever" in r.getMessage() and "unfinished" in r.getMessage() and "cancelled" in r.getMessage()
        for r in caplog.records
    )


# -- 4. deadlines only through the keeper ----------------------------------------------


async def test_deadlines_change_only_through_the_keeper(clock: MockClock) -> None:
    # w.set_idle_timeout(1.0, now) on an idle=30 watch expired it at 30 s, not 1 s, and a
    # float written to w.rx made the reaper raise and the watch leave the wheel.
    async with idlekeeper.open_keeper() as keeper:
        with keeper.watch(idle=30) as w:
            for name in ("set_idle_timeout", "set_receive_timeout", "set_send_timeout", "set_deadline"):
                assert not hasattr(w, name), name
            for name in ("rx", "tx", "sending"):
                with pytest.raises(AttributeError):
                    setattr(w, name, 1.5)
            w.idle_timeout = 1.0
            await trio.sleep_forever()
        assert w.reason is Reason.IDLE
        assert 1.0 <= trio.current_time() < 1.0 + keeper.tick


# -- 6. a reaper pass in chunks --------------------------------------------------------


async def test_a_long_reaper_pass_lets_the_program_run_between_chunks(clock: MockClock) -> None:
    # 200,000 watches due in one slot held trio's loop for 1.28 s in one pass.
    count = 5 * REAP_CHUNK + 7
    seen: list[int] = []
    async with idlekeeper.open_keeper() as keeper:
        for _ in range(count):
            keeper.watch(idle=1).start()

        async def observer() -> None:
            await trio.sleep(1)
            for _ in range(10 * count):  # bounded: one look per loop pass
                seen.append(keeper.stats.expired_total)
                if seen[-1] == count:
                    return
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(observer)
    assert len(seen) > 2 and seen[-1] == count
    steps = [later - earlier for earlier, later in itertools.pairwise(seen)]
    # trio runs each task once per loop pass, in an order it reverses at random, so
    # the observer may look twice between two chunks or miss one, never more.
    assert max(steps) <= 2 * REAP_CHUNK, steps
    assert sum(0 < n < count for n in seen) >= 4  # it saw the pass part-done, often
    assert keeper.stats.pass_yields >= 5


async def test_closing_in_the_middle_of_a_pass_still_ends_every_watch(clock: MockClock) -> None:
    count = 3 * REAP_CHUNK
    async with idlekeeper.open_keeper() as keeper:
        watches = [keeper.watch(idle=1) for _ in range(count)]
        for w in watches:
            w.start()
        await trio.sleep(1)
        while keeper.stats.expired_total == 0:  # bounded by the pass: it has begun
            await trio.lowlevel.checkpoint()
        assert keeper.stats.expired_total < count
    assert all(not w.active for w in watches)
    assert keeper.stats.expired_total + keeper.stats.closed_watches == count
    for w in watches:
        w.stop()  # the expired ones leave now; the ended ones had left already
    assert keeper.stats.watched == 0


async def test_a_watch_kept_without_a_block_still_hands_out_a_cancelled_scope(clock: MockClock) -> None:
    # An expiry no longer makes a scope only to cancel it; one asked for later comes cancelled.
    async with idlekeeper.open_keeper() as keeper:
        w = keeper.watch(idle=1)
        w.start()
        await trio.sleep(2)
        assert w.expired and w.cancel_scope.cancel_called
        fresh = keeper.watch(idle=1)
        fresh.start()
        assert not fresh.cancel_scope.cancel_called
        fresh.stop()


# -- 8. the API surface ------------------------------------------------------------------


async def test_keepers_and_engines_have_no_public_constructor(clock: MockClock) -> None:
    # Keeper(nursery, ...) leaked a run-wide instrument; Engine(...) an epoll and a socketpair.
    async with trio.open_nursery() as nursery:
        with pytest.raises(TypeError, match="open_keeper"):
            idlekeeper.Keeper(nursery, tick=0.1, stall_check=True, hook_timeout=None, hook_threads=1)
        async with idlekeeper.open_keeper() as keeper:
            with pytest.raises(TypeError, match="open_engine"):
                idlekeeper.Engine(keeper)  # type: ignore[call-arg]


def test_the_top_level_names_are_the_api_and_internals_stay_in_their_modules() -> None:
    for name in ("TimingWheel", "WheelEntry", "Epoch", "EpochClock", "ConnectionDeadlines", "Timers"):
        assert name not in idlekeeper.__all__
        with pytest.warns(DeprecationWarning, match=name):
            moved: Any = getattr(idlekeeper, name)
        assert moved.__module__.startswith("idlekeeper.")
    for name in idlekeeper.__all__:
        obj = getattr(idlekeeper, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"
    # Importing the package and its modules warns about nothing: only old names do.
    code = "import idlekeeper, idlekeeper.lost, idlekeeper.keeper, idlekeeper.watch"
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_exceptions_are_named_and_based_as_trios() -> None:
    assert issubclass(idlekeeper.ExpiredError, trio.TooSlowError)
    assert issubclass(idlekeeper.EngineClosedError, trio.ClosedResourceError)
    exc = idlekeeper.ExpiredError(Reason.SEND)
    assert exc.reason is Reason.SEND and "send" in str(exc)
    with pytest.warns(DeprecationWarning, match="ExpiredError"):
        assert idlekeeper.Expired is idlekeeper.ExpiredError
    with pytest.warns(DeprecationWarning, match="EngineClosedError"):
        assert idlekeeper.EngineClosed is idlekeeper.EngineClosedError
