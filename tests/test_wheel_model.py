"""The wheel against a plain reference model (a dict of deadlines), by hypothesis.

Random add / reschedule / cancel / advance sequences, with clock jumps of up to
millions of ticks, must keep the guarantees: never early, at most one tick late,
exactly once, nothing lost, and the count back to 0 at the end.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from idlekeeper.wheel import TimingWheel, WheelEntry


class Item(WheelEntry):
    __slots__ = ("name",)

    def __init__(self, name: int) -> None:
        super().__init__()
        self.name = name


TICKS = st.sampled_from([0.001, 0.01, 0.05, 0.1, 0.25, 1.0, 3.0])
# Delays in ticks: mostly near (level 0 and 1), some far (levels 2-5), some past.
DELAY_TICKS = st.one_of(
    st.floats(min_value=-3, max_value=70),
    st.floats(min_value=60, max_value=5000),
    st.floats(min_value=4000, max_value=3e7),
)
STEP_TICKS = st.one_of(
    st.floats(min_value=0, max_value=3),
    st.floats(min_value=0, max_value=200),
    st.floats(min_value=1000, max_value=5e7),
)


class WheelMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model: dict[int, float] = {}
        self.items: dict[int, Item] = {}
        self.fired: set[int] = set()
        self.next_name = 0

    @initialize(tick=TICKS, start=st.floats(min_value=-1e5, max_value=1e6))
    def setup(self, tick: float, start: float) -> None:
        self.tick = tick
        self.now = start
        self.wheel: TimingWheel[Item] = TimingWheel(tick, start)

    @rule(delay=DELAY_TICKS)
    def add(self, delay: float) -> None:
        item = Item(self.next_name)
        self.next_name += 1
        deadline = self.now + delay * self.tick
        due = self.wheel.schedule(item, deadline)
        assert due >= deadline or due <= self.now  # rounded up, or due at once
        self.items[item.name] = item
        self.model[item.name] = deadline

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), delay=DELAY_TICKS)
    def reschedule(self, data: st.DataObject, delay: float) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        deadline = self.now + delay * self.tick
        self.wheel.schedule(self.items[name], deadline)
        self.model[name] = deadline

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        assert self.wheel.cancel(self.items[name])
        assert not self.wheel.cancel(self.items[name])
        del self.model[name]

    @rule(data=st.data())
    def revive(self, data: st.DataObject) -> None:
        """Re-file an entry that already fired or was cancelled (entries are reusable)."""
        gone = sorted(set(self.items) - set(self.model))
        if not gone:
            return
        name = data.draw(st.sampled_from(gone))
        deadline = self.now + 5 * self.tick
        self.wheel.schedule(self.items[name], deadline)
        self.model[name] = deadline
        self.fired.discard(name)

    @rule()
    def clear(self) -> None:
        """What a closing keeper does: take out every entry, each exactly once."""
        out = self.wheel.clear()
        names = [item.name for item in out]
        assert sorted(names) == sorted(self.model), "clear lost or invented an entry"
        assert all(not item.filed for item in out)
        assert len(self.wheel) == 0 and self.wheel.next_deadline() is None
        self.model.clear()

    @rule(step=STEP_TICKS)
    def advance(self, step: float) -> None:
        self.now += step * self.tick
        self._advance_and_check()

    @rule()
    def advance_to_next_deadline(self) -> None:
        """What the reaper does: sleep until next_deadline, then advance."""
        nxt = self.wheel.next_deadline()
        if nxt is None:
            assert not self.model
            return
        self.now = max(self.now, nxt)
        self._advance_and_check()

    def _advance_and_check(self) -> None:
        out = self.wheel.advance(self.now)
        names = [item.name for item in out]
        assert len(names) == len(set(names)), "an entry fired twice in one advance"
        for name in names:
            assert name in self.model, "fired an entry that was cancelled or already fired"
            assert self.model[name] <= self.now, "fired early"
            assert not self.items[name].filed
            del self.model[name]
            self.fired.add(name)
        for name, deadline in self.model.items():
            # Not returned means not yet due at tick resolution: less than one tick late.
            assert deadline > self.now - self.tick, f"{name} is more than one tick late"

    @invariant()
    def count_matches(self) -> None:
        if hasattr(self, "wheel"):
            assert len(self.wheel) == len(self.model)
            for name, item in self.items.items():
                assert item.filed == (name in self.model)
                due = self.wheel.due(item)
                if name not in self.model:
                    assert due is None
                else:
                    # Where advance will hand it back: never before its deadline
                    # unless already due, and within one tick of it.
                    assert due is not None
                    deadline = self.model[name]
                    assert due >= deadline or due <= self.wheel.now
                    assert due <= max(deadline, self.wheel.now) + self.tick

    @invariant()
    def next_deadline_is_never_late(self) -> None:
        if not hasattr(self, "wheel"):
            return
        nxt = self.wheel.next_deadline()
        if not self.model:
            assert nxt is None
            return
        assert nxt is not None
        earliest = min(self.model.values())
        # The alarm comes no later than the tick the earliest entry rounds up to.
        assert nxt <= max(earliest, self.wheel.now) + self.tick

    def teardown(self) -> None:
        if not hasattr(self, "wheel"):
            return
        # Everything left comes out, exactly once, when time runs far enough.
        if self.model:
            self.now = max(self.model.values()) + self.tick
            self._advance_and_check()
        assert not self.model
        assert len(self.wheel) == 0
        assert self.wheel.next_deadline() is None


WheelMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWheelModel = WheelMachine.TestCase


def test_far_future_entry_is_exact() -> None:
    """An entry beyond the top level's reach is parked and still fires on its tick."""
    wheel: TimingWheel[Item] = TimingWheel(1.0, 0.0)
    item = Item(0)
    far = float(64**8 * 3 + 17)
    wheel.schedule(item, far)
    assert wheel.advance(far - 1) == []
    assert wheel.advance(far) == [item]
    assert len(wheel) == 0


