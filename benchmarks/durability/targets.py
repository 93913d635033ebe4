"""The servers the durability benchmark runs: ours with or without a durable store,
and Mosquitto with ``persistence true``; each started, killed (``kill -9``) and
restarted on the same state by PID."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from loadtest.mqtt_targets import mosquitto_binary
from loadtest.processes import pin, start_heartbeat, stop, wait_listening

__all__ = ["MODES", "Target", "mosquitto_version"]

MODES = ("in-memory", "always", "interval", "off")
"""Our server without a store, and with each ``--persistence-sync``."""

_SUPERVISOR = re.compile(r"supervisor pid (\d+), workers \[([\d, ]*)\]")


def mosquitto_version() -> str:
    """Mosquitto's version line (empty if it is not installed)."""
    binary = mosquitto_binary()
    if binary is None:
        return ""
    out = subprocess.run([binary, "-h"], capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0].strip() if out else ""


@dataclass
class Target:
    """One server under test on ``port``, its state in ``workdir``.

    ``mode``: one of :data:`MODES`, or ``mosquitto``. Each :meth:`start` writes a log
    of its own (our presence log too, with ``presence``).
    """

    mode: str
    port: int
    workdir: Path
    workers: int = 1
    max_queued: int = 1000
    presence: bool = False
    cpus: set[int] | None = None
    """CPUs to pin the server's processes to (None: anywhere)."""
    proc: subprocess.Popen[str] | None = None
    starts: int = 0
    pids: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        """How the tables name it."""
        if self.mode == "mosquitto":
            return "mosquitto persistence"
        workers = f" --workers {self.workers}" if self.workers > 1 else ""
        return f"idlekeeper {self.mode}{workers}"

    @property
    def store(self) -> Path:
        """Our durable store's file (Mosquitto keeps ``mosquitto.db`` beside it)."""
        return self.workdir / "state.db"

    def presence_log(self, start: int) -> Path:
        """Our presence log of start number ``start`` (0 first)."""
        return self.workdir / f"presence-{start}.jsonl"

    def start(self) -> None:
        """Start it (again, on the same state) and wait until it listens."""
        log = self.workdir / f"server-{self.starts}.log"
        if self.mode == "mosquitto":
            binary = mosquitto_binary()
            if binary is None:
                raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
            conf = self.workdir / "mosquitto.conf"
            conf.write_text(
                # As whoever runs the benchmark: as root, Mosquitto would switch to its own
                # user, who may not write here (it says "Permission denied" and saves nothing).
                f"user {pwd.getpwuid(os.getuid()).pw_name}\n"
                f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
                f"persistence_location {self.workdir}/\nmax_queued_messages {self.max_queued}\n"
                "max_keepalive 65535\nlog_dest stderr\nlog_type error\nlog_type warning\n"
            )
            with log.open("w") as err:
                self.proc = subprocess.Popen([binary, "-c", str(conf)], stderr=err, text=True)
            wait_listening(self.port, self.proc)
            self.pids = [self.proc.pid]
        else:
            extra = ["--max-queued", str(self.max_queued), "--log-level", "INFO"]
            if self.mode != "in-memory":
                extra += ["--persistence", str(self.store), "--persistence-sync", self.mode]
            if self.presence:
                extra += ["--presence-log", str(self.presence_log(self.starts))]
            self.proc = start_heartbeat(self.port, self.workers, extra, timeout=120, log=log)
            self.pids = [self.proc.pid]
            if self.workers > 1:
                found = _SUPERVISOR.search(log.read_text())
                assert found is not None and int(found[1]) == self.proc.pid, log.read_text()
                self.pids += [int(pid) for pid in found[2].split(",")]
        if self.cpus is not None:
            pin(self.pids, self.cpus)
        self.starts += 1

    def stop(self) -> None:
        """SIGTERM by PID (ours commits and marks its store stopped; Mosquitto saves)."""
        if self.proc is not None:
            stop(self.proc, timeout=120)
            self.proc = None

    def kill(self) -> None:
        """``kill -9`` the supervisor and its workers together, by PID."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
            self.proc = None
        deadline = time.monotonic() + 10
        for pid in self.pids[1:]:  # workers: orphans now, reaped by init
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
