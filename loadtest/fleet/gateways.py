"""The gateways of a fleet run: each a ``servers.heartbeat --cluster`` supervisor and its
workers, started on ports of their own, sampled, asked for their ``/metrics``, and one of
them killed as a crash kills it."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..processes import free_port, start_heartbeat, stop
from ..sampler import Metrics, parse_metrics, process_tree, rss_bytes
from .load import FleetLoad

__all__ = ["Gateway", "start_gateways"]


@dataclass
class Gateway:
    """One gateway of the fleet: a supervisor and its workers."""

    name: str
    port: int
    status_port: int
    workers: int
    log: Path
    proc: subprocess.Popen[str]
    killed_at: float | None = None
    rss: list[tuple[float, int]] = field(default_factory=list)
    exit_code: int | None = None
    stop_s: float = math.nan
    """How long its SIGTERM took (the gateway flushes its devices' offline events first)."""

    def pids(self) -> list[int]:
        """The supervisor and its workers."""
        return [p.pid for p in process_tree(self.proc.pid)]

    def kill(self) -> list[int]:
        """SIGKILL every process of the gateway by PID, workers first (a worker that
        outlived its supervisor would end its devices cleanly; a crash does not)."""
        pids = self.pids()
        for pid in [*pids[1:], pids[0]] if pids else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.killed_at = time.monotonic()
        return pids

    def sample_rss(self, now: float) -> None:
        """Record the gateway's RSS (every process) now."""
        if self.killed_at is not None:
            return
        self.rss.append((now, rss_bytes(process_tree(self.proc.pid))))

    def metrics(self) -> Metrics | None:
        """Its workers' ``/metrics`` pages, summed; None if one does not answer."""
        total = Metrics()
        for i in range(self.workers):
            try:
                url = f"http://127.0.0.1:{self.status_port + i}/metrics"
                with urllib.request.urlopen(url, timeout=2.0) as resp:
                    total.add(parse_metrics(resp.read().decode()))
            except (OSError, ValueError):
                return None
        return total

    def queued(self) -> float:
        """Reports its workers' coordinators still hold for Redis (``heartbeat_fleet_queued``); NaN if unknown."""
        m = self.metrics()
        return math.nan if m is None else m.fleet_queued

    def online(self) -> float:
        """Devices online by the workers' own /metrics (NaN if one does not answer)."""
        m = self.metrics()
        return math.nan if m is None else m.online


def start_gateways(load: FleetLoad, url: str, workdir: Path) -> list[Gateway]:
    """Start the gateways, one after the other (each port is free when it is taken)."""
    out: list[Gateway] = []
    workers = load.workers()
    try:
        for i in range(load.nodes):
            name = f"gw{i}"
            port = free_port()
            status = free_port(run=workers)
            log = workdir / f"presence-{name}.jsonl"
            extra = ["--cluster", url, "--node", name, "--presence-log", str(log)]
            extra += ["--status-port", str(status), "--tick", str(load.tick), "--lease", str(load.lease)]
            for attempt in range(3):
                try:
                    # Its stderr is kept with the presence logs: what a failed run is read by.
                    proc = start_heartbeat(port, workers, extra, timeout=30.0, log=workdir / f"{name}.stderr")
                    break
                except RuntimeError:
                    # A free port may be taken before the gateway binds it: the running
                    # gateways' own connections to Redis draw from the same ephemeral range.
                    if attempt == 2:
                        raise
                    port, status = free_port(), free_port(run=workers)
                    extra[extra.index("--status-port") + 1] = str(status)
            out.append(Gateway(name, port, status, workers, log, proc))
    except BaseException:
        for gw in out:
            stop(gw.proc)
        raise
    return out
