"""One attack on one server, from start to stop: the server started afresh with the
attack's options, the healthy fleet beside it (:mod:`.fleet_process`), then in turn
the attack's victims (:meth:`~.attack.Attack.prepare`), a baseline with no attack, the
attack, and its checks (:meth:`~.attack.Attack.verify`), with the server's RSS
sampled throughout; then everything stopped by PID and the presence log read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from ..sampler import processes, rss_bytes
from .attack import Attack, Scene
from .fleet import device_ids
from .fleet_process import FleetOptions, HealthyFleet
from .observation import Observation
from .presence_audit import read_log
from .targets import is_ours, start_target

__all__ = ["RunOptions", "run_attack"]

PREPARE_LIMIT = 15.0
"""Seconds the victims may take to connect and subscribe."""
OVERRUN = 10.0
"""Seconds an attack may run past its time before it is cut (its own loops stop on time)."""
VERIFY_LIMIT = 15.0
"""Seconds its checks may take."""
SAMPLE_EVERY = 0.2
"""Seconds between RSS samples."""
TAG = "healthy"


@dataclass(frozen=True)
class RunOptions:
    """How long each phase lasts and how big the fleet is."""

    seconds: float = 8.0
    """The attack's time."""
    baseline: float = 3.0
    """The no-attack phase before it."""
    fleet: FleetOptions = field(default_factory=FleetOptions)
    ours_root: str | None = None
    """The source tree our server runs from (default: this one)."""


@dataclass
class _Phases:
    baseline: tuple[float, float] = (0.0, 0.0)
    window: tuple[float, float] = (0.0, 0.0)
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0


async def _play(attack: Attack, scene: Scene, options: RunOptions, pids: list[int]) -> _Phases:
    phases = _Phases()
    procs = processes(pids, trees=True)

    async def sample() -> None:
        while True:
            phases.rss_peak = max(phases.rss_peak, rss_bytes(procs))
            await trio.sleep(SAMPLE_EVERY)

    async with trio.open_nursery() as nursery:
        with trio.fail_after(PREPARE_LIMIT):
            await attack.prepare(scene, nursery)
        began = time.monotonic()
        await trio.sleep(options.baseline)
        phases.baseline = (began, time.monotonic())
        phases.rss_before = phases.rss_peak = rss_bytes(procs)
        nursery.start_soon(sample)
        began = time.monotonic()
        with trio.move_on_after(scene.seconds + OVERRUN) as cut:
            await attack.run(scene)
        if cut.cancelled_caught:
            scene.outcome.notes.append(f"the attack overran its {scene.seconds:g} s by {OVERRUN:g} s and was cut")
        # What the attack left behind (records, retained messages, held filters) stays
        # under measure for the whole window, however soon the attacker was done.
        await trio.sleep(max(0.0, began + scene.seconds - time.monotonic()))
        phases.window = (began, time.monotonic())
        with trio.move_on_after(VERIFY_LIMIT) as cut:
            await attack.verify(scene)
        if cut.cancelled_caught:
            scene.outcome.notes.append(f"the checks after the attack took over {VERIFY_LIMIT:g} s and were cut")
        phases.rss_after = rss_bytes(procs)
        phases.rss_peak = max(phases.rss_peak, phases.rss_after)
        nursery.cancel_scope.cancel()
    return phases


def run_attack(cls: type[Attack], target: str, options: RunOptions) -> Observation:
    """Run attack ``cls`` on a fresh ``target`` with the healthy fleet beside it.

    Raises RuntimeError (or OSError) when the server, the fleet or the victims could not start.
    """
    attack = cls()
    ours = is_ours(target)
    server = start_target(
        target,
        cls.ours_args if ours else (),
        acl=cls.acl,
        mosquitto_config=cls.mosquitto_config,
        ours_root=options.ours_root,
    )
    try:
        scene = Scene(target, server.port, options.seconds, device_ids(TAG, options.fleet.devices), server.status_port)
        fleet = HealthyFleet.start(
            server.port, options.fleet, presence=server.presence_log is not None, healthz=server.status_port, tag=TAG
        )
        try:
            phases = trio.run(_play, attack, scene, options, server.pids())
        finally:
            report = fleet.stop()
        died = server.died()
        server.stop()
        log = None
        if server.presence_log is not None:
            log = read_log(server.presence_log, set(report.devices + report.probe_ids))
    finally:
        server.stop()
        server.remove()
    return Observation(
        attack=cls.name,
        target=target,
        baseline=phases.baseline,
        window=phases.window,
        fleet=report,
        outcome=scene.outcome,
        rss_before=phases.rss_before,
        rss_peak=phases.rss_peak,
        rss_after=phases.rss_after,
        unit=cls.unit,
        per_unit=cls.per_unit,
        log=log,
        status_port=server.status_port is not None,
        died=died,
    )
