"""The servers of ``python -m benchmarks.listeners``, each with a plain, a TLS and a
WebSocket listener, and what ours says of its listeners on its status port."""

from __future__ import annotations

import json
import platform
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import psutil
import trio
from prometheus_client.parser import text_string_to_metric_families

from loadtest.mqtt_targets import MqttTarget, PeerUnavailable, mosquitto_binary, start_mosquitto
from loadtest.processes import CpuSplit, free_port, pin, start_heartbeat, wait_listening
from loadtest.sampler import cpu_model
from loadtest.tls_load import CertFiles

from .fleet import PATH
from .model import KINDS

__all__ = ["Served", "check_figures", "listener_figures", "machine", "mosquitto_version", "start_target"]


@dataclass
class Served:
    """A target serving three listeners: its process, its ports by kind, its status port."""

    target: MqttTarget
    ports: dict[str, int]
    status_port: int | None = None

    def listener_name(self, kind: str) -> str:
        """How ours names the listener of ``kind`` in its figures."""
        return f"{kind}://127.0.0.1:{self.ports[kind]}"


def start_target(name: str, certs: CertFiles, split: CpuSplit | None) -> Served:
    """Start ``name`` with a plain, a TLS and a WebSocket listener on free ports (pinned
    to ``split``'s server CPUs); return once all three accept connections."""
    ports = {kind: free_port() for kind in KINDS}
    if name == "idlekeeper":
        status = free_port()
        tls = f"certfile={certs.cert}&keyfile={certs.key}"
        extra = [
            *("--listener", f"mqtt://127.0.0.1:{ports['mqtt']}"),
            *("--listener", f"mqtts://127.0.0.1:{ports['mqtts']}?{tls}"),
            *("--listener", f"ws://127.0.0.1:{ports['ws']}"),
            *("--ws-path", PATH, "--status-port", str(status)),
        ]
        # The first listener is also the --port start_heartbeat gives: one listener, not two.
        proc = start_heartbeat(ports["mqtt"], 1, extra, timeout=60)
        served = Served(MqttTarget(name, proc, ports["mqtt"]), ports, status)
    elif name == "mosquitto":
        # start_mosquitto writes the plain listener and the global lines; the other two
        # listeners are sections after it.
        extra_config = (
            "set_tcp_nodelay true\n"
            f"listener {ports['mqtts']} 127.0.0.1\ncertfile {certs.cert}\nkeyfile {certs.key}\n"
            f"listener {ports['ws']} 127.0.0.1\nprotocol websockets\n"
        )
        served = Served(start_mosquitto(name, ports["mqtt"], extra_config), ports)
        try:
            # Ours is checked for stray connections; Mosquitto only has to be listening.
            for kind in ("mqtts", "ws"):
                wait_listening(ports[kind], served.target.proc)
        except RuntimeError:
            served.target.stop()
            raise
    else:
        raise PeerUnavailable(f"unknown target {name!r}")
    if split is not None:
        pin(served.target.pids(), split.server)
    return served


def mosquitto_version() -> str:
    """Mosquitto's version line (``mosquitto version 2.0.11``), or why there is none."""
    binary = mosquitto_binary()
    if binary is None:
        return "not installed"
    try:
        out = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = (out.stdout or out.stderr).splitlines()
    return lines[0].strip() if lines else "unknown"


def machine() -> dict[str, Any]:
    """What the run ran on, for its record."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_model(),
        "cpus": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "trio": trio.__version__,
        "mosquitto": mosquitto_version(),
    }


# -- what ours says of its listeners -----------------------------------------------------


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        text: str = response.read().decode()
    return text


def listener_figures(status_port: int) -> dict[str, dict[str, dict[str, int]]]:
    """Per listener, online, accepted and refused, as ``/metrics`` and as ``/presence.json``
    give them (the workers summed)."""
    names = {
        "heartbeat_listener_devices_online": "online",
        "heartbeat_listener_connections_total": "accepted",
        "heartbeat_listener_refused_total": "refused",
    }
    metrics: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(_get(status_port, "/metrics")):
        for sample in family.samples:
            key = names.get(sample.name)
            if key is not None and "listener" in sample.labels:
                figures = metrics.setdefault(sample.labels["listener"], dict.fromkeys(names.values(), 0))
                figures[key] += int(sample.value)
    page = json.loads(_get(status_port, "/presence.json?limit=0"))
    presence = {
        str(entry["name"]): {key: int(entry[key]) for key in names.values()} for entry in page.get("listeners", [])
    }
    return {"metrics": metrics, "presence": presence}


def check_figures(
    served: Served,
    seen: dict[str, dict[str, dict[str, int]]],
    before: dict[str, dict[str, dict[str, int]]],
    connected: dict[str, int],
    when: str,
) -> list[str]:
    """What is wrong with what ours said of its listeners ``when``: each listener online
    as connected, accepted as many since ``before`` (the warm-up's not counted), none
    refused; by both /metrics and /presence.json."""
    problems = []
    for source in ("metrics", "presence"):
        for kind in KINDS:
            name = served.listener_name(kind)
            now = seen[source].get(name)
            if now is None:
                problems.append(f"{when}: {source} has no listener {name}")
                continue
            then = before[source].get(name, {"accepted": 0, "refused": 0})
            got = (now["online"], now["accepted"] - then["accepted"], now["refused"] - then["refused"])
            want = (connected[kind], connected[kind], 0)
            if got != want:
                problems.append(
                    f"{when}: {source} says {name} has online/accepted/refused {got[0]}/{got[1]}/{got[2]}, "
                    f"the devices {want[0]}/{want[1]}/{want[2]}"
                )
    return problems
