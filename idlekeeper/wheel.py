"""A hierarchical timing wheel with O(1) add, cancel and reschedule.

This module is a pure data structure: no I/O, no trio, no clock of its own. Every
call that needs the time is handed it, so the same wheel runs under trio's clock,
``trio.testing.MockClock``, ``time.monotonic`` or a test's plain integers.

Layout
------
Time is cut into integer *ticks* of ``tick`` seconds. There are eight levels of
64 buckets; a bucket at level ``l`` spans ``64**l`` ticks, so the wheel reaches
``64**8`` ticks ahead (about 89 years at a 10 ms tick) with 512 buckets in all.
An entry is filed at the lowest level whose window still holds its tick, and a
bucket of a higher level is *cascaded* (its entries filed again, lower down) when
the wheel reaches it. Cascading is what keeps every level exact: nothing fires
before its own tick and nothing fires later than the first ``advance`` at or past
it (Linux's wheel instead gives up accuracy at the higher levels; we do not).

Each level keeps a 64-bit map of its non-empty buckets, and each higher-level
bucket keeps a lower bound on the earliest tick inside it. ``next_deadline`` reads
those in O(levels) and ``advance`` jumps straight from one non-empty bucket to the
next, so an advance costs O(entries due + entries cascaded + non-empty buckets
passed) -- never O(all entries), and never one step per empty tick, however far
the clock jumped (go-zero skips missed ticks; Kafka walks a bucket queue; we do the
latter with bitmaps, as Linux does).

Rounding never makes anything early: a deadline ``d`` is filed at the smallest tick
``k`` with ``k * tick >= d``, and ``advance(now)`` only returns ticks with
``k * tick <= now``. Both use the same float product, so the two comparisons agree.
"""

from __future__ import annotations

import math
from typing import Generic, TypeVar

__all__ = ["TimingWheel", "WheelEntry"]

_BITS = 6
_SLOTS = 1 << _BITS
_MASK = _SLOTS - 1
_FULL = (1 << _SLOTS) - 1
_LEVELS = 8

# Values of WheelEntry._wheel_slot that are not bucket numbers.
_UNFILED = -1
_DUE = -2


class WheelEntry:
    """Something that can be filed in a :class:`TimingWheel`.

    Subclass it (``__slots__`` are kept small on purpose) or use it as it is. An
    entry is in at most one wheel at a time.
    """

    __slots__ = ("_wheel_slot", "_wheel_tick")

    def __init__(self) -> None:
        self._wheel_slot = _UNFILED
        self._wheel_tick = 0

    @property
    def filed(self) -> bool:
        """Whether the entry is currently filed in a wheel."""
        return self._wheel_slot != _UNFILED


E = TypeVar("E", bound=WheelEntry)


