"""What a device run does, and when: the workload, its timeline of phases, and how its
devices are split over generator processes and dealt their roles."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from .generator.spec import GeneratorSpec
from .mqtt_versions import deal

__all__ = [
    "FILE_BUDGET",
    "DeviceLoad",
    "Timeline",
    "generator_count",
    "opening",
    "plan",
    "specs",
    "steady_seconds",
]

FILE_BUDGET = 15_000
"""Devices per generator and per server worker: under the 20,000-file limit, with room
for a reconnecting device's second socket and the kernel's uneven SO_REUSEPORT spread."""


@dataclass
class DeviceLoad:
    """The workload: how many devices, how they behave, what happens to them."""

    devices: int = 20_000
    keepalive: int = 10
    jitter: float = 0.2
    ping_batch: float = 0.2
    """Seconds a device's PINGREQ may wait to share its generator's wake-up with others."""
    silent: float = 0.05
    vanish: float = 0.0
    reconnect: float = 0.0
    stall: bool = False
    stall_keepalives: float = 2.0
    steady: float = 0.0
    """Seconds of steady state (every device online, nothing happening to them) over
    which CPU and RSS are read, if longer than one keep-alive (the default window): on
    a shared machine a few seconds' CPU moves by tens of percent from run to run."""
    rate: float = 2_000.0
    """Connections started per second, over all generators."""
    max_inflight: int = 1_024
    """Connections in their handshake at once, over all generators (the listen queues are finite)."""
    per_generator: int = FILE_BUDGET
    host: str = "127.0.0.1"
    seed: int = 1
    protocol: str = "3.1.1"
    """The MQTT version each device speaks: one for all, or a mix (:mod:`loadtest.mqtt_versions`)."""


@dataclass
class Timeline:
    """When each phase starts, in ``CLOCK_MONOTONIC`` seconds (shared by every process)."""

    start: float
    acts: float
    detect_by: float
    stall: float | None
    stall_end: float | None
    end: float

    def phase(self, now: float) -> str:
        """The phase a run is in at ``now``."""
        if now < self.start:
            return "starting"
        if now < self.acts:
            return "connecting / settling"
        if now < self.detect_by:
            return "silencing, detecting"
        if self.stall is not None and self.stall_end is not None and now < self.stall_end:
            return "server stalled (SIGSTOP)"
        if now < self.end:
            return "watching for false expiries"
        return "finishing"


def generator_count(load: DeviceLoad) -> int:
    """Generator processes for the load: each holds at most ``per_generator`` devices."""
    return max(1, math.ceil(load.devices / load.per_generator))


def opening(
    devices: int, rate: float, keepalive: int, generators: int, steady: float = 0.0
) -> tuple[float, float, float]:
    """When a run of ``devices`` ramped at ``rate`` starts, when its scenarios act (every
    device online and settled, for the longer of a keep-alive and ``steady`` seconds),
    and when every silent device is due; laid out from now."""
    start = time.monotonic() + 2.0 + 0.15 * generators  # generators start and import first
    # A fifth more than the ramp should take: a busy server accepts more slowly, and
    # the scenarios must find every device online.
    acts = start + 1.2 * devices / rate + max(keepalive, steady) + 2.0
    detect_by = acts + keepalive / 2 + 1.5 * keepalive + 1.0
    return start, acts, detect_by


def steady_seconds(load: DeviceLoad) -> float:
    """How long before the scenarios act the steady-state window opens (CPU and RSS are
    read over it, the ramp's end permitting)."""
    return max(float(load.keepalive), load.steady)


def plan(load: DeviceLoad, generators: int) -> Timeline:
    """Lay the phases out from now."""
    k = load.keepalive
    start, acts, detect_by = opening(load.devices, load.rate, k, generators, load.steady)
    if not load.stall:
        return Timeline(start, acts, detect_by, None, None, detect_by + 1.0)
    stall_end = detect_by + load.stall_keepalives * k
    return Timeline(start, acts, detect_by, detect_by, stall_end, stall_end + 1.5 * k + 2.0)


def specs(load: DeviceLoad, timeline: Timeline, port: int, workdir: Path) -> list[GeneratorSpec]:
    """Split the devices over generators and deal out the scenarios."""
    n = load.devices
    generators = generator_count(load)
    share = math.ceil(n / generators)
    rng = random.Random(load.seed)
    order = list(range(n))
    rng.shuffle(order)
    n_silent, n_vanish, n_reconnect = (round(n * f) for f in (load.silent, load.vanish, load.reconnect))
    roles: dict[str, list[int]] = {
        "silent": order[:n_silent],
        "vanish": order[n_silent : n_silent + n_vanish],
        "reconnect": order[n_silent + n_vanish : n_silent + n_vanish + n_reconnect],
    }
    versions = deal(n, load.protocol, load.seed)
    out: list[GeneratorSpec] = []
    for g in range(generators):
        first = g * share
        count = min(share, n - first)
        out.append(
            GeneratorSpec(
                index=g,
                host=load.host,
                port=port,
                source=f"127.0.{(g + 2) // 256}.{(g + 2) % 256}",
                first=first,
                count=count,
                keepalive=load.keepalive,
                jitter=load.jitter,
                ping_batch=load.ping_batch,
                rate=load.rate / generators,
                max_inflight=max(16, load.max_inflight // generators),
                start_at=timeline.start,
                end_at=timeline.end,
                results=str(workdir / f"generator-{g}.json"),
                seed=load.seed,
                versions=versions[first : first + count],
            )
        )
    spread = load.keepalive / 2
    for role, members in roles.items():
        for i in members:
            spec = out[i // share]
            getattr(spec, role).append((i - spec.first, timeline.acts + rng.uniform(0, spread)))
    return out
