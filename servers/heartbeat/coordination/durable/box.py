"""The durable store as the supervisor's authority commits it: on its own thread, one
group commit a round of its hub, the workers' acknowledgements after it.

The authority serves no socket a slow disk could hold up (the workers keep the
devices' keep-alive), so it writes in line: everything the workers' links brought in
one round of the hub is one transaction, and each link's acknowledgement (which a
worker's PUBACKs wait for in sync ``always``) goes once the commit has it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import frames
from .keeper import Durability

__all__ = ["BoxCommits"]

RETRY_AFTER = 1.0
"""Seconds between tries while commits fail (a full disk)."""


class BoxCommits:
    """Commits ``durability`` for the supervisor's authority (see the module's docstring)."""

    def __init__(self, durability: Durability) -> None:
        self.durability = durability
        self._waiting: dict[int, Callable[[bool], None]] = {}

    def defer(self, key: int, ack: Callable[[bool], None]) -> bool:
        """Whether link ``key``'s acknowledgement must wait for this round's commit (sync
        ``always``, with changes to commit); if so ``ack(durable)`` is called after it."""
        durability = self.durability
        if durability.sync != "always" or not durability.due():
            return False
        self._waiting[key] = ack
        return True

    def round_done(self) -> None:
        """One commit for everything the round brought, then the acknowledgements that
        waited for it; in the other sync modes, a commit when its time has come."""
        durability = self.durability
        waiting, self._waiting = self._waiting, {}
        if waiting or (durability.due() and self.wake_in() == 0.0):
            ok = durability.commit()
        else:
            ok = durability.failure is None
        for ack in waiting.values():
            ack(ok)

    def wills(self, frame: frames.WillHeld | frames.WillDone | frames.WillsQuery, first: bool) -> frames.Frame | None:
        """A worker's delayed Will held or done; or, asked by a starting worker, the
        answer: every Will a restart found waiting if it is the ``first`` worker, else none."""
        durability = self.durability
        if isinstance(frame, frames.WillsQuery):
            return frames.WillsFound(frame.request, list(durability.wills.values()) if first else [])
        if isinstance(frame, frames.WillHeld):
            durability.will_held(frame.held)
        else:
            durability.will_done(frame.client_id, frame.epoch)
        return None

    def wake_in(self) -> float | None:
        """Seconds until a commit is due with no line to move (None: none is)."""
        durability = self.durability
        if not durability.due():
            return None
        if durability.sync == "always":
            return 0.0 if durability.failure is None else RETRY_AFTER
        every = durability.interval if durability.sync == "interval" else durability.autosave
        return max(0.0, durability.last_commit + every - time.time())
