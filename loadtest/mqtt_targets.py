"""The MQTT servers the device load runs against: started, found, stopped by PID.

- ``idlekeeper``: ``servers.heartbeat`` (:class:`HeartbeatTarget`), with its status
  ports and presence log, for ``python -m loadtest devices`` and ``compare``, on the
  dense engine; ``idlekeeper-streams`` is the same server on the streams engine (a
  task per connection);
- an :class:`ExternalServer` someone else started (``devices --port``);
- ``baseline``: :mod:`loadtest.baseline`, the same protocol code on trio's own
  timeouts (one ``move_on_after`` per read);
- ``amqtt``: from PyPI, in a virtualenv of its own (``.venv-amqtt``, created on first
  use) because it pins its own dependencies;
- ``mosquitto``: the Debian package's broker, when installed.

Each peer is configured as BRIEF §4 says it runs here: Mosquitto with
``listener PORT 127.0.0.1`` and ``allow_anonymous true``; amqtt with a listener
``bind`` and its anonymous authentication plugin.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .processes import free_port, start_heartbeat, start_server, stop, wait_listening
from .sampler import process_tree
from .workload import FILE_BUDGET

__all__ = [
    "AMQTT_VERSION",
    "ExternalServer",
    "HeartbeatTarget",
    "MqttTarget",
    "PeerUnavailable",
    "ServerUnderTest",
    "ensure_amqtt_venv",
    "start_mqtt_target",
]

AMQTT_VERSION = "0.12.1"
ROOT = Path(__file__).resolve().parent.parent
AMQTT_VENV = ROOT / ".venv-amqtt"


class PeerUnavailable(RuntimeError):
    """A peer cannot run here; the message says why."""


@dataclass
class MqttTarget:
    """A running MQTT server under test."""

    name: str
    proc: subprocess.Popen[str]
    port: int
    workdir: Path | None = None
    # What ServerUnderTest also asks for; the peers have neither.
    metrics_urls: list[str] = field(default_factory=list)
    presence_log: Path | None = None

    def pids(self) -> list[int]:
        """Every process of the server."""
        return [p.pid for p in process_tree(self.proc.pid)]

    def stop(self) -> None:
        """Stop it by its PID and remove its scratch directory."""
        stop(self.proc)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def mosquitto_binary() -> str | None:
    """The mosquitto broker's path, if installed."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None


