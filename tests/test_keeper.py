"""The keeper under MockClock: deadlines, lazy activity, wake-ups, timers, hooks."""

from __future__ import annotations

import math
import threading

import pytest
import trio
import trio.testing
from trio.testing import MockClock

import idlekeeper
from idlekeeper import Reason


async def test_idle_expires_on_time_never_early(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    start = trio.current_time()
    with keeper.watch(idle=5) as w:
        await trio.sleep(100)
    assert w.expired and w.reason is Reason.IDLE
    ended = trio.current_time() - start
    assert 5 <= ended < 5 + keeper.tick
    assert keeper.stats.expired[Reason.IDLE] == 1
    assert keeper.stats.watched == 0
    assert len(keeper._wheel) == 0


async def test_activity_is_lazy_and_defers_expiry(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    start = trio.current_time()
    with keeper.watch(idle=5) as w:
        for _ in range(4):
            await trio.sleep(2)
            filed_due = keeper._wheel.due(w)
            w.mark_received()
            # Recording activity did not touch the wheel.
            assert keeper._wheel.due(w) == filed_due
        last = trio.current_time()
        await trio.sleep(100)
    assert w.reason is Reason.IDLE
    assert last + 5 <= trio.current_time() < last + 5 + keeper.tick
    assert trio.current_time() - start == pytest.approx(13, abs=keeper.tick)
    # Filed at 5, re-filed at 5 (activity at 4) -> 9, at 9 -> 13: two re-files.
    assert keeper.stats.refiles == 2


async def _staggered_heartbeats(lookahead: float) -> tuple[int, float, int]:
    """300 watches (idle 9 s) stamped every 6 s at staggered times, one silent, for 60 s:
    the reaper's wake-ups, how late the silent one expired, and how many expired."""
    async with idlekeeper.open_keeper(tick=0.1, lookahead=lookahead) as keeper:
        watches = [keeper.watch(idle=9) for _ in range(300)]
        for w in watches:
            w.start()
        silent = watches[150]
        start = trio.current_time()
        for step in range(3000):  # one stamp every 20 ms, the watches in turn
            await trio.sleep_until(start + step * 0.02)
            w = watches[step % 300]
            if w is not silent:
                w.mark_received()
        expired = [w for w in watches if w.expired]
        for w in watches:
            w.stop()
        return keeper.stats.wakeups, silent.lag if silent.expired else math.inf, len(expired)


async def test_lookahead_batches_refiles_and_keeps_expiries_on_time(clock: MockClock) -> None:
    batched, late, expired = await _staggered_heartbeats(1.0)
    assert expired == 1 and 0 <= late < 0.1  # the silent one, never early, within a tick
    one_by_one, late0, expired0 = await _staggered_heartbeats(0.0)
    assert expired0 == 1 and 0 <= late0 < 0.1
    # Without lookahead the reaper wakes at nearly every half-tick slot (about 20 a
    # second); with it, about once a second plus the expiry.
    assert batched <= 60 * 1.2 + 5
    assert one_by_one >= 8 * batched


async def test_zero_wakeups_while_nothing_is_watched(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    await trio.sleep(24 * 3600)
    assert keeper.stats.wakeups == 0


async def test_one_wakeup_per_expiry_without_empty_slots(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """A deadline far up the wheel's levels costs one wake-up, not one per slot or cascade."""
    with keeper.watch(idle=3600) as w:
        await trio.sleep(10_000)
    assert w.reason is Reason.IDLE
    assert keeper.stats.wakeups == 1
    await trio.sleep(10_000)
    assert keeper.stats.wakeups == 1


async def test_receive_timeout_ignores_sends(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    with keeper.watch(receive=4, idle=100) as w:
        for _ in range(10):
            await trio.sleep(1)
            w.mark_sent()
    assert w.reason is Reason.RECEIVE
    assert trio.current_time() == pytest.approx(4, abs=keeper.tick)


async def test_receive_timeout_since_counts_back_to_the_last_receive_and_no_further(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    with keeper.watch() as w:
        await trio.sleep(2)
        w.mark_received()
        heard = trio.current_time()
        await trio.sleep(3)
        w.receive_timeout_since(4, heard - 100)  # before the last receive: from it
        await trio.sleep(10)
    assert w.reason is Reason.RECEIVE
    assert heard + 4 <= trio.current_time() < heard + 4 + keeper.tick


async def test_receive_timeout_since_counts_from_watching_if_nothing_came_and_never_from_later(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    with keeper.watch() as quiet:
        began = trio.current_time()
        await trio.sleep(1)
        quiet.receive_timeout_since(3, began - 50)
        await trio.sleep(10)
    assert began + 3 <= trio.current_time() < began + 3 + keeper.tick
    with keeper.watch() as early:
        asked = trio.current_time()
        early.receive_timeout_since(3, asked + 50)  # a time to come counts as now
        await trio.sleep(10)
    assert asked + 3 <= trio.current_time() < asked + 3 + keeper.tick


async def test_send_timeout_only_counts_while_sending(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    with keeper.watch(send=3) as w:
        await trio.sleep(20)  # nothing pending: no send deadline
        assert w.active
        w._sending = True
        w.mark_sent()
        began = trio.current_time()
        await trio.sleep(20)
    assert w.reason is Reason.SEND
    assert began + 3 <= trio.current_time() < began + 3 + keeper.tick


async def test_absolute_deadline_is_not_extended_by_activity(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    with keeper.watch(idle=2, max_age=7) as w:
        for _ in range(20):
            await trio.sleep(0.5)
            w.touch()
    assert w.reason is Reason.ABSOLUTE
    assert 7 <= trio.current_time() < 7 + keeper.tick


async def test_phases_set_change_and_clear(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    with keeper.watch(idle=10) as w:
        await trio.sleep(1)
        # Head phase: an absolute deadline, earlier than the filed idle one.
        w.deadline = trio.current_time() + 2
        await trio.sleep(1)
        w.deadline = None  # head complete
        w.idle_timeout = None
        w.receive_timeout = 3
        assert w.receive_timeout == 3
        await trio.sleep(2)
        w.receive_timeout = None
        assert not w.has_deadline
        await trio.sleep(50)
        assert w.active
        assert len(keeper._wheel) == 0  # nothing filed once every deadline is cleared
        w.idle_timeout = 1
        await trio.sleep(50)
    assert w.reason is Reason.IDLE
    assert trio.current_time() == pytest.approx(55, abs=keeper.tick)


@pytest.mark.parametrize("which", ["idle", "receive", "send"])
async def test_a_timeout_set_tighter_than_the_filing_is_kept_to(
    which: str, keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    """Filed for a 10 s timeout, then given 2 s at 1 s: it ends at 3 s, not 11 s. A
    timeout set is checked against the filing from the last seal with no clock read;
    here that check must fail and the watch be filed again."""
    with keeper.watch() as w:
        setattr(w, f"{which}_timeout", 10)
        if which == "send":
            w._sending = True  # a send pending, as send_all marks it
        await trio.sleep(1)
        set_at = trio.current_time()
        setattr(w, f"{which}_timeout", 2)
        await trio.sleep(100)
    assert w.expired
    assert set_at + 2 <= trio.current_time() < set_at + 2 + keeper.tick


async def test_a_timeout_set_that_the_filing_covers_leaves_it_unresolved(
    keeper: idlekeeper.Keeper, clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An HTTP connection sets its keep-alive timeout again after every request: filed
    no later than the new deadline can be, the filing stands and nothing is resolved
    (no clock read, no wheel operation); the expiry is still on time."""
    with keeper.watch(idle=5) as w:
        filed = keeper._wheel.due(w)
        resolved: list[object] = []
        monkeypatch.setattr(keeper, "_changed", resolved.append)
        for _ in range(4):
            await trio.sleep(1)
            w.idle_timeout = None
            w.mark_received()
            w.idle_timeout = 5
        assert resolved == [] and keeper._wheel.due(w) == filed
        monkeypatch.undo()
        last = trio.current_time()
        await trio.sleep(100)
    assert w.reason is Reason.IDLE
    assert last + 5 <= trio.current_time() < last + 5 + keeper.tick


async def test_earlier_deadline_wakes_a_sleeping_reaper(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    with keeper.watch(idle=1000) as w:
        await trio.sleep(1)
        w.idle_timeout = 2
        await trio.sleep(1000)
    assert w.reason is Reason.IDLE
    assert trio.current_time() == pytest.approx(3, abs=keeper.tick)


async def test_watch_rules(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    w = keeper.watch(idle=1)
    with w:
        pass
    with pytest.raises(RuntimeError), w:
        pass
    with pytest.raises(ValueError):
        keeper.watch(idle=0)
    with pytest.raises(ValueError):
        keeper.watch(receive=-1)
    with pytest.raises(AttributeError):
        keeper.watch().stream  # noqa: B018 - property access is the test


async def test_watch_states_move_forward_once(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    w = keeper.watch(idle=1)
    seen = [(w.state, w.active, keeper.stats.watched)]
    with w:
        seen.append((w.state, w.active, keeper.stats.watched))
    seen.append((w.state, w.active, keeper.stats.watched))
    states = idlekeeper.WatchState
    assert seen == [(states.NEW, False, 0), (states.WATCHING, True, 1), (states.DONE, False, 0)]
    with pytest.raises(RuntimeError):
        w.start()
    assert "done" in repr(w)


async def test_started_watch_expires_without_a_task_or_scope(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    """start()/stop() keep a connection's deadlines with no with-block: what a loop
    that serves many sockets itself needs. Expiry runs the hook, exactly once."""
    expired: list[Reason | None] = []
    watches = [keeper.watch(idle=5, on_expire=lambda w: expired.append(w.reason)) for _ in range(3)]
    for w in watches:
        w.start()
    assert keeper.stats.watched == 3 and len(keeper._wheel) == 3
    await trio.sleep(3)
    watches[1].mark_received()  # activity at 3 moves its deadline to 8
    watches[2].stop()  # a connection that ended: forgotten at once, never expires
    assert len(keeper._wheel) == 2
    await trio.sleep(2 + keeper.tick)
    assert watches[0].reason is Reason.IDLE and watches[1].reason is None and watches[2].reason is None
    await trio.sleep(3)
    assert watches[1].reason is Reason.IDLE
    await keeper.wait_hooks()
    assert expired == [Reason.IDLE, Reason.IDLE]
    for w in watches:
        w.stop()
        w.stop()  # idempotent
    assert keeper.stats.watched == 0 and len(keeper._wheel) == 0


async def test_silent_for_counts_from_the_last_receive(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    w = keeper.watch(receive=100)
    assert w.silent_for() == 0.0  # not watched yet
    start = trio.current_time()
    with w:
        await trio.sleep(4)
        # Never heard from: silent since watching began.
        assert w.silent_for() == pytest.approx(trio.current_time() - start)
        w.mark_received()
        await trio.sleep(3)
        assert w.silent_for() == pytest.approx(3)
        w.mark_sent()  # sending is not hearing from the peer
        await trio.sleep(1)
        assert w.silent_for() == pytest.approx(4)
        # Never negative, whatever "now" a caller passes.
        assert w.silent_for(now=0.0) == 0.0


async def test_closed_keeper_refuses_watches(clock: MockClock) -> None:
    async with idlekeeper.open_keeper() as k:
        pass
    with pytest.raises(trio.ClosedResourceError):
        k.watch(idle=1)


async def test_many_connections_expire_each_once_and_count_returns_to_zero(
    keeper: idlekeeper.Keeper, clock: MockClock
) -> None:
    ended: dict[int, tuple[float, Reason | None]] = {}
    last_activity: dict[int, float] = {}

    async def conn(i: int) -> None:
        with keeper.watch(idle=1 + i % 7, receive=None if i % 3 else 2.5) as w:
            for _ in range(i % 5):
                await trio.sleep(0.3 * (i % 4 + 1))
                w.touch()
                last_activity[i] = trio.current_time()
            await trio.sleep_forever()
        ended[i] = (trio.current_time(), w.reason)

    async with trio.open_nursery() as nursery:
        for i in range(300):
            nursery.start_soon(conn, i)
    assert len(ended) == 300
    for i, (t, reason) in ended.items():
        base = last_activity.get(i, 0.0)
        limit = (1 + i % 7) if (i % 3 or reason is Reason.IDLE) else 2.5
        assert reason in (Reason.IDLE, Reason.RECEIVE)
        assert base + limit <= t + 1e-9, "early"
        assert t < base + limit + keeper.tick + 1e-9, "more than a tick late"
    assert keeper.stats.expired_total == 300
    assert keeper.stats.watched == 0
    assert keeper.stats.filed == 0


# -- timers -------------------------------------------------------------------


async def test_call_later_every_and_cancel(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    seen: list[tuple[str, float]] = []
    keeper.call_later(2.5, lambda: seen.append(("once", trio.current_time())))
    every = keeper.call_every(1.0, lambda: seen.append(("every", trio.current_time())))
    dropped = keeper.call_later(1.5, lambda: seen.append(("dropped", trio.current_time())))
    assert dropped.cancel()
    await trio.sleep(3.05)
    every.cancel()
    await trio.sleep(10)
    assert [name for name, _ in seen] == ["every", "every", "once", "every"]
    for name, t in seen:
        expected = {"once": 2.5}.get(name)
        if expected is not None:
            assert expected <= t < expected + keeper.tick
    assert [t for n, t in seen if n == "every"] == pytest.approx([1, 2, 3], abs=keeper.tick)
    assert keeper.stats.filed == 0


async def test_async_timer_callback_runs_as_task(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    done = trio.Event()

    async def cb(tag: str) -> None:
        await trio.sleep(1)
        assert tag == "x"
        done.set()

    keeper.call_later(1, cb, "x")
    with trio.fail_after(3):
        await done.wait()


async def test_raising_timer_callback_does_not_kill_reaper(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    keeper.call_later(1, boom)
    with keeper.watch(idle=3) as w:
        await trio.sleep(10)
    assert w.reason is Reason.IDLE
    assert keeper.stats.hook_errors == 1


# -- hooks --------------------------------------------------------------------


async def test_hooks_cannot_stall_or_kill_the_reaper(clock: MockClock) -> None:
    release = threading.Event()
    hook_log: list[str] = []

    async def hangs(w: idlekeeper.Watch) -> None:
        hook_log.append("hangs")
        await trio.sleep_forever()

    def blocks(w: idlekeeper.Watch) -> None:
        hook_log.append("blocks")
        release.wait(timeout=30)

    def raises(w: idlekeeper.Watch) -> None:
        raise ValueError("hook failure")

    async def raises_async(w: idlekeeper.Watch) -> None:
        raise ValueError("async hook failure")

    ended: dict[str, float] = {}

    # One hook thread, so that the blocked hook (in a thread, as asked) also holds up
    # the raising one queued behind it -- but never the reaper.
    async with idlekeeper.open_keeper(tick=0.1, hook_timeout=60, hook_threads=1) as keeper:

        async def conn(name: str, idle: float, hook: idlekeeper.ExpireHook | None) -> None:
            with keeper.watch(idle=idle, on_expire=hook) as w:
                await trio.sleep_forever()
            assert w.reason is Reason.IDLE
            ended[name] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn, "hangs", 1, hangs)
            nursery.start_soon(conn, "blocks", 1, idlekeeper.in_thread(blocks))
            nursery.start_soon(conn, "raises_in_thread", 1.2, idlekeeper.in_thread(raises))
            nursery.start_soon(conn, "raises", 1, raises)
            nursery.start_soon(conn, "raises_async", 1, raises_async)
            for i in range(20):
                nursery.start_soon(conn, f"plain{i}", 1.5 + i * 0.5, None)
        # Every later connection expired on time although hooks hang and block.
        for i in range(20):
            assert 1.5 + i * 0.5 <= ended[f"plain{i}"] < 1.5 + i * 0.5 + keeper.tick
        await trio.sleep(61)  # the hanging async hook hits hook_timeout
        assert keeper.stats.hook_errors == 3  # raises, raises_async, and hangs timing out
        assert keeper.hooks_pending == 2  # blocks, and raises_in_thread queued behind it
        release.set()
        await keeper.wait_hooks()
        assert keeper.stats.hook_errors == 4
        assert sorted(hook_log) == ["blocks", "hangs"]
        # And the reaper is still alive.
        with keeper.watch(idle=1) as w:
            await trio.sleep(5)
        assert w.reason is Reason.IDLE


async def test_stats_dict_is_json_ready(keeper: idlekeeper.Keeper, clock: MockClock) -> None:
    import json

    with keeper.watch(idle=0.5):
        await trio.sleep(2)
    text = json.dumps(keeper.stats.as_dict())
    assert '"idle": 1' in text
    assert keeper.stats.lag.count == 1
    assert not math.isinf(keeper.stats.lag.quantile(0.99))


async def _shared_wait(keeper: idlekeeper.Keeper, latest: float, earliest: float) -> float:
    """Wait in a :meth:`~idlekeeper.Keeper.shared_wakeup` block; when it ended."""
    with keeper.shared_wakeup(latest, earliest):
        await trio.sleep_forever()
    return trio.current_time()


async def test_a_shared_wakeup_ends_with_the_reaper_s_and_never_expires_early(clock: MockClock) -> None:
    async with idlekeeper.open_keeper(tick=0.1, lookahead=1.0) as keeper:
        start = trio.current_time()
        live = keeper.watch(receive=5.0, stall_check=False)
        dead = keeper.watch(receive=5.2, stall_check=False)
        live.start()
        dead.start()
        await trio.lowlevel.checkpoint()
        # The reaper sleeps until 5 s: a wait ending at 1 s is far from it, and both
        # are left alone.
        wakeups = keeper.stats.wakeups
        assert await _shared_wait(keeper, start + 1.0, start + 0.5) == start + 1.0
        assert keeper.stats.wakeups == wakeups
        await trio.sleep(3.0)
        live.mark_received()  # at 4 s: due at 5 s for a visit only, 9 s now
        await trio.sleep(0.5)
        # A wait that may end between 4.6 and 4.8 s ends at 4.8; the reaper, due a
        # little after, is brought forward to it.
        assert await _shared_wait(keeper, start + 4.8, start + 4.6) == pytest.approx(start + 4.8)
        await trio.lowlevel.checkpoint()
        assert keeper.stats.wakeups == wakeups + 1  # woke at 4.8, not 5.0
        assert live.active and dead.active  # the visit came early: nothing expired
        # Its next alarm is the dead watch's real deadline, 5.2 s, kept exactly: a wait
        # that may end around it ends with it.
        assert await _shared_wait(keeper, start + 5.5, start + 5.0) == pytest.approx(start + 5.2, abs=0.051)
        await trio.sleep(0.5)
        assert dead.expired and 0 <= dead.lag <= keeper.tick
        assert live.active
        live.stop()
        dead.stop()


async def test_a_shared_wakeup_follows_alarms_set_while_it_waits(clock: MockClock) -> None:
    """The reaper sets its alarm after each visit, often in the same instant as the
    other task begins its next wait and sometimes after it: alignment holds either way.
    (Aligned only when the wait began, a worker of a 500,000-device run kept waking
    twice a second, its reaper drifting 50 ms past its window each time.)"""
    async with idlekeeper.open_keeper(tick=0.1, lookahead=1.0) as keeper:
        start = trio.current_time()
        ended: list[float] = []

        async def wait(latest: float, earliest: float) -> None:
            ended.append(await _shared_wait(keeper, start + latest, start + earliest))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, 1.0, 0.5)
            await trio.lowlevel.checkpoint()
            # Filed after the wait began, due a little after its end: the reaper is
            # brought forward to the end, and the visit comes early.
            w = keeper.watch(receive=1.2, stall_check=False)
            w.start()
        assert ended == [start + 1.0]
        await trio.lowlevel.checkpoint()
        assert keeper.stats.wakeups == 1 and w.active
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, 2.0, 1.5)
            await trio.lowlevel.checkpoint()
            # The reaper wakes at 1.2 s for the watch's first deadline and files it
            # again at 1.75 s, inside the wait's second half: the wait ends with it.
            w.mark_received()
            w.receive_timeout = 0.75
        assert ended[1] == pytest.approx(start + 1.75, abs=0.051)
        await trio.sleep(0.1)
        assert w.expired and 0 <= w.lag <= keeper.tick
        w.stop()
