"""Slow readers: peers that open ``/flood`` (the app sends 64 KiB messages until the
client is gone) with a small receive buffer, and stop reading after the ``101``.

Whether and when the server lets go of each is read from the server's side, as
``loadtest http`` times its slow readers (:func:`loadtest.http.attack.watch_release`): a
close queued behind bytes the client never reads reaches the client never, but the
server has let go. Its RSS is sampled meanwhile; the peak over the baseline, per reader,
is what it holds for each.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..http.attack import watch_release
from ..sampler import Sampler
from ..stats import percentile
from .connect import close_all, open_websockets

__all__ = ["SlowFigures", "slow_readers"]

RCVBUF = 4096
"""The readers' receive buffer, set before ``connect()``: the server's writes stall early."""


@dataclass
class SlowFigures:
    """What :func:`slow_readers` saw."""

    readers: int = 0
    open_errors: int = 0
    window_s: float = 0.0
    cut: int = 0
    cut_after_s: list[float] = field(default_factory=list)
    """For each reader let go: from its ``101`` (when it stopped reading) to the release."""
    rss_before: int = 0
    rss_peak: int = 0
    per_reader: float = math.nan
    """Peak server RSS over the baseline, per reader, in bytes."""

    @property
    def cut_p50_s(self) -> float:
        """The median time to a reader's release."""
        return percentile(self.cut_after_s, 50)

    @property
    def cut_max_s(self) -> float:
        """The longest one."""
        return max(self.cut_after_s, default=math.nan)


def slow_readers(port: int, pids: list[int], n: int, window: float) -> SlowFigures:
    """``n`` readers of ``/flood`` that stop reading, watched for ``window`` s."""
    figures = SlowFigures(window_s=window)
    with Sampler(lambda: pids, interval=0.25) as sampler:
        figures.rss_before = sampler.take().rss
        opened = open_websockets(port, n, path="/flood", rcvbuf=RCVBUF)
        try:
            figures.readers, figures.open_errors = len(opened.peers), opened.errors
            since = {peer.address: peer.opened_at for peer in opened.peers}
            released = watch_release(since, pids, port, time.monotonic() + window)
            sampler.take()  # the state at the end, whatever the thread's phase
        finally:
            close_all(opened.peers)
    figures.cut = len(released)
    figures.cut_after_s = sorted(released.values())
    figures.rss_peak = max(s.rss for s in sampler.samples)
    if figures.readers:
        figures.per_reader = (figures.rss_peak - figures.rss_before) / figures.readers
    return figures
