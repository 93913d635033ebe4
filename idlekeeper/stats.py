"""Counters a keeper keeps as it goes, cheap to read at any time (no locking, no copy)."""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable, Iterator

from .deadlines import Reason

__all__ = ["HandshakeFailure", "KeeperStats", "LagHistogram"]


class HandshakeFailure(str, enum.Enum):
    """Why a TLS handshake on a watched connection did not complete."""

    TIMEOUT = "timeout"
    """The handshake deadline passed (a client that stalled mid-handshake, or never began)."""
    ERROR = "error"
    """The peer sent something that is not an acceptable handshake: not TLS at all, no
    shared protocol version or cipher, or a certificate that failed verification."""
    CLOSED = "closed"
    """The peer closed or reset the connection before the handshake completed."""

    def __str__(self) -> str:
        return self.value


DEFAULT_LAG_BOUNDS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class LagHistogram:
    """How far past its deadline each expiry ran, in seconds, Prometheus-style buckets.

    ``counts[i]`` counts observations ``<= bounds[i]`` that are above the previous
    bound; the last count is everything above the last bound (``+Inf``).
    """

    __slots__ = ("bounds", "counts", "count", "sum", "max")

    def __init__(self, bounds: tuple[float, ...] = DEFAULT_LAG_BOUNDS) -> None:
        if list(bounds) != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError("bounds must be strictly increasing")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, value: float) -> None:
        """Record one lag."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value
        if value > self.max:
            self.max = value

    def cumulative(self) -> Iterator[tuple[float, int]]:
        """``(upper bound, count <= bound)`` pairs, ending with ``(inf, total)``."""
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            yield bound, running

    def quantile(self, q: float) -> float:
        """An upper bound of the ``q`` quantile (the bucket's bound); 0.0 if empty."""
        if not self.count:
            return 0.0
        rank = q * self.count
        for bound, running in self.cumulative():
            if running >= rank:
                return min(bound, self.max)
        return self.max


class KeeperStats:
    """Live statistics of one keeper. Read the attributes directly."""

    __slots__ = (
        "watched",
        "expired",
        "refiles",
        "wakeups",
        "stall_saves",
        "stall_graces",
        "hook_errors",
        "hooks_cancelled",
        "closed_watches",
        "pass_yields",
        "timers_fired",
        "busy_seconds",
        "lag",
        "handshakes",
        "handshake_failures",
        "_filed",
    )

    def __init__(self, filed: Callable[[], int]) -> None:
        self.watched = 0
        """Connections inside a ``with keeper.watch(...)`` block right now."""
        self.expired: dict[Reason, int] = {reason: 0 for reason in Reason}
        """Expiries so far, by reason."""
        self.refiles = 0
        """Entries that came due, turned out to have had activity, and were filed again."""
        self.wakeups = 0
        """Times the reaper woke up."""
        self.stall_saves = 0
        """Inactivity expiries skipped because the peer's bytes were waiting unread."""
        self.stall_graces = 0
        """Absolute deadlines (and timers that asked, :meth:`~idlekeeper.Keeper.late_with_unread`)
        given one tick more because they were reached more than a tick late, a stall of
        ours, with the peer's bytes waiting unread: bytes that may have come in time."""
        self.hook_errors = 0
        """Callbacks (``on_expire`` hooks, timer callbacks) that raised or overran
        ``hook_timeout``."""
        self.hooks_cancelled = 0
        """Callbacks running as tasks (async, or :func:`~idlekeeper.in_thread` not yet
        started) that the keeper's close cancelled; each close that cancels any logs
        them."""
        self.closed_watches = 0
        """Watches still live when the keeper closed, ended by the close."""
        self.pass_yields = 0
        """Times a reaper pass stopped to let the rest of the program run (one every
        :data:`~idlekeeper.keeper.REAP_CHUNK` entries of a long pass)."""
        self.timers_fired = 0
        """Delayed callbacks run by the reaper."""
        self.busy_seconds = 0.0
        """Wall time (``perf_counter``) the reaper spent working, sleeps excluded."""
        self.lag = LagHistogram()
        """How far past its deadline each expiry happened."""
        self.handshakes = 0
        """TLS handshakes completed on connections served with an ``ssl_context``."""
        self.handshake_failures: dict[HandshakeFailure, int] = {failure: 0 for failure in HandshakeFailure}
        """TLS handshakes that did not complete, by why (a timeout is also an
        :attr:`Reason.ABSOLUTE <idlekeeper.Reason.ABSOLUTE>` expiry)."""
        self._filed = filed

    @property
    def filed(self) -> int:
        """Entries in the wheel (connections with a deadline, plus pending timers)."""
        return self._filed()

    @property
    def expired_total(self) -> int:
        """All expiries, any reason."""
        return sum(self.expired.values())

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly snapshot."""
        return {
            "watched": self.watched,
            "filed": self.filed,
            "expired": {str(k): v for k, v in self.expired.items()},
            "refiles": self.refiles,
            "wakeups": self.wakeups,
            "stall_saves": self.stall_saves,
            "stall_graces": self.stall_graces,
            "hook_errors": self.hook_errors,
            "hooks_cancelled": self.hooks_cancelled,
            "closed_watches": self.closed_watches,
            "pass_yields": self.pass_yields,
            "timers_fired": self.timers_fired,
            "busy_seconds": self.busy_seconds,
            "handshakes": self.handshakes,
            "handshake_failures": {str(k): v for k, v in self.handshake_failures.items()},
            "lag": {
                "count": self.lag.count,
                "sum": self.lag.sum,
                "max": self.lag.max,
                "buckets": [[b if math.isfinite(b) else "+Inf", n] for b, n in self.lag.cumulative()],
            },
        }
