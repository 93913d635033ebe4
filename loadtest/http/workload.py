"""The HTTP load test's workload (keep-alive load, then the same beside attackers), the
request every client sends, and the figures a run measures."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..options import fields_from
from ..stats import percentile

__all__ = ["REQUEST", "HttpLoad", "HttpResult", "LoadFigures"]

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
"""The one request of the load, the attackers and the idle connections alike."""


@dataclass(frozen=True)
class HttpLoad:
    """The HTTP workload: keep-alive load alone, then beside attackers. ``loadtest http``
    and ``loadtest compare`` both take their defaults and flags from here."""

    connections: int = 50
    """Keep-alive connections of legitimate load."""
    duration: float = 10.0
    """Seconds of each load phase."""
    slowloris: int = 500
    """Attackers that trickle a header line a second and never end the head."""
    slow_readers: int = 50
    """Attackers that pipeline requests and never read the replies."""
    header_timeout: float = 5.0
    """The servers' header (and keep-alive) timeout, in seconds."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
        """Add the workload's flags; ``prefix`` goes before ``connections`` and ``duration``."""
        d = HttpLoad()
        a = parser.add_argument
        a(
            f"--{prefix}connections",
            type=int,
            default=d.connections,
            help=f"keep-alive load connections (default: {d.connections})",
        )
        a(
            f"--{prefix}duration",
            type=float,
            default=d.duration,
            help=f"seconds of each load phase (default: {d.duration:g})",
        )
        a("--slowloris", type=int, default=d.slowloris, help=f"slowloris attackers (default: {d.slowloris})")
        a("--slow-readers", type=int, default=d.slow_readers, help=f"slow readers (default: {d.slow_readers})")
        a(
            "--header-timeout",
            type=float,
            default=d.header_timeout,
            help=f"the servers' header (and keep-alive) timeout (default: {d.header_timeout:g})",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> HttpLoad:
        """The workload from flags added by :meth:`add_arguments` with the same ``prefix``."""
        return cls(
            **fields_from(args, ("connections", "duration"), prefix),
            **fields_from(args, ("slowloris", "slow_readers", "header_timeout")),
        )


@dataclass
class LoadFigures:
    """Legitimate load: throughput and latency."""

    tool: str
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    user_us: float = math.nan
    """The server's CPU a request in user space (µs): its own code, the interpreter's."""
    kernel_us: float = math.nan
    """The server's CPU a request in the kernel (µs): its system calls, the TCP stack."""


@dataclass
class HttpResult:
    """One target's figures."""

    target: str
    connections: int
    duration: float
    slowloris: int
    slow_readers: int
    header_timeout: float
    alone: LoadFigures | None = None
    attacked: LoadFigures | None = None
    slowloris_hold_s: list[float] = field(default_factory=list)
    slow_reader_hold_s: list[float] = field(default_factory=list)
    slowloris_still_held: int = 0
    slow_readers_still_held: int = 0
    attackers_connected: int = 0
    window_s: float = 0.0
    idle_connections: int = 0
    idle_rss_per_conn: float = math.nan
    """Server RSS added per idle keep-alive connection (bytes), after one request each."""
    alone_rounds: list[LoadFigures] = field(default_factory=list)
    """Every unattacked round, when ``alone`` is their median (``compare --rounds``)."""
    cpus: str = ""
    """Where the server and the load ran, when pinned apart."""
    beside: list[LoadFigures] = field(default_factory=list)
    """Unattacked loads run right before and right after the attacked one (``compare``):
    what the attack costs is read against these, apart from how the shared machine
    drifted in the minutes since the interleaved rounds."""

    def to_json(self) -> dict[str, Any]:
        """Flat figures for the comparison table, plus everything measured."""
        out = asdict(self)

        out.update(
            rps=self.alone.rps if self.alone else math.nan,
            cpu_us=self.alone.user_us + self.alone.kernel_us if self.alone else math.nan,
            p99_ms=self.alone.p99_ms if self.alone else math.nan,
            rps_attack=self.attacked.rps if self.attacked else math.nan,
            p99_ms_attack=self.attacked.p99_ms if self.attacked else math.nan,
            rps_beside=_mean([f.rps for f in self.beside]),
            p99_ms_beside=_mean([f.p99_ms for f in self.beside]),
            slowloris_hold_p50_s=percentile(self.slowloris_hold_s, 50),
            slowloris_hold_max_s=max(self.slowloris_hold_s, default=math.nan),
            slow_reader_hold_p50_s=percentile(self.slow_reader_hold_s, 50),
            slow_reader_hold_max_s=max(self.slow_reader_hold_s, default=math.nan),
        )
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
