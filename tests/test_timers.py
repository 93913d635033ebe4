"""The pure Timers API: a plain loop and a fake clock, no trio."""

from __future__ import annotations

import pytest

from idlekeeper.timers import Timers


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_call_later_fires_once_no_earlier() -> None:
    clock = FakeClock()
    timers = Timers(clock, tick=0.01)
    fired: list[float] = []
    timers.call_later(1.0, lambda: fired.append(clock.now))
    clock.now = 100.99
    assert timers.run_due() == 0
    clock.now = 101.0
    assert timers.run_due() == 1
    clock.now = 200.0
    assert timers.run_due() == 0
    assert fired == [101.0]
    assert len(timers) == 0


def test_call_every_keeps_its_grid_and_collapses_missed_calls() -> None:
    clock = FakeClock()
    timers = Timers(clock, tick=0.01)
    calls: list[float] = []
    handle = timers.call_every(1.0, lambda: calls.append(clock.now))
    for t in (101.0, 102.0, 103.5):
        clock.now = t
        timers.run_due()
    clock.now = 107.2  # fell behind by three intervals: one call, then back on grid
    timers.run_due()
    assert calls == [101.0, 102.0, 103.5, 107.2]
    assert handle.when == pytest.approx(108.0)
    assert handle.cancel()
    assert not handle.cancel()
    clock.now = 200
    assert timers.run_due() == 0
    assert len(timers) == 0


def test_errors_do_not_stop_other_callbacks() -> None:
    clock = FakeClock()
    errors: list[BaseException] = []
    timers = Timers(clock, on_error=lambda h, e: errors.append(e))
    ran: list[int] = []

    def bad() -> None:
        raise KeyError("x")

    timers.call_later(1, bad)
    timers.call_later(1, ran.append, 1)
    clock.now += 1
    assert timers.run_due() == 2
    assert ran == [1]
    assert isinstance(errors[0], KeyError)
    assert timers.fired == 2


def test_a_million_pending_callbacks_cost_no_scan() -> None:
    """Advancing past nothing due touches nothing, however many are pending."""
    clock = FakeClock()
    timers = Timers(clock, tick=0.01)
    for i in range(200_000):
        timers.call_later(3600 + i * 0.001, lambda: None)
    clock.now += 60
    assert timers.run_due() == 0
    assert timers.next_deadline() == pytest.approx(100 + 3600, abs=0.01)
    with pytest.raises(ValueError):
        timers.call_every(0, lambda: None)


def test_on_schedule_hears_when_each_filing_comes_due() -> None:
    """The owner's wake-up hint is the wheel's own due time (rounded up, never early)."""
    clock = FakeClock()
    told: list[float] = []
    timers = Timers(clock, tick=0.01, on_schedule=told.append)
    once = timers.call_at(100.005, lambda: None)
    assert told == [pytest.approx(100.01)]
    assert told[0] >= once.when
    timers.call_every(0.5, lambda: None)
    assert told[-1] == pytest.approx(100.5)
    clock.now = 100.5
    timers.run_due()
    # The repeating timer was filed again: its next due time was reported too.
    assert told[-1] == pytest.approx(101.0)
    assert timers.next_deadline() == pytest.approx(101.0)


def test_slack_runs_late_alone_and_early_only_with_a_lookahead_visit() -> None:
    from idlekeeper.lookahead import LookaheadWheel

    clock = FakeClock()
    plain = Timers(clock, tick=0.01)
    ran: list[float] = []
    plain.call_at(101.0, lambda: ran.append(clock.now), slack=2.0)
    clock.now = 102.99
    assert plain.run_due() == 0  # a plain wheel hands it out at when + slack
    clock.now = 103.0
    assert plain.run_due() == 1 and ran == [103.0]

    wheel: LookaheadWheel[object] = LookaheadWheel(0.01, clock.now, lookahead=1.0)  # type: ignore[type-var]
    timers = Timers(clock, wheel=wheel)
    ran.clear()
    timers.call_at(110.0, lambda: ran.append(clock.now), slack=2.0)
    clock.now = 109.5  # a visit before its time: filed again, not run
    assert timers.run_due() == 0 and len(timers) == 1
    clock.now = 111.2  # a visit within the slack (the batch reaches 112.2): it runs now
    assert timers.run_due() == 1 and ran == [111.2]
    with pytest.raises(ValueError):
        timers.call_at(120.0, print, slack=-1.0)


def test_a_repeating_call_within_its_slack_is_on_time() -> None:
    from idlekeeper.lookahead import LookaheadWheel

    clock = FakeClock()
    wheel: LookaheadWheel[object] = LookaheadWheel(0.01, clock.now, lookahead=1.0)  # type: ignore[type-var]
    timers = Timers(clock, wheel=wheel)
    calls: list[float] = []
    handle = timers.call_every(2.0, lambda: calls.append(clock.now), slack=2.0)
    for t in (103.2, 105.5, 107.9):  # visits within a lookahead of grid time + slack
        clock.now = t
        timers.run_due()
    assert calls == [103.2, 105.5, 107.9]
    assert handle.when == pytest.approx(108.0)  # still on the grid, nothing skipped
    clock.now = 115.0  # past its time plus the slack: the missed calls collapse into one
    timers.run_due()
    assert calls[-1] == 115.0 and handle.when == pytest.approx(116.0)
