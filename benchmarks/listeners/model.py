"""What a run of ``python -m benchmarks.listeners`` is: its size, and the figures it
keeps per listener, per target and for the whole run."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KINDS", "TARGETS", "ListenerResult", "Load", "Report", "TargetResult"]

KINDS = ("mqtt", "mqtts", "ws")
"""The three listeners, by the scheme of their ``--listener`` URL."""
TARGETS = ("idlekeeper", "mosquitto")
"""The servers measured, ours first."""


@dataclass(frozen=True)
class Load:
    """How big and how long a run is."""

    devices: int = 1000
    """Devices on each listener."""
    keepalive: int = 5
    seconds: float = 20.0
    """The measured window, in which every device pings on its keep-alive."""
    open_timeout: float = 180.0
    """Seconds every target's devices together may take to connect."""
    seed: int = 63

    def __post_init__(self) -> None:
        # Three listeners' devices are this process's sockets, under its 20,000 files.
        if not 1 <= self.devices <= 5000:
            raise ValueError("--devices must be 1..5000 (a listener; this process holds all three kinds)")
        if not 1 <= self.keepalive <= 60:
            raise ValueError("--keepalive must be 1..60 seconds")
        if not 1 <= self.seconds <= 300:
            raise ValueError("--seconds must be in [1, 300]")


@dataclass
class ListenerResult:
    """One listener's figures on one target."""

    name: str
    connected: int = 0
    open_errors: int = 0
    closed_by_server: int = 0
    """Devices the server closed before the end of the window (none should be)."""
    heartbeats: int = 0
    """PINGRESPs received in the window."""
    unanswered: int = 0
    """PINGREQs still without a PINGRESP at the end (after a short drain)."""
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan
    connect_p50_ms: float = math.nan
    """From the TCP connect to the CONNACK (TLS handshake and WebSocket upgrade included)."""
    connect_p99_ms: float = math.nan


@dataclass
class TargetResult:
    """One target's figures."""

    name: str
    devices: int = 0
    """Devices connected, all listeners."""
    listeners: dict[str, ListenerResult] = field(default_factory=dict)
    rss_before: int = 0
    rss_after: int = 0
    rss_per_device: float = math.nan
    cpu_seconds: float = math.nan
    """The server's CPU over the window."""
    heartbeats: int = 0
    cpu_per_1000_heartbeats: float = math.nan
    """Server CPU seconds per 1,000 heartbeats answered in the window."""
    client_cpu: float = math.nan
    """This process's CPU over the window, in cores: near 1.0, the client is the bottleneck."""
    window_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    """Ours only: what /metrics and /presence.json said per listener, and the check."""
    problems: list[str] = field(default_factory=list)
    note: str = ""
    """Why it did not run, if it did not."""


@dataclass
class Report:
    """A whole run."""

    load: Load
    machine: dict[str, Any]
    targets: dict[str, TargetResult] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every target that ran passed its checks, and at least one ran."""
        ran = [t for t in self.targets.values() if not t.note]
        return bool(ran) and not any(t.problems for t in ran)

    def as_json(self) -> dict[str, Any]:
        """The report as plain data (``--json``)."""
        return {
            "load": asdict(self.load),
            "machine": self.machine,
            "targets": {name: asdict(t) for name, t in self.targets.items()},
            "ratios_ours_over_mosquitto": self.ratios,
            "ok": self.ok,
        }
