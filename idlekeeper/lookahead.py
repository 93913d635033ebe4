"""A timing wheel that hands entries out early, so that visits come in batches.

This module is a pure data structure, like :mod:`.wheel`: no I/O, no trio, and the
time is always passed in.

Why
---
The keeper files each connection at the time it *could* expire. Activity does not
move the entry (an O(1) store), so most entries, when their tick comes, turn out to
be alive and are filed again further on. Each of those visits is cheap; what costs
is the wake-up of the process that makes it (about 225 µs of trio's loop here). A
server whose 17,000 devices each send a heartbeat every 4 minutes has a visit due
at nearly every 100 ms tick: ten wake-ups a second for nothing.

A visit that comes early is harmless (a live entry is filed again at its deadline,
and an entry whose deadline has not come is put back at it, exactly), so
:meth:`LookaheadWheel.advance` hands out, with everything due at ``now``, what is
filed up to ``now + lookahead``. After such a batch the next wake-up is at the
earlier of the next real deadline (one found in the batch, filed back exactly) and
the first entry past the batch: at most about one a ``lookahead`` for re-filing,
instead of one a tick.

How
---
Two :class:`~idlekeeper.wheel.TimingWheel` s. ``far`` is advanced to the *horizon*
(the last ``now + lookahead``); every entry in it is filed past the horizon.
``near`` is advanced to ``now`` and holds what is filed at or before the horizon,
exact to the tick. Which one holds an entry follows from its tick: past ``far``'s
time means ``far``, since ``far`` only ever moves to a point past which it keeps
nothing, and ``near`` only ever takes ticks at or before that point.
"""

from __future__ import annotations

import math
from typing import Generic

from .wheel import _UNFILED, E, TimingWheel

__all__ = ["LookaheadWheel"]


class LookaheadWheel(Generic[E]):
    """A :class:`~idlekeeper.wheel.TimingWheel` whose :meth:`advance` also returns,
    early, what is filed up to ``lookahead`` past ``now``.

    With ``lookahead=0`` it behaves as one wheel. Every other operation is the plain
    wheel's, O(1), with the same rounding: nothing is due before its tick.
    """

    __slots__ = ("_near", "_far", "_lookahead")

    def __init__(self, tick: float, now: float = 0.0, lookahead: float = 0.0) -> None:
        if not (lookahead >= 0 and math.isfinite(lookahead)):
            raise ValueError(f"lookahead must be a finite number >= 0, not {lookahead!r}")
        self._near: TimingWheel[E] = TimingWheel(tick, now)
        self._far: TimingWheel[E] = TimingWheel(tick, now)
        self._lookahead = float(lookahead)

    @property
    def tick(self) -> float:
        """The wheel's resolution."""
        return self._near.tick

    @property
    def lookahead(self) -> float:
        """How far past ``now`` :meth:`advance` hands entries out."""
        return self._lookahead

    @property
    def now(self) -> float:
        """The time up to which entries have been handed out as due, rounded down to a tick."""
        return self._near.now

    def __len__(self) -> int:
        return len(self._near) + len(self._far)

    def _holder(self, entry: E) -> TimingWheel[E] | None:
        if not entry.filed:
            return None
        return self._far if entry._wheel_tick > self._far._now_tick else self._near

    def due(self, entry: E) -> float | None:
        """When ``entry`` is filed to come due (it may be handed out up to ``lookahead``
        sooner), or None if it is not filed."""
        holder = self._holder(entry)
        return None if holder is None else holder.due(entry)

    def schedule(self, entry: E, deadline: float) -> float:
        """File ``entry`` at ``deadline``, moving it if already filed; returns the time
        it is filed to come due (the deadline rounded up to a tick)."""
        # The reaper files every live connection it visits again through here: the
        # tick is found once (both wheels have the same), and the holder inline.
        if not math.isfinite(deadline):
            raise ValueError(f"deadline must be finite, not {deadline!r}")
        far = self._far
        k = far._ceil_tick(deadline)
        target = far if k > far._now_tick else self._near
        if entry._wheel_slot != _UNFILED:
            holder = far if entry._wheel_tick > far._now_tick else self._near
            if holder is not target:
                holder.cancel(entry)
        return target._schedule_tick(entry, k)

    def cancel(self, entry: E) -> bool:
        """Take ``entry`` out. Returns whether it was filed."""
        holder = self._holder(entry)
        return holder is not None and holder.cancel(entry)

    def clear(self) -> list[E]:
        """Take every entry out and return them, in no particular order."""
        return self._near.clear() + self._far.clear()

    def next_deadline(self) -> float | None:
        """When :meth:`advance` will next have something to return, or None if empty.

        Never later than the earliest entry's tick."""
        near, far = self._near.next_deadline(), self._far.next_deadline()
        if near is None:
            return far
        return near if far is None else min(near, far)

    def advance(self, now: float) -> list[E]:
        """Every entry due at ``now``, then every entry filed up to ``now + lookahead``.

        All of them are out of the wheel; the caller files again what is not due yet.
        """
        out = self._near.advance(now)
        out += self._far.advance(now + self._lookahead)
        return out
