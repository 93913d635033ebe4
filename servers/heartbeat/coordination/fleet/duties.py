"""A task the fleet performs once, at one node at a time (:class:`DutyLease`): a bridge
to another broker above all, which, run by every gateway, would send the remote each
message once per gateway.

The duty's key, ``{prefix}duty:{name}``, names the node performing it for ``lease``
seconds: taken when free (``SET NX PX``), kept by its holder alone (``keep_lock.lua``,
the sweep lock's script). When the holder dies or stalls past the lease, another node
takes it over within a lease and a renewal. A holder that cannot renew (Redis away,
or another holds the key) stops at once: two may overlap only for the time a stalled
holder takes to notice, and a bridge's QoS 1 may repeat a message then, as QoS 1 may.
"""

from __future__ import annotations

import contextlib
import time

import coredis
import trio

from .keys import FleetKeys
from .link import RedisLink

__all__ = ["DutyLease"]


class DutyLease:
    """This node's claim on the duty ``name`` of the fleet whose keys are ``keys``."""

    def __init__(self, link: RedisLink, keys: FleetKeys, node: str, name: str, lease: float) -> None:
        self.link = link
        self.key = f"{keys.prefix}duty:{name}"
        self.lease = lease
        # A restarted node is a new holder: it waits for the old claim to lapse.
        self._token = f"{node}@{time.time():.3f}"

    @property
    def renew_every(self) -> float:
        """Seconds between :meth:`hold` calls while holding it: a third of the lease."""
        return self.lease / 3

    async def hold(self) -> bool:
        """Keep the duty if this node holds it, take it if it is free; whether this node
        holds it now. False when Redis does not answer: the holder must stop."""
        ms = int(self.lease * 1000)
        link = self.link
        try:
            if await link.call(link.scripts.keep_lock([self.key], [self._token, str(ms)])):
                return True
            redis = link.redis()
            return bool(await link.call(redis.set(self.key, self._token, condition=coredis.PureToken.NX, px=ms)))
        except (RuntimeError, OSError, trio.TooSlowError, coredis.exceptions.RedisError) as exc:
            if not isinstance(exc, RuntimeError):  # RuntimeError: not connected yet
                link.failed(exc)
            return False

    async def release(self) -> None:
        """Give the duty up now (a clean stop): another node takes it without waiting
        for the lease to run out."""
        link = self.link
        with contextlib.suppress(RuntimeError, OSError, trio.TooSlowError, coredis.exceptions.RedisError):
            await link.call(link.scripts.keep_lock([self.key], [self._token, "1"]))  # else it lapses