def ensure_amqtt_venv() -> Path:
    """``.venv-amqtt`` with amqtt installed (created once); its ``amqtt`` executable."""
    exe = AMQTT_VENV / "bin" / "amqtt"
    if exe.exists():
        return exe
    try:
        subprocess.run([sys.executable, "-m", "venv", str(AMQTT_VENV)], check=True, capture_output=True)
        subprocess.run(
            [str(AMQTT_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", f"amqtt=={AMQTT_VERSION}"],
            check=True,
            capture_output=True,
            timeout=600,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        shutil.rmtree(AMQTT_VENV, ignore_errors=True)
        raise PeerUnavailable(f"could not install amqtt=={AMQTT_VERSION}: {exc}") from exc
    if not exe.exists():
        raise PeerUnavailable("amqtt installed, but its 'amqtt' command is missing")
    return exe


def start_mqtt_target(name: str, port: int) -> MqttTarget:
    """Start peer ``name`` on ``127.0.0.1:port`` and return once it accepts connections.

    idlekeeper's own server is :class:`HeartbeatTarget`, which also
    gives it status ports and a presence log.
    """
    if name == "baseline":
        return MqttTarget(name, start_server("baseline", port, 1, (), module="loadtest.baseline"), port)
    if name == "mosquitto":
        return start_mosquitto(name, port)
    workdir = Path(tempfile.mkdtemp(prefix=f"ik-{name}-"))
    if name == "amqtt":
        exe = ensure_amqtt_venv()
        config = workdir / "config.yaml"
        # Only the anonymous-auth plugin: the default set also logs every packet and
        # publishes $SYS topics, which would measure logging rather than keep-alive.
        config.write_text(
            "listeners:\n"
            "  default:\n"
            "    type: tcp\n"
            f"    bind: 127.0.0.1:{port}\n"
            "    max_connections: 0\n"
            "plugins:\n"
            "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
            "    allow_anonymous: true\n"
        )
        proc = subprocess.Popen([str(exe), "-c", str(config)], stderr=subprocess.DEVNULL, text=True, cwd=workdir)
    else:
        raise PeerUnavailable(f"unknown MQTT target {name!r}")
    return _listening(name, proc, port, workdir)


def start_mosquitto(name: str, port: int, extra_config: str = "") -> MqttTarget:
    """Mosquitto on ``127.0.0.1:port`` (anonymous, no persistence, errors only logged),
    with ``extra_config`` lines appended; returns once it accepts connections."""
    binary = mosquitto_binary()
    if binary is None:
        raise PeerUnavailable("mosquitto is not installed (apt-get install mosquitto)")
    workdir = Path(tempfile.mkdtemp(prefix=f"ik-{name}-"))
    config = workdir / "mosquitto.conf"
    config.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        "log_dest stderr\nlog_type error\nlog_type warning\nmax_keepalive 65535\n" + extra_config
    )
    proc = subprocess.Popen([binary, "-c", str(config)], stderr=subprocess.DEVNULL, text=True)
    return _listening(name, proc, port, workdir)


def _listening(name: str, proc: subprocess.Popen[str], port: int, workdir: Path) -> MqttTarget:
    try:
        wait_listening(port, proc)
    except RuntimeError:
        stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return MqttTarget(name, proc, port, workdir)


class ServerUnderTest(Protocol):
    """A running MQTT server: its port, its processes, and what else it exposes."""

    name: str
    port: int
    metrics_urls: list[str]
    presence_log: Path | None

    def pids(self) -> list[int]:
        """Every process of the server (RSS, CPU and SIGSTOP apply to all)."""
        ...


@dataclass
class HeartbeatTarget:
    """``servers.heartbeat`` started for a device run, with status ports and a presence log."""

    proc: subprocess.Popen[str]
    port: int
    workers: int
    metrics_urls: list[str]
    presence_log: Path | None
    name: str = "idlekeeper"

    @classmethod
    def start(
        cls,
        devices: int,
        tick: float = 0.1,
        workers: int | None = None,
        engine: str = "dense",
        coalesce: float = 0.0,
        coalesce_pings: float = 0.0,
    ) -> HeartbeatTarget:
        """Enough workers for ``devices`` (or ``workers``), each with /metrics and a shared presence log.

        ``coalesce`` is the dense engine's ``--coalesce`` (0: a pass per wake-up), and
        ``coalesce_pings`` its ``--coalesce-pings`` (0: the server's default).

        ``engine`` is the server's ``--engine``; a streams server is named ``idlekeeper-streams``.
        """
        if workers is None:
            workers = max(2, math.ceil(devices / (FILE_BUDGET - 1_000)))
        port = free_port()
        status = free_port(run=workers)
        log = Path(tempfile.mkdtemp(prefix="ik-devices-")) / "presence.jsonl"
        extra = ["--tick", str(tick), "--status-port", str(status), "--presence-log", str(log), "--engine", engine]
        if coalesce:
            extra += ["--coalesce", str(coalesce)]
        if coalesce_pings:
            extra += ["--coalesce-pings", str(coalesce_pings)]
        proc = start_heartbeat(port, workers, extra, timeout=60 + workers * 5)
        urls = [f"http://127.0.0.1:{status + i}/metrics" for i in range(workers)]
        name = "idlekeeper" if engine == "dense" else f"idlekeeper-{engine}"
        return cls(proc, port, workers, urls, log, name)

    def pids(self) -> list[int]:
        """The supervisor and its workers."""
        return [p.pid for p in process_tree(self.proc.pid)]

    def stop(self) -> None:
        """SIGTERM by PID (workers close every connection on the way out); remove the presence log."""
        stop(self.proc, timeout=60)
        if self.presence_log is not None:
            shutil.rmtree(self.presence_log.parent, ignore_errors=True)


@dataclass
class ExternalServer:
    """A server started by someone else: a port, and the PIDs to sample."""

    port: int
    pid_list: list[int] = field(default_factory=list)
    name: str = "external"
    metrics_urls: list[str] = field(default_factory=list)
    presence_log: Path | None = None

    def pids(self) -> list[int]:
        """Each given process and its descendants."""
        return [p.pid for pid in self.pid_list for p in process_tree(pid)]
