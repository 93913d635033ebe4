"""The QoS workload: how many publishers send what, for how long, within which bounds,
and the flags ``loadtest qos`` and ``loadtest compare`` take it from."""

from __future__ import annotations

import argparse
import struct
from dataclasses import dataclass

from ..options import fields_from

__all__ = ["PAYLOAD_HEADER", "QosLoad"]

PAYLOAD_HEADER = struct.Struct("!IIQ")
"""What starts every payload: publisher index, sequence number, send time (``monotonic_ns``)."""

_FLAGS = ("publishers", "payload", "window", "outstanding", "duration", "count", "warmup", "queued", "workers")


@dataclass
class QosLoad:
    """The QoS workload; ``loadtest qos`` and ``loadtest compare`` take flags and defaults from here."""

    publishers: int = 4
    """Publisher connections."""
    payload: int = 64
    """Payload bytes per message (at least the 16-byte header)."""
    window: int = 10
    """PUBLISHes each publisher keeps unacknowledged by the server."""
    outstanding: int = 0
    """Messages published and not yet delivered, over all publishers, at most (0: publishers x window)."""
    duration: float = 10.0
    """Seconds of publishing (the warm-up included)."""
    count: int = 0
    """Messages to publish in all; the run ends at whichever of this and ``duration`` comes first (0: no count)."""
    warmup: float = 1.0
    """Seconds at the start not counted in the rate or the latency (at most half of ``duration``)."""
    queued: int = 50_000
    """Messages queued for the absent persistent session (at least 1)."""
    inflight: int = 20
    """The servers' in-flight window per subscriber (``--max-inflight``, ``max_inflight_messages``)."""
    max_queued: int = 1000
    """The servers' queue per subscriber during the throughput part."""
    workers: int = 1
    """Our server's worker processes (``--workers``): from 2, persistent sessions live
    in the supervisor, and each acknowledgement crosses to it and back."""

    def __post_init__(self) -> None:
        if self.payload < PAYLOAD_HEADER.size:
            raise ValueError(f"payload must hold the {PAYLOAD_HEADER.size}-byte header")
        if min(self.publishers, self.window, self.queued, self.workers) < 1 or self.outstanding < 0:
            raise ValueError("publishers, window, queued and workers must be at least 1, outstanding at least 0")
        if self.cap >= self.max_queued + self.inflight:
            # Beyond this a broker may drop by its own rules, and loss would mean nothing.
            raise ValueError("outstanding must stay below the servers' queue plus in-flight window")

    @property
    def cap(self) -> int:
        """The bound on undelivered messages in force."""
        return self.outstanding or self.publishers * self.window

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
        """Add the workload's flags, each named ``--<prefix><name>``."""
        d = QosLoad()
        a = parser.add_argument
        a(f"--{prefix}publishers", type=int, default=d.publishers, help=f"publishers (default: {d.publishers})")
        a(f"--{prefix}payload", type=int, default=d.payload, help=f"payload bytes (default: {d.payload})")
        a(
            f"--{prefix}window",
            type=int,
            default=d.window,
            help=f"unacknowledged PUBLISHes per publisher (default: {d.window})",
        )
        a(
            f"--{prefix}outstanding",
            type=int,
            default=d.outstanding,
            help="published and not yet delivered, over all publishers (default: 0, publishers x window)",
        )
        a(
            f"--{prefix}duration",
            type=float,
            default=d.duration,
            help=f"seconds of publishing (default: {d.duration:g})",
        )
        a(f"--{prefix}count", type=int, default=d.count, help="stop after this many messages (default: 0, none)")
        a(f"--{prefix}warmup", type=float, default=d.warmup, help=f"seconds not counted (default: {d.warmup:g})")
        a(
            f"--{prefix}queued",
            type=int,
            default=d.queued,
            help=f"messages queued for the absent persistent session (default: {d.queued:,})",
        )
        a(
            f"--{prefix}workers",
            type=int,
            default=d.workers,
            help=f"our server's worker processes; from 2, sessions live in its supervisor (default: {d.workers})",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> QosLoad:
        """The workload from flags added by :meth:`add_arguments` with the same ``prefix``."""
        return cls(**fields_from(args, _FLAGS, prefix))
