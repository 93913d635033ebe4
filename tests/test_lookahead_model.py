"""The lookahead wheel against the same reference model as the plain wheel, by hypothesis.

Its client does what the keeper does with what ``advance`` hands out: an entry whose
deadline has come fires; one handed out early (filed within ``lookahead`` of now) is
filed again at its own deadline. The guarantees stay the plain wheel's: never early,
at most one tick late, exactly once, nothing lost. Early means within the lookahead.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from idlekeeper.lookahead import LookaheadWheel

from .test_wheel_model import TICKS, Item, WheelMachine

LOOKAHEAD_TICKS = st.sampled_from([0.0, 0.5, 1.0, 7.0, 63.0, 64.0, 200.0, 5000.0])


class LookaheadMachine(WheelMachine):
    @initialize(tick=TICKS, start=st.floats(min_value=-1e5, max_value=1e6), lookahead=LOOKAHEAD_TICKS)
    def setup_lookahead(self, tick: float, start: float, lookahead: float) -> None:
        self.tick = tick
        self.now = start
        self.lookahead = lookahead * tick
        self.wheel = LookaheadWheel(tick, start, self.lookahead)  # type: ignore[assignment]

    def _advance_and_check(self) -> None:
        out = self.wheel.advance(self.now)
        names = [item.name for item in out]
        assert len(names) == len(set(names)), "an entry came out twice in one advance"
        for item in out:
            name = item.name
            assert name in self.model, "handed out an entry that was cancelled or already fired"
            assert not item.filed
            deadline = self.model[name]
            if deadline <= self.now:
                del self.model[name]
                self.fired.add(name)
                continue
            # Early: only within the lookahead (and the tick it rounds to).
            assert deadline <= self.now + self.lookahead + self.tick, "handed out beyond the lookahead"
            self.wheel.schedule(item, deadline)
        for name, deadline in self.model.items():
            assert deadline > self.now - self.tick, f"{name} is more than one tick late"


# Hypothesis runs every initializer it finds on the class: the plain wheel's goes.
LookaheadMachine.setup = None  # type: ignore[assignment,method-assign]
LookaheadMachine.TestCase.settings = WheelMachine.TestCase.settings
TestLookaheadModel = LookaheadMachine.TestCase


def test_refiles_come_in_batches_and_expiries_on_time() -> None:
    """1,000 entries kept alive at staggered times, one left to expire: the client wakes
    about once a lookahead to re-file, and the silent one fires within a tick."""
    tick, lookahead, timeout = 0.05, 1.0, 90.0
    wheel: LookaheadWheel[Item] = LookaheadWheel(tick, 0.0, lookahead)
    items = [Item(i) for i in range(1000)]
    last = {item.name: i * 0.06 for i, item in enumerate(items)}  # each "sends" every 60 s
    for item in items:
        wheel.schedule(item, last[item.name] + timeout)
    silent = items[500]
    now, wakeups, fired = 0.0, 0, []
    while now < 600:
        nxt = wheel.next_deadline()
        assert nxt is not None
        now = nxt
        wakeups += 1
        for item in items:  # activity: stamps only, the wheel is not touched
            while item is not silent and last[item.name] + 60 <= now:
                last[item.name] += 60
        for item in wheel.advance(now):
            deadline = last[item.name] + timeout
            if deadline <= now:
                fired.append((item.name, now - deadline))
            else:
                wheel.schedule(item, deadline)
    assert [name for name, _ in fired] == [500]
    assert 0 <= fired[0][1] < tick
    # Without lookahead nearly every slot has a re-file: over 600 s, ~10,000 wake-ups.
    assert wakeups < 600 / lookahead * 1.2


def test_a_deadline_that_is_not_a_number_or_never_is_refused_and_nothing_moves() -> None:
    """As the plain wheel's: ValueError, and an entry already filed stays where it was."""
    wheel: LookaheadWheel[Item] = LookaheadWheel(0.1, 0.0, 1.0)
    near, far = Item(1), Item(2)
    wheel.schedule(near, 0.5)
    wheel.schedule(far, 30.0)
    for bad in (math.inf, -math.inf, math.nan):
        for item in (near, far, Item(3)):
            with pytest.raises(ValueError, match="finite"):
                wheel.schedule(item, bad)
    assert (wheel.due(near), wheel.due(far), len(wheel)) == (0.5, 30.0, 2)
    assert wheel.advance(1.0) == [near]
