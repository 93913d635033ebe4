"""Wills that wait: MQTT 5's Will Delay Interval (§3.1.3.2.2).

A 5.0 device may ask that its Will go out only if it stays away for a while, so a
short drop (a cell handover, a router reboot) does not tell the world it died. The
worker that held the connection keeps the Will for the delay (at most the session's
expiry: a Will goes out when its session ends, whichever comes first), and:

- drops it if the device connects again to this worker meanwhile (:meth:`DelayedWills.cancel`);
- when the delay is up, asks the coordinator for the device's last presence, fleet-wide,
  and drops the Will if a later session of the device has begun anywhere (another
  worker, another node); otherwise it goes out like any Will;
- at shutdown, sends every Will still waiting (their sessions end with the server's
  in-memory state, or the operator stops the node: either way the device is not back);
  unless the coordinator keeps them durably (``--persistence``): then each is kept
  from the moment it is held, and the next start waits out what is left of it
  (:meth:`DelayedWills.restore`), so neither a restart nor a crash loses one.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import trio

from ...logs import shown
from ..coordination import Coordinator
from ..coordination.durable.wills import HeldWill
from ..mqtt.effects import Will

__all__ = ["DelayedWills"]

logger = logging.getLogger("servers.heartbeat")


class DelayedWills:
    """The Wills this worker holds back, by client id (see the module docs)."""

    def __init__(
        self,
        coordinator: Coordinator,
        publish: Callable[[str, Will], None],
        counters: collections.Counter[str],
        nursery: trio.Nursery,
    ) -> None:
        self.coordinator = coordinator
        self.publish = publish
        self.counters = counters
        self.nursery = nursery
        self._waiting: dict[str, tuple[str, Will, trio.CancelScope]] = {}
        """Client id -> (the epoch of the session that left it, the Will, its wait)."""

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self, client_id: str, epoch: str, will: Will) -> None:
        """Keep ``will`` for ``will.delay`` seconds, then send it unless the device came back."""
        self.cancel(client_id)  # an earlier session's, if any: this session's end is later
        self.counters["wills_delayed"] += 1
        self.coordinator.will_held(HeldWill(client_id, epoch, will, time.time() + will.delay))
        self._start(client_id, epoch, will, will.delay)

    def restore(self, held: HeldWill) -> None:
        """A Will a restart found waiting: wait out what is left of its delay."""
        if held.client_id not in self._waiting:
            self._start(held.client_id, held.epoch, held.will, max(0.0, held.due - time.time()))

    def _start(self, client_id: str, epoch: str, will: Will, delay: float) -> None:
        scope = trio.CancelScope()
        self._waiting[client_id] = (epoch, will, scope)
        self.nursery.start_soon(self._wait, client_id, epoch, will, delay, scope)

    def cancel(self, client_id: str) -> None:
        """The device connected again here: its waiting Will is dropped."""
        waiting = self._waiting.pop(client_id, None)
        if waiting is not None:
            waiting[2].cancel()
            self.counters["wills_cancelled"] += 1
            self.coordinator.will_done(client_id, waiting[0])

    def release(self, client_id: str) -> None:
        """The device's session ended (a clean start took its id): its Will goes now."""
        waiting = self._waiting.pop(client_id, None)
        if waiting is not None:
            waiting[2].cancel()
            self.coordinator.will_done(client_id, waiting[0])
            self.publish(client_id, waiting[1])

    def flush(self) -> None:
        """Send every Will still waiting (the server is stopping); kept durably, they
        wait for the next start instead."""
        if self.coordinator.keeps_wills:
            return
        for client_id in list(self._waiting):
            self.release(client_id)

    async def _wait(self, client_id: str, epoch: str, will: Will, delay: float, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(delay)
            latest = None
            try:
                latest = await self.coordinator.lookup(client_id)
            except Exception:  # the registry is unreachable: the Will goes out (its device is not known back)
                logger.warning("Will of %s: presence lookup failed; sending it", shown(client_id), exc_info=True)
            if self._waiting.get(client_id, (None,))[0] != epoch:
                return  # cancelled or replaced while the lookup ran
            del self._waiting[client_id]
            self.coordinator.will_done(client_id, epoch)
            if latest is not None and latest.epoch != epoch:
                # A later session of the device began (on another worker or node).
                self.counters["wills_cancelled"] += 1
                return
            self.publish(client_id, will)
