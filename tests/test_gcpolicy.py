"""The workers' collector policy: survivors are frozen out of full collections, garbage is not."""

from __future__ import annotations

import gc
import weakref

import trio
import trio.testing

import idlekeeper
from servers import gcpolicy
from servers.gcpolicy import freeze_long_lived, freeze_on_keeper


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


async def test_survivors_are_frozen_and_young_cycles_collected_first(clock: trio.testing.MockClock) -> None:
    gc.unfreeze()
    try:
        kept = [Node() for _ in range(100)]  # long-lived state, like connections
        a, b = Node(), Node()
        a.other, b.other = b, a  # a garbage cycle, younger than one interval
        gone = weakref.ref(a)
        del a, b
        async with trio.open_nursery() as nursery:
            nursery.start_soon(freeze_long_lived, 2.0)
            await trio.sleep(1.9)
            assert gc.get_freeze_count() == 0  # nothing before the first interval
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        assert gc.get_freeze_count() >= len(kept)
        assert gone() is None  # collected before the freeze, not frozen with the survivors
    finally:
        gc.unfreeze()


async def _wakeups_with_a_busy_connection(slack: float) -> tuple[int, int]:
    """(reaper wake-ups, freezes) over 20 s of a connection re-filed about once a
    second, with a 2 s freeze of ``slack`` on the same keeper."""
    async with idlekeeper.open_keeper(tick=0.1, lookahead=1.0) as keeper:
        handle = keeper.call_every(2.0, gcpolicy._freeze, slack=slack)
        watch = keeper.watch(receive=1.5, stall_check=False)
        watch.start()
        await trio.sleep(0.01)
        wakeups, fired = keeper.stats.wakeups, keeper.stats.timers_fired
        for _ in range(40):
            watch.mark_received()
            await trio.sleep(0.5)
        watch.stop()
        handle.cancel()
        return keeper.stats.wakeups - wakeups, keeper.stats.timers_fired - fired


async def test_on_a_keeper_it_rides_on_wake_ups_the_reaper_makes_anyway(clock: trio.testing.MockClock) -> None:
    gc.unfreeze()
    try:
        kept = [Node() for _ in range(100)]
        async with idlekeeper.open_keeper(tick=0.1, lookahead=1.0) as keeper:
            freeze_on_keeper(keeper, 2.0)
            await trio.sleep(1.99)
            assert gc.get_freeze_count() == 0  # never before its time
            await trio.sleep(2.02)
            assert gc.get_freeze_count() >= len(kept)  # by its time plus the slack
        # Beside a connection the reaper visits about once a second, a freeze with slack
        # goes with those visits: fewer wake-ups in all.
        alone, freezes_alone = await _wakeups_with_a_busy_connection(0.0)
        riding, freezes_riding = await _wakeups_with_a_busy_connection(2.0)
        assert freezes_alone >= 9 and freezes_riding >= 5  # every 2 to 4 s
        assert riding <= alone - 4, (riding, alone, freezes_alone, freezes_riding)
    finally:
        gc.unfreeze()
