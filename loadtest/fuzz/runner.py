"""Running ``python -m loadtest fuzz`` against one server: start it, keep a canary beside
it, send every input over many concurrent loopback connections, and watch the server.

One trio process drives everything: ``--connections`` tasks each take the next case
(:func:`~.cases.make_case`), open a socket from one of several loopback source
addresses (127.0.0.2, 127.0.0.3, ...: plenty of ephemeral ports), send the case's
pieces, then half-close, wait or reset as the case says, and read whatever the
server answers until it closes or :attr:`~.targets.ServerSpec.wait` passes. Meanwhile:

- a **watchdog** polls the server process; if it dies, the run stops at once and the
  inputs in flight are kept as reproducers;
- a **canary** (:class:`~.canary_mqtt.MqttCanary`, :class:`~.canary_http.HttpCanary`)
  behaves well throughout and must see nothing wrong;
- after a **warm-up** (a tenth of the inputs) and after the run, the driver waits until
  the server's open files are back to where they were, and takes its RSS then, so
  that growth per input is measured between two quiet points.

The servers, with their short timeouts, are :mod:`.targets`'; one connection is
:func:`~.connection.run_case`; the canary's process is
:class:`~.canary_process.CanaryProcess`. The server's stderr goes to a file the
judge reads, and the server is stopped with SIGTERM by PID.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import trio

from servers.prometheus import open_descriptors

from ..processes import free_port, stop
from ..sampler import cpu_seconds, process_tree, rss_bytes
from .canary_process import CanaryProcess
from .cases import make_case
from .connection import run_case
from .corpus import V5_SHARE
from .faults import fault_peers, log_faults
from .judge import suspects_at, unclear
from .observation import ConnRecord, Observation
from .targets import ServerSpec, start_server

__all__ = ["FuzzOptions", "run_target"]

QUIET_TIMEOUT = 15.0
"""Seconds to wait for the server's open files to come back after a phase."""
REPLAY_SAMPLE = 50
"""Connections held open during the run that are sent again alone after it."""
REPLAY_CONNECTIONS = 10
"""Connections at a time for that replay."""
SUSPECT_WINDOW = 1.0
"""Inputs finished this long before the server was found dead are suspects too."""
MAX_SUSPECTS = 200
"""Reproducers kept of the inputs in flight when the server died, at most."""


@dataclass
class FuzzOptions:
    """What a run does."""

    inputs: int
    seed: int
    connections: int = 200
    max_seconds: float = 1800.0
    """The run stops taking new inputs after this long (and fails as incomplete)."""
    sources: int = 16
    """Loopback source addresses to connect from (127.0.0.2 onwards)."""
    indices: list[int] | None = None
    """Replay just these inputs (by index) instead of ``range(inputs)``."""
    quiet: bool = False
    quiet_timeout: float = QUIET_TIMEOUT
    """Seconds to wait at a quiet point for the server's open files to come back."""
    replay_sample: int = REPLAY_SAMPLE
    """Connections held open during the run that are sent again alone after it."""
    mqtt5: float = V5_SHARE
    """Of the MQTT inputs, the share that are MQTT 5.0 sessions."""


@dataclass
class _State:
    records: list[ConnRecord] = field(default_factory=list)
    inflight: dict[int, int] = field(default_factory=dict)
    died: str = ""
    died_at: float = 0.0
    """Wall-clock time the watchdog found the server gone."""
    dead_inflight: list[int] = field(default_factory=list)
    timed_out: bool = False


def _fds(pid: int) -> int:
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(psutil.Error, OSError):
            total += open_descriptors(p.pid)
    return total


def _cpu(pid: int) -> float:
    """CPU seconds (user and system) the server's processes have used."""
    return cpu_seconds(process_tree(pid))


def _rss(pid: int) -> float:
    return rss_bytes(process_tree(pid))


# -- a run -------------------------------------------------------------------------------


