"""Stamp a read with when its bytes reached the kernel, not when they were read.

An engine that gathers traffic for a window before reading it (``coalesce``)
would otherwise stamp each packet up to a window late, and every receive deadline
would move out by as much: a silent device would be found a window late. Linux
stamps each arriving packet (``SO_TIMESTAMPNS``) and hands the stamp of the last
packet a read consumed to ``recvmsg`` as ancillary data, for about 0.2 µs more
than a ``recv``.

The kernel's stamp is wall-clock time (``CLOCK_REALTIME``) and the keeper's is
trio's, which on Linux is ``CLOCK_MONOTONIC`` plus a constant. NTP slews both
clocks alike, so their difference moves only when the wall clock is stepped.
:class:`ArrivalClock` measures that difference once per pass, and every stamp it
gives errs late, never early, which is what keeps an expiry from being early
(see :mod:`idlekeeper.epochs`). It declines (the caller stamps the read instead)
when it cannot be sure:

- the difference moved since the previous pass by more than :data:`SLACK` (a
  step of the wall clock, or a test's mock clock);
- the stamp is older than the passes whose measurements have all agreed since
  (within ``SLACK / 2`` of the first of them): a step could fall between the packet
  and the first measurement that saw it. A packet left unread across a pass (its
  pass's batch of events was full) is still stamped when it came, as long as the
  clocks held steady meanwhile;
- the stamp is newer than this pass's measurement (it arrived during the pass,
  so only the read's own stamp is known to be late enough).

A step smaller than ``SLACK`` goes unnoticed, and :data:`MARGIN`, added to every
stamp, covers it and the error of the measurement itself.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Sequence

__all__ = ["ANCILLARY_SIZE", "ArrivalClock", "MARGIN", "SLACK", "enable"]

# Linux's value on every architecture Python supports; Python does not name it.
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@qq")
ANCILLARY_SIZE = socket.CMSG_SPACE(_TIMESPEC.size)
"""The ancillary buffer ``recvmsg`` needs for one timestamp."""

SLACK = 100e-6
"""How far the wall/monotonic difference may move between passes and still be trusted."""
_SPREAD = 50e-6
"""The widest gap between the two monotonic reads around a wall-clock read."""
MARGIN = SLACK + _SPREAD + 50e-6
"""Added to every kernel stamp: an undetected step plus the measurement's error."""


def enable(sock: socket.SocketType) -> bool:
    """Ask the kernel to stamp ``sock``'s incoming packets; False where it cannot."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


class ArrivalClock:
    """Turns the kernel's receive stamps into the keeper's time; see the module.

    ``now`` is the keeper's clock (``trio.current_time``), ``wall`` the kernel's
    (``time.time``). Call :meth:`calibrate` at the start of every pass, before
    the reads it stamps.
    """

    __slots__ = ("_now", "_wall", "_offset", "_anchor", "_at", "_floor", "usable", "stamped", "declined")

    def __init__(self, now: Callable[[], float], wall: Callable[[], float] = time.time) -> None:
        self._now = now
        self._wall = wall
        self._offset = float("nan")  # the first pass has nothing to compare with
        self._anchor = float("nan")  # the offset when the current run of agreeing passes began
        self._at = -float("inf")
        self._floor = float("inf")
        self.usable = False
        """Whether this pass's stamps can be trusted."""
        self.stamped = 0
        """Reads stamped with their arrival."""
        self.declined = 0
        """Reads that carried a kernel stamp this clock could not vouch for."""

    def calibrate(self) -> None:
        """Measure the clocks' difference for the pass about to run."""
        now, wall = self._now, self._wall
        for _ in range(3):
            before = now()
            w = wall()
            after = now()
            if after - before <= _SPREAD:
                offset = (before + after) / 2 - w
                steady = abs(offset - self._offset) <= SLACK
                if not (steady and abs(offset - self._anchor) <= SLACK / 2):
                    # A new run of agreeing passes: stamps are trusted from the last
                    # measurement this one agrees with (none before a step).
                    self._anchor = offset
                    self._floor = self._at if steady else before
                self.usable = steady
                self._offset = offset
                self._at = before
                return
        # Preempted between the reads every time: nothing trustworthy this pass, and
        # nothing to compare the next one with.
        self.usable = False
        self._offset = float("nan")
        self._at = -float("inf")

    def arrival(self, ancillary: Sequence[tuple[int, int, bytes]]) -> float | None:
        """The keeper-clock time the read's last packet arrived, or None to stamp the read."""
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
                if not self.usable:
                    self.declined += 1
                    return None
                sec, nsec = _TIMESPEC.unpack_from(data)
                t: float = sec + nsec * 1e-9 + self._offset + MARGIN
                if self._floor <= t <= self._at:
                    self.stamped += 1
                    return t
                self.declined += 1
                return None
        return None
