"""The healthy fleet (:mod:`.fleet`) seen from the runner: its processes started (the
presence watcher first, where there is presence, then the devices), waited for until
connected, stopped by closing their stdin (by PID if they will not go), and their
reports read back and made one."""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
from dataclasses import dataclass
from pathlib import Path

from servers.workers import module_command

from ..processes import stop
from .observation import FleetReport

__all__ = ["FleetOptions", "HealthyFleet"]

READY_TIMEOUT = 30.0
"""Seconds a fleet process may take to connect every client."""
REPORT_TIMEOUT = 30.0
"""Seconds it may take to stop and print its report."""
ROOT = Path(__file__).resolve().parents[2]
"""The repository: the fleet runs from here, so ``-m`` finds it."""


@dataclass(frozen=True)
class FleetOptions:
    """How big the healthy fleet is and how often it pings and reconnects."""

    devices: int = 20
    interval: float = 0.1
    probe_interval: float = 0.5


def _line(proc: subprocess.Popen[str], timeout: float) -> dict[str, object] | None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        return None
    text = proc.stdout.readline()
    if not text:
        return None
    data: dict[str, object] = json.loads(text)
    return data


def _start(args: list[str]) -> subprocess.Popen[str]:
    cmd = [*module_command("loadtest.abuse.fleet"), *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    first = _line(proc, READY_TIMEOUT)
    if not first or not first.get("ready"):
        stop(proc)
        why = first.get("error") if first else f"no word within {READY_TIMEOUT:g} s"
        raise RuntimeError(f"the healthy fleet did not start: {why}")
    return proc


def _finish(proc: subprocess.Popen[str]) -> FleetReport:
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        last = _line(proc, REPORT_TIMEOUT)
    except ValueError as exc:
        last = {"problems": [f"unreadable report: {exc}"]}
    stop(proc)
    if last is None:
        return FleetReport(problems=[f"a fleet process gave no report within {REPORT_TIMEOUT:g} s"])
    if "ready" in last:
        return FleetReport(problems=[f"a fleet process failed: {last.get('error')}"])
    return FleetReport.from_dict(last)


class HealthyFleet:
    """The running fleet: its devices' process, and its presence watcher's if any."""

    def __init__(self, devices: subprocess.Popen[str], watcher: subprocess.Popen[str] | None) -> None:
        self.devices = devices
        self.watcher = watcher

    @classmethod
    def start(
        cls, port: int, options: FleetOptions, *, presence: bool, healthz: int | None, tag: str = "healthy"
    ) -> HealthyFleet:
        """Start the fleet against ``port``; return once every client is connected."""
        common = ["--port", str(port), "--tag", tag]
        watcher = None
        if presence:
            expect = ["--expect", str(options.devices)]
            watcher = _start([*common, "--devices", "0", "--probe-interval", "0", "--presence", *expect])
        devices = [*common, "--devices", str(options.devices), "--interval", str(options.interval)]
        devices += ["--probe-interval", str(options.probe_interval)]
        if healthz is not None:
            devices += ["--healthz", str(healthz)]
        try:
            return cls(_start(devices), watcher)
        except BaseException:
            if watcher is not None:
                stop(watcher)
            raise

    def stop(self) -> FleetReport:
        """Stop the devices, then the watcher (which hears them go); their reports as one."""
        report = _finish(self.devices)
        if self.watcher is not None:
            heard = _finish(self.watcher)
            report.presence = heard.presence
            report.subscribed = heard.subscribed
            report.dropped += heard.dropped
            report.problems += heard.problems
        return report