class _Run:
    def __init__(self, spec: ServerSpec, options: FuzzOptions, proc: subprocess.Popen[bytes], port: int) -> None:
        self.spec = spec
        self.options = options
        self.proc = proc
        self.port = port
        self.state = _State()
        self.sources = [f"127.0.0.{2 + k}" for k in range(options.sources)]
        self.began = 0.0
        self.deadline = math.inf
        self.drive_scope = trio.CancelScope()
        self.fuzz_seconds = 0.0

    async def watchdog(self) -> None:
        while True:
            code = self.proc.poll()
            if code is not None:
                state = self.state
                state.died = (
                    f"exit code {code} after {len(state.records):,} inputs, "
                    f"{trio.current_time() - self.began:.1f} s into the run"
                )
                state.died_at = time.time()
                state.dead_inflight = sorted(state.inflight.values())
                self.drive_scope.cancel()
                return
            await trio.sleep(0.05)

    async def progress(self) -> None:
        last = 0
        while True:
            await trio.sleep(5.0)
            done = len(self.state.records)
            if not self.options.quiet:
                rss = _rss(self.proc.pid) / 2**20
                print(
                    f"  {self.spec.name}: {done:,} inputs, {(done - last) / 5:,.0f}/s, "
                    f"server RSS {rss:.1f} MiB, {_fds(self.proc.pid)} open files",
                    file=sys.stderr,
                    flush=True,
                )
            last = done

    async def drive(self, indices: Iterator[int], into: list[ConnRecord] | None = None, connections: int = 0) -> None:
        """Run the cases of ``indices`` over ``connections`` (default: the options') concurrent
        connections; their records go to the run's, or to ``into``."""
        state = self.state
        spec = self.spec
        seed = self.options.seed
        records = state.records if into is None else into

        async def worker(w: int) -> None:
            for index in indices:
                if trio.current_time() > self.deadline:
                    state.timed_out = True
                    return
                case = make_case(seed, spec.protocol, index, self.options.mqtt5)
                state.inflight[w] = index
                source = self.sources[index % len(self.sources)]
                record = await run_case(case, spec.protocol, self.port, source, spec.wait)
                del state.inflight[w]
                records.append(record)

        async with trio.open_nursery() as nursery:
            for w in range(connections or self.options.connections):
                nursery.start_soon(worker, w)

    async def quiet(self, target: int) -> int:
        """Wait (bounded) until the server's open files are down to ``target``; the count then."""
        with trio.move_on_after(self.options.quiet_timeout):
            while _fds(self.proc.pid) > target:  # noqa: ASYNC110 - polling another process
                await trio.sleep(0.1)
        return _fds(self.proc.pid)

    async def main(self) -> Observation:
        options = self.options
        pid = self.proc.pid
        fds: dict[str, int] = {"before": _fds(pid)}
        canary = CanaryProcess(
            self.spec.protocol, self.port, f"{os.getpid()}-{options.seed}", presence=self.spec.presence_log
        )
        try:
            return await self._main(canary, fds)
        finally:
            canary.kill()

    async def _main(self, canary: CanaryProcess, fds: dict[str, int]) -> Observation:
        options = self.options
        pid = self.proc.pid
        rss: dict[str, float] = {}
        indices = options.indices if options.indices is not None else list(range(options.inputs))
        n = len(indices)
        # Quiet points where RSS is taken: after a warm-up (a tenth) and half-way through the
        # rest; too short a run has none (its RSS says nothing).
        warm = max(min(1000, n), n // 10)
        checkpoints = {"warm": warm, "mid": warm + (n - warm) // 2} if n >= 2000 else {}
        bounds = sorted({0, *checkpoints.values(), n})
        names = {at: name for name, at in checkpoints.items()}
        async with trio.open_nursery() as nursery:
            await canary.ready()
            fds["canary"] = _fds(pid)
            nursery.start_soon(self.watchdog)
            nursery.start_soon(self.progress)
            self.began = trio.current_time()
            self.deadline = self.began + options.max_seconds
            cpu = _cpu(pid)
            with self.drive_scope:
                for lo, hi in itertools.pairwise(bounds):
                    phase = trio.current_time()
                    try:
                        await self.drive(iter(indices[lo:hi]))
                    finally:
                        self.fuzz_seconds += trio.current_time() - phase
                    if self.state.timed_out:
                        break
                    if hi in names:
                        # Idle and back to its open files: RSS now is comparable with the end's.
                        await self.quiet(fds["canary"])
                        rss[names[hi]], rss[f"{names[hi]}_inputs"] = _rss(pid), len(self.state.records)
            server_cpu = (_cpu(pid) - cpu) / max(trio.current_time() - self.began, 1e-9)
            replayed: list[ConnRecord] | None = None
            if not self.state.died:
                fds["after_run"] = await self.quiet(fds["canary"])
                rss["end"], rss["end_inputs"] = _rss(pid), len(self.state.records)
                held = sorted(r.index for r in self.state.records if unclear(r))[: self.options.replay_sample]
                if self.spec.holds:
                    held = []  # held by the peer's design: alone it would hold them just the same
                if held:
                    # Late because the server was loaded, or held whatever the load? Alone, on
                    # the idle server, a connection it handles right is closed in time.
                    replayed = []
                    self.deadline = math.inf
                    await self.drive(iter(held), into=replayed, connections=REPLAY_CONNECTIONS)
            report, peers = await canary.stop()
            if not self.state.died:
                fds["after_canary"] = await self.quiet(fds["before"])
            nursery.cancel_scope.cancel()
        obs = Observation(
            protocol=self.spec.protocol,
            target=self.spec.name,
            requested=len(indices),
            records=self.state.records,
            fuzz_seconds=self.fuzz_seconds,
            stderr="",
            canary=report,
            fds=fds,
            rss=rss,
            exit_code=None,
            died=self.state.died,
            timed_out=self.state.timed_out,
            canary_peers=peers,
            canary_prefix=f"canary-{canary.tag}-" if self.spec.protocol in ("mqtt", "mqtt-ws") else "",
            replayed=replayed,
            server_cpu=server_cpu,
        )
        state = self.state
        if state.died:
            # The killer was in flight, or had just finished (a reset connection is done
            # before the server reads it): the newest first.
            since = state.died_at - SUSPECT_WINDOW
            finished = [r.index for r in reversed(state.records) if r.finished >= since]
            culprits = state.dead_inflight + finished
            obs.suspects = [
                make_case(options.seed, self.spec.protocol, i, options.mqtt5).describe()
                for i in culprits[:MAX_SUSPECTS]
            ]
        return obs


def run_target(spec: ServerSpec, options: FuzzOptions) -> Observation:
    """Start ``spec``'s server, fuzz it as ``options`` say, stop it by PID; what was seen.

    The observation includes the server's stderr and (MQTT) its presence log, read after it stopped.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"ik-fuzz-{spec.name}-"))
    try:
        log = workdir / "server.log"
        presence = workdir / "presence.jsonl"
        port = free_port()
        extra = ["--presence-log", str(presence)] if spec.presence_log else []
        target = port
        if spec.ws_port:
            # The inputs and the canary go to its WebSocket listener, on a port of its own.
            while target == port:
                target = free_port()
            extra += ["--ws-port", str(target)]
        proc = start_server(spec, port, log, extra)
        try:
            obs = trio.run(_Run(spec, options, proc, target).main)
        finally:
            code = stop(proc, timeout=30.0)
        obs.exit_code = None if obs.died else code
        obs.stderr = log.read_text(errors="replace")
        if spec.presence_log:
            obs.presence = _read_jsonl(presence.read_text(errors="replace").splitlines()) if presence.exists() else []
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not obs.died:
        # A fault logged with a time: the inputs in flight then are the suspects.
        stamped = [when for when, _ in log_faults(obs.stderr) if when is not None]
        if stamped:
            obs.suspects = [
                make_case(options.seed, spec.protocol, i, options.mqtt5).describe()
                for i in suspects_at(obs.records, stamped[0], fault_peers(obs.stderr))
            ]
    return obs


def _read_jsonl(lines: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out
