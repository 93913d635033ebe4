"""Seal an epoch at every pass of trio's event loop (see :mod:`idlekeeper.epochs`).

One instrument per ``trio.run``, shared by every keeper in it and removed with the
last one. ``before_io_wait`` runs once per loop pass, after the batch of tasks that
could have stamped the epoch, so it is the right moment to write the epoch's end.
It costs one clock read and one small allocation per pass, not per activity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import trio

from .epochs import EpochClock

__all__ = ["acquire", "release"]


class _EpochSealer(trio.abc.Instrument):
    def __init__(self) -> None:
        self.epochs = EpochClock()
        self.users = 0
        self._now: Callable[[], float] = trio.lowlevel.current_clock().current_time

    def before_io_wait(self, timeout: float) -> None:
        self.epochs.seal(self._now())


_SEALER: trio.lowlevel.RunVar[_EpochSealer | None] = trio.lowlevel.RunVar("idlekeeper_epoch_sealer", default=None)


def acquire() -> EpochClock:
    """The current run's epoch clock, installing its instrument on first use."""
    sealer = _SEALER.get()
    if sealer is None:
        sealer = _EpochSealer()
        trio.lowlevel.add_instrument(sealer)
        _SEALER.set(sealer)
    sealer.users += 1
    return sealer.epochs


def release() -> None:
    """Drop one user; the last one removes the instrument."""
    sealer = _SEALER.get()
    if sealer is None:
        return
    sealer.users -= 1
    if sealer.users <= 0:
        _SEALER.set(None)
        # trio drops an instrument that raised; then there is nothing to remove.
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(sealer)
