"""Coarse activity stamps: never early (the proof in idlekeeper.epochs, checked)."""

from __future__ import annotations

import time

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

import idlekeeper
from idlekeeper.epochs import NEVER, EpochClock, latest


@given(st.lists(st.tuples(st.floats(0, 5), st.booleans()), max_size=60))
def test_latest_is_never_before_the_true_activity(steps: list[tuple[float, bool]]) -> None:
    """Any interleaving of clock steps, activities and seals: latest(stamp) >= true time."""
    clock = EpochClock()
    now = 0.0
    stamps: list[tuple[float, object]] = []
    for step, seal in steps:
        now += step
        stamps.append((now, clock.current))  # an activity at `now`
        if seal:
            clock.seal(now + step / 2)  # the pass ends a little later
            now += step / 2
        for true_time, epoch in stamps:
            assert isinstance(epoch, idlekeeper.epochs.Epoch)
            assert latest(epoch, now) >= true_time
    assert latest(NEVER, now) == float("-inf")


async def test_loop_seals_epochs_with_real_clock() -> None:
    """Under the real clock a stamp's end is at or after the activity, and close to it."""
    async with idlekeeper.open_keeper() as keeper:
        slack = []
        for _ in range(50):
            epoch = keeper._epochs.current
            t = trio.current_time()
            time.sleep(0.0005)  # noqa: ASYNC251 - blocking work inside one loop pass is the point
            await trio.lowlevel.checkpoint()  # the pass ends; the epoch is sealed
            assert epoch is not keeper._epochs.current
            assert epoch.end >= t
            slack.append(epoch.end - t)
        assert min(slack) < 0.05


async def test_two_keepers_share_one_instrument() -> None:
    async with idlekeeper.open_keeper() as a, idlekeeper.open_keeper() as b:
        assert a._epochs is b._epochs
        before = a._epochs.current
        await trio.lowlevel.checkpoint()
        assert a._epochs.current is not before
    async with idlekeeper.open_keeper() as c:
        assert c._epochs is not a._epochs  # the last keeper out removed the old one


async def test_stamps_under_mock_clock_are_exact(autojump_clock: trio.testing.MockClock) -> None:
    async with idlekeeper.open_keeper() as keeper:
        await trio.sleep(3)
        epoch = keeper._epochs.current
        await trio.sleep(2)
        assert epoch.end == 3.0
