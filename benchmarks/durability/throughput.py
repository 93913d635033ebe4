"""QoS 1 throughput with what the server must keep: messages queued for absent
persistent subscribers, and retained updates.

``subscribers`` clients (CleanSession 0) subscribe ``bench/q/#`` at QoS 1 and leave;
``publishers`` clients then publish ``messages`` QoS 1 messages each on
``bench/q/<publisher>``, at most ``window`` unacknowledged each: every message is
queued once per subscriber. Then each publishes ``retained`` QoS 1 messages with
RETAIN on distinct topics ``bench/r/<publisher>/<n>``. Each phase's rate is the
messages PUBACKed over the seconds from the first PUBLISH to the last PUBACK.

Afterwards one subscriber comes back and is counted: it must get every message that
was PUBACKed, and a new subscription to ``bench/r/#`` every retained one.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .clients import Publisher, Subscriber, drive
from .targets import Target

__all__ = ["Load", "Rates", "fresh_target", "measure_rates"]


@dataclass(frozen=True)
class Load:
    """The throughput part's sizes."""

    subscribers: int = 10
    publishers: int = 4
    messages: int = 5000
    """QoS 1 messages per publisher to the absent subscribers (each subscriber queues them all)."""
    retained: int = 5000
    """Retained updates per publisher."""
    window: int = 32
    size: int = 32
    limit: float = 120.0
    """Seconds a phase may take at most."""

    @property
    def per_subscriber(self) -> int:
        """Messages each absent subscriber queues."""
        return self.publishers * self.messages


@dataclass(frozen=True)
class Rates:
    """One server's figures in one round."""

    queued: float
    """QoS 1 messages PUBACKed a second, each queued for every absent subscriber."""
    retained: float
    """Retained updates PUBACKed a second."""
    acked: int
    delivered: int
    """Of the PUBACKed queued messages, those the subscriber that came back got."""
    retained_acked: int
    retained_seen: int
    """Of the PUBACKed retained messages, those a new subscription got."""
    queued_cpu: float = 0.0
    """The server's CPU over the queued phase, in per cent of one core."""
    retained_cpu: float = 0.0
    """Likewise over the retained phase."""


def _cpu(pids: list[int]) -> float:
    """CPU seconds the processes have used (user and system)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def _phase(
    target: Target, load: Load, prefix: str, count: int, retain: bool
) -> tuple[float, float, set[tuple[str, int]]]:
    """One phase's rate (messages PUBACKed a second), the server's CPU (%), and what was PUBACKed."""
    publishers = [
        Publisher(f"{prefix}-{j}", f"bench/{prefix}/{j}", 1, count=count, window=load.window, size=load.size,
                  retain=retain)
        for j in range(load.publishers)
    ]  # fmt: skip
    for p in publishers:
        p.open(target.port, clean=True)
    used = _cpu(target.pids)
    drive(publishers, lambda: all(p.done for p in publishers), load.limit)
    used = _cpu(target.pids) - used
    acked = {(p.topic, seq) for p in publishers for seq in p.acked}
    first = min(p.first_sent for p in publishers)
    last = max(p.last_acked for p in publishers)
    for p in publishers:
        p.leave()
    seconds = last - first
    if seconds <= 0:
        return 0.0, 0.0, acked
    return len(acked) / seconds, 100 * used / seconds, acked


def measure_rates(target: Target, load: Load) -> Rates:
    """Start ``target``, measure both phases, count what comes back, stop it."""
    target.start()
    try:
        port = target.port
        for i in range(load.subscribers):
            sub = Subscriber(f"sub-{i}")
            sub.open(port, clean=False)
            sub.subscribe([("bench/q/#", 1)])
            sub.leave()
        queued_rate, queued_cpu, acked = _phase(target, load, "q", load.messages, retain=False)
        retained_rate, retained_cpu, retained_acked = _phase(target, load, "r", load.retained, retain=True)
        back = Subscriber("sub-0")
        back.open(port, clean=False)
        drive([back], lambda: len(back.got) >= len(acked), load.limit, quiet=5)
        delivered = len(acked & set(back.got))
        back.leave()
        reader = Subscriber("reader")
        reader.open(port, clean=True)
        reader.subscribe([("bench/r/#", 0)])
        drive([reader], lambda: len(reader.got) >= len(retained_acked), load.limit, quiet=5)
        seen = {(topic.rpartition("/")[0], seq) for topic, seq in reader.got}
        retained_seen = len(retained_acked & seen)
        reader.leave()
    finally:
        target.stop()
    return Rates(
        queued_rate, retained_rate, len(acked), delivered, len(retained_acked), retained_seen, queued_cpu, retained_cpu
    )


def fresh_target(mode: str, port: int, workdir: Path, load: Load, cpus: set[int] | None) -> Target:
    """A target for one round, its state in a directory of its own under ``workdir``."""
    stamp = f"{mode}-{time.monotonic_ns()}"
    directory = workdir / stamp
    directory.mkdir(parents=True)
    return Target(mode, port, directory, max_queued=load.per_subscriber + 1000, cpus=cpus)
