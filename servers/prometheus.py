"""Prometheus text exposition (format 0.0.4), without a dependency.

Families keep the order of their first sample; each gets ``# HELP`` and ``# TYPE``
once, and its samples stay together even when calls for different families
interleave.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping

import psutil

import idlekeeper

__all__ = ["CONTENT_TYPE", "MetricsWriter"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str] | None, extra: Mapping[str, str] | None = None) -> str:
    merged = {**(labels or {}), **(extra or {})}
    if not merged:
        return ""
    for key in merged:
        if not _LABEL.match(key):
            raise ValueError(f"invalid label name {key!r}")
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in merged.items()) + "}"


class MetricsWriter:
    """Builds one exposition; :meth:`render` returns the text."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[str, str, list[str]]] = {}

    def _family(self, name: str, kind: str, help_text: str) -> list[str]:
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = (kind, help_text, [])
        elif family[0] != kind:
            raise ValueError(f"{name} is a {family[0]}, not a {kind}")
        return family[2]

    def counter(self, name: str, help: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """One counter sample."""
        self._family(name, "counter", help).append(f"{name}{_labels(labels)} {_value(value)}")

    def gauge(self, name: str, help: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """One gauge sample."""
        self._family(name, "gauge", help).append(f"{name}{_labels(labels)} {_value(value)}")

    def histogram(
        self,
        name: str,
        help: str,
        buckets: Iterable[tuple[float, int]],
        count: int,
        sum: float,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        """A histogram from cumulative ``(upper bound, count)`` buckets ending at ``inf``."""
        samples = self._family(name, "histogram", help)
        for bound, n in buckets:
            samples.append(f"{name}_bucket{_labels(labels, {'le': _value(bound)})} {n}")
        samples.append(f"{name}_count{_labels(labels)} {count}")
        samples.append(f"{name}_sum{_labels(labels)} {_value(sum)}")

    def keeper_stats(
        self, stats: idlekeeper.KeeperStats, labels: Mapping[str, str] | None = None, prefix: str = "idlekeeper"
    ) -> None:
        """A keeper's statistics."""
        self.gauge(f"{prefix}_watched", "Connections inside a keeper.watch block.", stats.watched, labels)
        self.gauge(f"{prefix}_filed", "Entries in the timing wheel.", stats.filed, labels)
        for reason, n in stats.expired.items():
            self.counter(f"{prefix}_expired_total", "Expiries by reason.", n, {**(labels or {}), "reason": str(reason)})
        self.counter(f"{prefix}_refiles_total", "Lazy re-files of entries that had activity.", stats.refiles, labels)
        self.counter(f"{prefix}_wakeups_total", "Reaper wake-ups.", stats.wakeups, labels)
        self.counter(
            f"{prefix}_stall_saves_total", "Expiries skipped: the peer's bytes were unread.", stats.stall_saves, labels
        )
        self.counter(f"{prefix}_hook_errors_total", "on_expire hooks that failed.", stats.hook_errors, labels)
        self.counter(
            f"{prefix}_reaper_busy_seconds_total", "Time the reaper spent working.", stats.busy_seconds, labels
        )
        self.histogram(
            f"{prefix}_reaper_lag_seconds",
            "How far past its deadline each expiry ran.",
            stats.lag.cumulative(),
            stats.lag.count,
            stats.lag.sum,
            labels,
        )

    def process(self, labels: Mapping[str, str] | None = None) -> None:
        """RSS, open files and CPU of the current process."""
        proc = psutil.Process(os.getpid())
        cpu = proc.cpu_times()
        self.gauge("process_resident_memory_bytes", "Resident memory.", proc.memory_info().rss, labels)
        self.gauge("process_open_fds", "Open file descriptors.", proc.num_fds(), labels)
        self.counter("process_cpu_seconds_total", "User and system CPU time.", cpu.user + cpu.system, labels)

    def render(self) -> str:
        """The exposition text."""
        lines: list[str] = []
        for name, (kind, help_text, samples) in self._families.items():
            lines.append(f"# HELP {name} {_escape(help_text)}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)
        return "\n".join(lines) + "\n"