class TimingWheel(Generic[E]):
    """Deadlines for many entries, kept in O(1) per operation.

    ``tick`` is the resolution in the caller's time unit; ``now`` is the caller's
    current time, from which the wheel starts.
    """

    __slots__ = ("_tick", "_now_tick", "_buckets", "_mins", "_maps", "_due", "_count", "_last_k")

    def __init__(self, tick: float, now: float = 0.0) -> None:
        if not (tick > 0 and math.isfinite(tick)):
            raise ValueError(f"tick must be a positive finite number, not {tick!r}")
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, not {now!r}")
        self._tick = float(tick)
        self._now_tick = self._floor_tick(now)
        self._buckets: list[dict[E, None]] = [{} for _ in range(_LEVELS * _SLOTS)]
        # Lower bound of the earliest tick filed in each bucket. A cancel may leave
        # it too low; that only costs one early cascade, never an early fire.
        self._mins: list[int] = [0] * (_LEVELS * _SLOTS)
        self._maps: list[int] = [0] * _LEVELS
        self._due: dict[E, None] = {}
        self._count = 0
        # The tick last filed at: entries filed at the same tick share its int (a tick
        # count is a 32-byte object, and a million entries are filed at a few ticks).
        self._last_k = 0

    # -- time conversions ------------------------------------------------------

    @property
    def tick(self) -> float:
        """The wheel's resolution."""
        return self._tick

    @property
    def now(self) -> float:
        """The time up to which the wheel has advanced, rounded down to a tick."""
        return self._now_tick * self._tick

    def _floor_tick(self, t: float) -> int:
        """The largest k with k * tick <= t."""
        tick = self._tick
        k = math.floor(t / tick)
        while (k + 1) * tick <= t:
            k += 1
        while k * tick > t:
            k -= 1
        return k

    def _ceil_tick(self, t: float) -> int:
        """The smallest k with k * tick >= t."""
        tick = self._tick
        k = math.ceil(t / tick)
        while k * tick < t:
            k += 1
        while (k - 1) * tick >= t:
            k -= 1
        return k

    # -- filing ----------------------------------------------------------------

    def __len__(self) -> int:
        return self._count

    def due(self, entry: E) -> float | None:
        """When ``advance`` will first return ``entry``, or None if it is not filed."""
        if entry._wheel_slot == _UNFILED:
            return None
        return max(entry._wheel_tick, self._now_tick) * self._tick

    def schedule(self, entry: E, deadline: float) -> float:
        """File ``entry`` to come due at ``deadline``, moving it if already filed.

        Returns the time at which ``advance`` will first return it: the deadline
        rounded up to a tick. A deadline at or before the wheel's time is due at
        the next ``advance``.
        """
        if not math.isfinite(deadline):
            raise ValueError(f"deadline must be finite, not {deadline!r}")
        return self._schedule_tick(entry, self._ceil_tick(deadline))

    def _schedule_tick(self, entry: E, k: int) -> float:
        """:meth:`schedule`'s work once the deadline's tick ``k`` is known (a
        :class:`~idlekeeper.lookahead.LookaheadWheel` finds it once for both wheels)."""
        if k == self._last_k:
            k = self._last_k
        else:
            self._last_k = k
        if entry._wheel_slot == _UNFILED:
            self._count += 1
        elif entry._wheel_tick == k:
            return max(k, self._now_tick) * self._tick
        else:
            self._unfile(entry)
        self._file(entry, k)
        return max(k, self._now_tick) * self._tick

    def cancel(self, entry: E) -> bool:
        """Take ``entry`` out of the wheel. Returns whether it was filed."""
        if entry._wheel_slot == _UNFILED:
            return False
        self._unfile(entry)
        self._count -= 1
        return True

    def _file(self, entry: E, k: int) -> None:
        now = self._now_tick
        entry._wheel_tick = k
        if k <= now:
            self._due[entry] = None
            entry._wheel_slot = _DUE
            return
        shift = 0
        level = 0
        while level < _LEVELS:
            if (k >> shift) - (now >> shift) < _SLOTS:
                break
            level += 1
            shift += _BITS
        else:
            # Beyond the top level's reach: park it in the farthest top bucket,
            # whose cascade will file it again, closer, with its own tick intact.
            level = _LEVELS - 1
            shift = level * _BITS
            k = ((now >> shift) + _SLOTS - 1) << shift
        index = (k >> shift) & _MASK
        slot = level * _SLOTS + index
        bucket = self._buckets[slot]
        if not bucket:
            self._maps[level] |= 1 << index
            self._mins[slot] = k
        elif k < self._mins[slot]:
            self._mins[slot] = k
        bucket[entry] = None
        entry._wheel_slot = slot

    def _unfile(self, entry: E) -> None:
        slot = entry._wheel_slot
        entry._wheel_slot = _UNFILED
        if slot == _DUE:
            del self._due[entry]
            return
        bucket = self._buckets[slot]
        del bucket[entry]
        if not bucket:
            self._maps[slot >> _BITS] &= ~(1 << (slot & _MASK))

    def clear(self) -> list[E]:
        """Take every entry out of the wheel and return them, in no particular order
        (for an owner that is closing and must deal with each one)."""
        out = list(self._due)
        self._due = {}
        buckets = self._buckets
        for slot, bucket in enumerate(buckets):
            if bucket:
                out.extend(bucket)
                buckets[slot] = {}
        for entry in out:
            entry._wheel_slot = _UNFILED
        self._maps = [0] * _LEVELS
        self._count = 0
        return out

    # -- time passing ----------------------------------------------------------

    def _next_tick(self) -> int | None:
        """The earliest tick at which some bucket needs attention, or None."""
        now = self._now_tick
        best: int | None = None
        shift = 0
        for level in range(_LEVELS):
            bits = self._maps[level]
            if bits:
                start = (now >> shift) & _MASK
                rotated = ((bits >> start) | (bits << (_SLOTS - start))) & _FULL
                offset = (rotated & -rotated).bit_length() - 1
                if level == 0:
                    candidate = now + offset
                else:
                    candidate = self._mins[level * _SLOTS + ((start + offset) & _MASK)]
                if best is None or candidate < best:
                    best = candidate
            shift += _BITS
        return best

    def next_deadline(self) -> float | None:
        """When ``advance`` will next have something to return, or None if empty.

        It may be earlier than the earliest entry's tick after cancellations (a
        higher-level bucket is then cascaded with nothing due), never later.
        """
        if self._due:
            return self._now_tick * self._tick
        k = self._next_tick()
        return None if k is None else k * self._tick

    def advance(self, now: float) -> list[E]:
        """Move the wheel to ``now`` and return every entry that has come due.

        Returned entries are out of the wheel, in deadline order (ties in filing
        order). Moving backwards does nothing: the wheel's time never decreases.
        """
        target = self._floor_tick(now)
        out: list[E] = []
        if self._due:
            self._drain_due(out)
        if target <= self._now_tick:
            return out
        buckets = self._buckets
        mins = self._mins
        maps = self._maps
        while True:
            k = self._next_tick()
            if k is None or k > target:
                break
            self._now_tick = k
            # Cascade the higher levels first: what lands on tick k goes to _due.
            shift = _BITS * (_LEVELS - 1)
            for level in range(_LEVELS - 1, 0, -1):
                index = (k >> shift) & _MASK
                slot = level * _SLOTS + index
                if maps[level] >> index & 1 and mins[slot] <= k:
                    bucket = buckets[slot]
                    buckets[slot] = {}
                    maps[level] &= ~(1 << index)
                    for entry in bucket:
                        self._file(entry, entry._wheel_tick)
                shift -= _BITS
            index = k & _MASK
            if maps[0] >> index & 1:
                bucket = buckets[index]
                buckets[index] = {}
                maps[0] &= ~(1 << index)
                for entry in bucket:
                    entry._wheel_slot = _UNFILED
                out.extend(bucket)
                self._count -= len(bucket)
            if self._due:
                self._drain_due(out)
        self._now_tick = target
        return out

    def _drain_due(self, out: list[E]) -> None:
        due = self._due
        self._due = {}
        for entry in due:
            entry._wheel_slot = _UNFILED
        out.extend(due)
        self._count -= len(due)
