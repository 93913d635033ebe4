"""The fleet workload: gateways, devices and the faults, the timeline of a run's phases,
and the generators' specs, dealt as for one server and then given the gateways."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..generator.spec import GeneratorSpec
from ..workload import FILE_BUDGET, DeviceLoad, Timeline, opening, specs

__all__ = ["FleetLoad", "FleetTimeline", "fleet_specs", "plan_fleet"]


@dataclass
class FleetLoad:
    """The fleet workload: gateways, devices, their behaviour and the faults."""

    nodes: int = 3
    devices: int = 3_000
    workers_per_node: int | None = None
    """None: enough for each gateway's share, counting the killed gateway's devices."""
    keepalive: int = 10
    jitter: float = 0.2
    silent: float = 0.05
    reconnect: float = 0.04
    rate: float = 2_000.0
    kill_node: bool = False
    redis_restart: bool = False
    outage: float = 3.0
    """Seconds Redis stays down in ``--redis-restart``."""
    sentinel: bool = False
    """Redis as a primary, two replicas and three Sentinels; the gateways find the primary through them."""
    failover: bool = False
    """With ``sentinel``: SIGKILL the primary mid-run, and the Sentinels promote a replica.
    With ``redis_cluster``: each primary has a replica; SIGKILL the one serving the most
    presence shards mid-run, and the cluster promotes its replica."""
    redis_cluster: bool = False
    """Redis as a Redis Cluster of three primaries (a replica each with ``failover``);
    the gateways are given redis+cluster://..."""
    shards: int = 16
    """With ``redis_cluster``: the presence shards (``?shards=``)."""
    migrate: bool = False
    """With ``redis_cluster``: move a third of the shards' slots and the hub's to another primary mid-run."""
    failover_delay: tuple[float, float] | None = None
    """A failing-over device's back-off, (min, max) s; None: (0.5, K)."""
    lease: float = 10.0
    """The gateways' ``--lease``: a killed node is swept after it lapses."""
    tick: float = 0.1
    per_generator: int = FILE_BUDGET
    seed: int = 1
    protocol: str = "3.1.1"
    """The devices' MQTT version, or a mix (:mod:`loadtest.mqtt_versions`)."""

    def workers(self) -> int:
        """Workers per gateway: the busiest gateway's share within the per-process file budget."""
        if self.workers_per_node is not None:
            return self.workers_per_node
        survivors = max(1, self.nodes - 1) if self.kill_node else self.nodes
        # A tenth more than an even share: devices pick gateways at random, and a
        # reconnecting device holds two sockets for a while.
        return max(1, math.ceil(self.devices * 1.1 / survivors / FILE_BUDGET))

    def delay(self) -> tuple[float, float]:
        """The failover back-off range."""
        return self.failover_delay or (0.5, float(self.keepalive))

    def device_load(self) -> DeviceLoad:
        """The per-device part, in the shape :func:`loadtest.workload.specs` deals out."""
        return DeviceLoad(
            devices=self.devices,
            keepalive=self.keepalive,
            jitter=self.jitter,
            silent=self.silent,
            reconnect=self.reconnect,
            rate=self.rate,
            per_generator=self.per_generator,
            seed=self.seed,
            protocol=self.protocol,
        )


@dataclass
class FleetTimeline:
    """When each phase starts (``CLOCK_MONOTONIC`` seconds, shared by every process)."""

    start: float
    acts: float
    detect_by: float
    kill: float | None
    redis_down: float | None
    redis_up: float | None
    wave2: float
    end: float

    def phase(self, now: float) -> str:
        """The phase a run is in at ``now``."""
        if now < self.start:
            return "starting"
        if now < self.acts:
            return "connecting / settling"
        if now < self.detect_by:
            return "silencing, reconnecting, detecting"
        if self.kill is not None and now < (self.redis_down or self.wave2):
            return "node killed: failing over"
        if self.redis_down is not None and self.redis_up is not None and now < self.redis_up:
            return "redis down"
        if now < self.wave2:
            return "redis back: resynchronising"
        if now < self.end:
            return "second wave of reconnects"
        return "finishing"


FAILOVER_ALLOWANCE = 6.0
"""Seconds a failover is given in the plan (the Sentinels' ``down-after-milliseconds``, or the
cluster's ``cluster-node-timeout``, 2000, then the election)."""


MIGRATION_ALLOWANCE = 5.0
"""Seconds given in the plan to a slot migration (and a second more per 20,000 devices)."""


def plan_fleet(load: FleetLoad, generators: int) -> FleetTimeline:
    """Lay the phases out from now; each fault gets a phase of its own, so what it causes is its own."""
    k = load.keepalive
    start, acts, detect_by = opening(load.devices, load.rate, k, generators)
    t = detect_by
    kill = None
    if load.kill_node:
        kill = t
        # The lease lapses, a survivor sweeps, and the slowest device has failed over.
        t += max(load.lease + 3.0, load.delay()[1] + 2.0)
    redis_down = redis_up = None
    if load.redis_restart:
        redis_down = t
        redis_up = t + load.outage
        t = redis_up + load.lease + 3.0  # every node has found its lease gone and resynchronised
    elif load.migrate:
        redis_down = t  # the slots start moving; the run goes on while they do
        t += MIGRATION_ALLOWANCE + load.devices / 20_000
    elif load.failover:
        redis_down = t  # the primary is killed; a replica is promoted a few seconds on
        t += FAILOVER_ALLOWANCE + load.lease + 3.0
    wave2 = t
    end = wave2 + k / 2 + 3.0
    return FleetTimeline(start, acts, detect_by, kill, redis_down, redis_up, wave2, end)


def fleet_specs(load: FleetLoad, timeline: FleetTimeline, ports: list[int], workdir: Path) -> list[GeneratorSpec]:
    """The generators' specs: the devices dealt as for one server, then given the gateways,
    failover, and every other reconnect moved to the second wave."""
    dl = load.device_load()
    one = Timeline(timeline.start, timeline.acts, timeline.detect_by, None, None, timeline.end)
    out = specs(dl, one, ports[0], workdir)
    shift = timeline.wave2 - timeline.acts
    for spec in out:
        spec.ports = list(ports)
        spec.failover = True
        spec.failover_delay = load.delay()
        spec.end_at = timeline.end
        spec.reconnect = [(i, at + shift if n % 2 else at) for n, (i, at) in enumerate(spec.reconnect)]
    return out