def test_rounding_never_early_on_awkward_ticks() -> None:
    for tick in (0.1, 0.3, 1 / 3, 0.007):
        wheel: TimingWheel[Item] = TimingWheel(tick, 0.0)
        items = [Item(i) for i in range(200)]
        for i, item in enumerate(items):
            wheel.schedule(item, i * 0.0137)
        now = 0.0
        seen = 0
        while len(wheel):
            nxt = wheel.next_deadline()
            assert nxt is not None
            now = nxt
            for item in wheel.advance(now):
                assert item.name * 0.0137 <= now
                assert now - item.name * 0.0137 < tick + 1e-9
                seen += 1
        assert seen == 200


def test_advance_skips_empty_ticks() -> None:
    """A jump over a million empty ticks does a handful of bucket steps, not a million."""
    wheel: TimingWheel[Item] = TimingWheel(0.001, 0.0)
    a, b = Item(1), Item(2)
    wheel.schedule(a, 5.0)
    wheel.schedule(b, 1000.0)
    assert wheel.next_deadline() == 5.0
    assert wheel.advance(999.0) == [a]
    assert math.isclose(wheel.next_deadline() or 0, 1000.0)
    assert wheel.advance(1e9) == [b]


def test_entries_filed_at_one_tick_share_its_int() -> None:
    # A tick count past 256 is an int object of its own; a million entries filed at a
    # handful of ticks must not hold one each.
    wheel: TimingWheel[Item] = TimingWheel(0.1, now=1000.0)
    a, b, c = Item(0), Item(1), Item(2)
    wheel.schedule(a, 1005.0)
    wheel.schedule(b, float("1005.0"))
    wheel.schedule(c, 1007.0)
    assert a._wheel_tick == b._wheel_tick == 10050 and a._wheel_tick is b._wheel_tick
    assert c._wheel_tick == 10070
