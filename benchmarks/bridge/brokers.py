"""The brokers of the bridge benchmark: a remote Mosquitto, and an edge bridging to it,
this server (``--bridge``) or another Mosquitto (a ``connection`` section)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.processes import free_port, stop, wait_listening

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "bench/#"
KINDS = ("ours", "mosquitto")


def _user() -> str:
    # Run as root, Mosquitto would drop to the "mosquitto" user; keep it as it is.
    return "user root\n" if os.geteuid() == 0 else ""


@dataclass
class Process:
    """A broker process on a loopback port; :meth:`start` (re)starts it on that port."""

    argv: list[str]
    port: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        if self.procs:
            self.stop()
        quiet = subprocess.DEVNULL
        proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=quiet, stderr=quiet)
        self.procs.append(proc)
        wait_listening(self.port, proc)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.procs[-1]

    def kill(self) -> None:
        """SIGKILL, by its PID, and reap it."""
        self.proc.kill()
        self.proc.wait(timeout=15)

    def stop(self) -> None:
        if not self.procs:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process takes no SIGTERM
        stop(self.proc)


def remote(binary: str, workdir: Path, persistent: bool = False) -> Process:
    """A remote Mosquitto; ``persistent``: its state in ``workdir``, saved each second."""
    port = free_port()
    conf = workdir / f"remote-{port}.conf"
    keep = f"persistence true\npersistence_location {workdir}/\nautosave_interval 1\n"
    text = f"{_user()}listener {port} 127.0.0.1\nallow_anonymous true\n"
    conf.write_text(text + (keep if persistent else "persistence false\n"))
    return Process([binary, "-c", str(conf)], port)


def client_id(kind: str) -> str:
    """The edge's client id on the remote (``remote_clientid``)."""
    return f"edge-{kind}"


def state_topic(kind: str) -> str:
    """The edge's local notification topic, Mosquitto's default form."""
    return f"$SYS/broker/connection/{client_id(kind)}/state"


def edge(kind: str, binary: str, workdir: Path, remote_port: int, keepalive: int, queued: int = 1000) -> Process:
    """An edge of ``kind`` bridging ``bench/# out 1`` to ``remote_port``; ``queued``: QoS 1
    messages it queues per client beyond those in flight (both defaults are 1000)."""
    port = free_port()
    settings = {
        "remote_clientid": client_id(kind),
        "keepalive_interval": str(keepalive),
        "restart_timeout": "1",
    }
    if kind == "ours":
        query = "&".join([f"topic={TOPIC}%20out%201", *(f"{k}={v}" for k, v in settings.items())])
        spec = f"mqtt://127.0.0.1:{remote_port}/edge?{query}"
        argv = [sys.executable, "-m", "servers.heartbeat", "--host", "127.0.0.1", "--port", str(port)]
        return Process([*argv, "--workers", "1", "--max-queued", str(queued), "--bridge", spec], port)
    lines = [
        f"{_user()}listener {port} 127.0.0.1",
        "allow_anonymous true",
        "persistence false",
        f"max_queued_messages {queued}",
        "connection edge",
        f"address 127.0.0.1:{remote_port}",
        f"topic {TOPIC} out 1",
        *(f"{k} {v}" for k, v in settings.items()),
    ]
    conf = workdir / f"edge-{port}.conf"
    conf.write_text("\n".join(lines) + "\n")
    return Process([binary, "-c", str(conf)], port)
