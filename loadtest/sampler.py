"""What the server under test costs, over time: RSS, CPU and open files of all its
processes (psutil), and what its own ``/metrics`` say (devices online, reaper lag).

A :class:`Sampler` runs in a thread of the load tester, so a stalled or busy server
never delays the generators, and a ``/metrics`` endpoint that does not answer in
time is simply a missed sample.
"""

from __future__ import annotations

import contextlib
import math
import platform
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil
from prometheus_client.parser import text_string_to_metric_families

from servers.prometheus import open_descriptors

__all__ = [
    "Metrics",
    "Sample",
    "Sampler",
    "cpu_model",
    "cpu_seconds",
    "cpu_split",
    "histogram_quantile",
    "parse_metrics",
    "process_tree",
    "processes",
    "rss_bytes",
]


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo), for the record of a run."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def process_tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants (a supervisor and its workers)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def processes(pids: Iterable[int], *, trees: bool = False) -> list[psutil.Process]:
    """The processes ``pids`` name (with ``trees``, each with its descendants), each
    once: a server's pids are often a supervisor and its workers already, and a
    worker counted twice would double its memory."""
    seen: dict[int, psutil.Process] = {}
    for pid in pids:
        if trees:
            found = process_tree(pid)
        else:
            try:
                found = [psutil.Process(pid)]
            except psutil.NoSuchProcess:
                found = []
        for proc in found:
            seen.setdefault(proc.pid, proc)
    return list(seen.values())


def rss_bytes(procs: Iterable[psutil.Process]) -> int:
    """The resident memory of ``procs`` together (those gone meanwhile count nothing)."""
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


def cpu_seconds(procs: Iterable[psutil.Process]) -> float:
    """The user and system CPU seconds ``procs`` have used (those gone meanwhile count nothing)."""
    return sum(cpu_split(procs))


def cpu_split(procs: Iterable[psutil.Process]) -> tuple[float, float]:
    """The CPU seconds ``procs`` have used in user space and in the kernel, apart (those
    gone meanwhile count nothing): where a server's time goes, its code or its system calls."""
    user = kernel = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            user += times.user
            kernel += times.system
    return user, kernel


@dataclass
class Metrics:
    """The parts of a Prometheus text page the load tester reads, summed over workers."""

    online: float = 0.0
    lag_buckets: dict[float, float] = field(default_factory=dict)
    """Cumulative reaper-lag histogram: upper bound (s) -> count."""
    lag_count: float = 0.0
    lag_sum: float = 0.0
    stall_saves: float = 0.0
    expired: dict[str, float] = field(default_factory=dict)
    fleet_queued: float = 0.0
    """Reports a fleet node's coordinator still holds for Redis."""

    def add(self, other: Metrics) -> None:
        """Fold another worker's page into this one."""
        self.online += other.online
        for bound, n in other.lag_buckets.items():
            self.lag_buckets[bound] = self.lag_buckets.get(bound, 0.0) + n
        self.lag_count += other.lag_count
        self.lag_sum += other.lag_sum
        self.stall_saves += other.stall_saves
        self.fleet_queued += other.fleet_queued
        for reason, n in other.expired.items():
            self.expired[reason] = self.expired.get(reason, 0.0) + n


def parse_metrics(text: str) -> Metrics:
    """Read devices online, reaper lag, stall saves and expiries from one ``/metrics`` page."""
    m = Metrics()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == "heartbeat_devices_online":
                m.online += value
            elif name == "idlekeeper_reaper_lag_seconds_bucket" and "le" in labels:
                bound = float(labels["le"])  # "+Inf" reads as inf
                m.lag_buckets[bound] = m.lag_buckets.get(bound, 0.0) + value
            elif name == "idlekeeper_reaper_lag_seconds_count":
                m.lag_count += value
            elif name == "idlekeeper_reaper_lag_seconds_sum":
                m.lag_sum += value
            elif name == "heartbeat_fleet_queued":
                m.fleet_queued += value
            elif name == "idlekeeper_stall_saves_total":
                m.stall_saves += value
            elif name == "idlekeeper_expired_total" and "reason" in labels:
                m.expired[labels["reason"]] = m.expired.get(labels["reason"], 0.0) + value
    return m


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` (0..1) of a cumulative histogram."""
    if not buckets:
        return math.nan
    ordered = sorted(buckets.items())
    total = ordered[-1][1]
    if total <= 0:
        return math.nan
    for bound, n in ordered:
        if n >= q * total:
            return bound
    return math.inf


@dataclass
class Sample:
    """One look at the server's processes."""

    t: float
    rss: int
    cpu: float
    fds: int
    processes: int
    online: float = math.nan
    """Devices online by the server's own count (NaN when it has no /metrics)."""


class Sampler:
    """Samples the server every ``interval`` seconds in a background thread."""

    def __init__(
        self,
        pids: Callable[[], list[int]],
        metrics_urls: list[str] | None = None,
        interval: float = 1.0,
        metrics_every: float = 15.0,
    ) -> None:
        self._pids = pids
        self._urls = metrics_urls or []
        self._interval = interval
        # /metrics costs the server something: about 2 ms of a worker's CPU a scrape,
        # mostly prometheus-client rendering it. Every 5 s, 29 workers' scrapes were 0.7
        # of the 6.7 points a 500,000-device run measured per 1,000 heartbeats/s; every
        # 15 s, as Prometheus' example configuration scrapes, they are a third of that.
        # /proc is read from outside, at no cost to the server, every interval.
        self._metrics_every = metrics_every
        self._next_scrape = 0.0
        self._pages: dict[str, Metrics] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self.samples: list[Sample] = []
        self.metrics: Metrics | None = None
        """The last complete scrape of every worker's /metrics."""
        self.stalled = False
        """Set while the server is SIGSTOPped: its /metrics cannot answer, so skip them."""

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def take(self) -> Sample:
        """One sample now (also usable without the thread)."""
        rss = fds = 0
        cpu = 0.0
        alive = 0
        for pid in self._pids():
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                # A stopped process still answers: psutil reads /proc.
                with proc.oneshot():
                    rss += proc.memory_info().rss
                    times = proc.cpu_times()
                    cpu += times.user + times.system
                fds += open_descriptors(pid)
                alive += 1
            except (psutil.Error, OSError):
                self._procs.pop(pid, None)
        sample = Sample(time.monotonic(), rss, cpu, fds, alive)
        if self._urls and not self.stalled and sample.t >= self._next_scrape:
            self._next_scrape = sample.t + self._metrics_every
            scraped = self.scrape()
            if scraped is not None:
                self.metrics = scraped
                sample.online = scraped.online
        self.samples.append(sample)
        return sample

    def scrape(self, timeout: float = 0.5) -> Metrics | None:
        """Every worker's /metrics folded into one, or None until each has answered once.

        A busy worker that misses this round counts with its page from the last
        round it answered, a few seconds old at most.
        """
        for url in self._urls:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as resp:
                    self._pages[url] = parse_metrics(resp.read().decode())
            except (OSError, ValueError):
                continue  # no answer, or not Prometheus text: a missed round for this worker
        if len(self._pages) < len(self._urls):
            return None
        total = Metrics()
        for page in self._pages.values():
            total.add(page)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with contextlib.suppress(Exception):
                self.take()
            self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))
