"""CONNECTs per source address per second, sans-IO: a token bucket for each address.

One address may not make the server do the work of a CONNECT (a session, a record,
perhaps a password check) faster than ``rate`` a second, after a burst of
``burst``. The burst is large on purpose: a NAT gateway in front of thousands of
devices sees them all reconnect at once after its uplink comes back, and they must
get in; what the bound stops is one address connecting without end. Past it, the
CONNECT is refused with 3 (server unavailable: the client retries later), before
any password is hashed.

Addresses are keyed as the password throttle keys them (an IPv6 address by its
/64: :func:`~.throttle.source_key`). At most ``max_sources`` buckets are kept; a full
bucket is the same as none, so those go first when room is needed, and the rest
oldest first.
"""

from __future__ import annotations

import collections

__all__ = ["DEFAULT_CONNECT_RATE", "ConnectRate"]

DEFAULT_CONNECT_RATE = 1000.0
"""CONNECTs a second one source address may make unless told otherwise."""
BURST_SECONDS = 60.0
"""The burst one address may make at once, in seconds of its rate."""


class ConnectRate:
    """Token buckets of CONNECTs per source, on the caller's monotonic clock."""

    __slots__ = ("rate", "burst", "max_sources", "refused", "_buckets")

    def __init__(self, rate: float = DEFAULT_CONNECT_RATE, burst: float | None = None, max_sources: int = 100_000):
        if rate <= 0:
            raise ValueError(f"the rate must be positive, not {rate}")
        self.rate = rate
        self.burst = rate * BURST_SECONDS if burst is None else burst
        self.max_sources = max_sources
        self.refused = 0
        # source -> [tokens, when counted]; oldest change first.
        self._buckets: collections.OrderedDict[str, list[float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def admit(self, source: str, now: float) -> bool:
        """Whether a CONNECT from ``source`` may go on at ``now`` (it takes a token)."""
        bucket = self._buckets.get(source)
        if bucket is None:
            if len(self._buckets) >= self.max_sources:
                self._make_room(now)
            bucket = self._buckets[source] = [self.burst, now]
        else:
            bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
            self._buckets.move_to_end(source)
        if bucket[0] < 1.0:
            self.refused += 1
            return False
        bucket[0] -= 1.0
        return True

    def _make_room(self, now: float) -> None:
        # A bucket that has refilled says nothing a new one would not: drop those, from
        # the oldest; if none has, drop the oldest anyway (its source gets a full burst back).
        refill = self.burst / self.rate
        full = [s for s, (_, at) in self._buckets.items() if now - at >= refill]
        for source in full[: max(1, len(self._buckets) // 10)]:
            del self._buckets[source]
        while len(self._buckets) >= self.max_sources:
            self._buckets.popitem(last=False)
