"""What one generator process runs, as the orchestrator hands it over: a JSON file.

The spec (dealt out by :func:`loadtest.workload.specs`, for a fleet by
:func:`loadtest.fleet.load.fleet_specs`) says which devices to run, where to connect
from (a source address of its own, so each generator has the full ephemeral port
range), how fast to ramp, and when the scenarios happen. Times are ``CLOCK_MONOTONIC``
values, which every process on the machine shares, so the orchestrator, the
generators and the stall all speak of the same instants.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["GeneratorSpec", "read_spec", "write_spec"]


@dataclass
class GeneratorSpec:
    """What one generator runs (JSON-serialisable; see :mod:`loadtest.devices`)."""

    index: int
    host: str
    port: int
    source: str
    first: int
    count: int
    keepalive: int
    jitter: float
    rate: float
    """Connections started per second, at most."""
    max_inflight: int
    start_at: float
    end_at: float
    results: str
    silent: list[tuple[int, float]] = field(default_factory=list)
    """(local device index, when it goes silent)."""
    vanish: list[tuple[int, float]] = field(default_factory=list)
    reconnect: list[tuple[int, float]] = field(default_factory=list)
    seed: int = 0
    prefix: str = "dev"
    ports: list[int] = field(default_factory=list)
    """A fleet's gateways: each device connects to one at random and a reconnecting
    device moves to another (empty: ``port`` alone)."""
    failover: bool = False
    """A device whose connection a gateway closes reconnects to another gateway after
    ``failover_delay`` (as real devices do when their gateway dies); each such close is
    reported in ``drops`` for the orchestrator to judge."""
    failover_delay: tuple[float, float] = (0.5, 2.0)
    """(min, max) seconds a failing-over device waits before reconnecting (uniform)."""
    ping_batch: float = 0.2
    """Seconds a PINGREQ may wait to share a wake-up with others (never early). Real
    clients are no more punctual: paho's network loop checks its keep-alive once a
    loop, up to a second apart."""
    versions: str = ""
    """Each device's MQTT protocol level, one character per device in order: ``"3"``
    (3.1), ``"4"`` (3.1.1), ``"5"`` (5.0); empty: every device 3.1.1
    (:func:`loadtest.mqtt_versions.deal`)."""


def write_spec(spec: GeneratorSpec, path: Path) -> None:
    """Write ``spec`` for the generator process to read back with :func:`read_spec`."""
    path.write_text(json.dumps(asdict(spec)))


def read_spec(path: str) -> GeneratorSpec:
    """The spec :func:`write_spec` wrote, its pairs tuples again (JSON has only lists)."""
    with open(path) as f:
        raw = json.load(f)
    for key in ("silent", "vanish", "reconnect"):
        raw[key] = [tuple(pair) for pair in raw.get(key, [])]
    if "failover_delay" in raw:
        raw["failover_delay"] = tuple(raw["failover_delay"])
    return GeneratorSpec(**raw)
