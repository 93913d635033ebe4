"""The scoreboard: where the project stands today, target by target, written by
``python -m loadtest scorecard`` and never by hand, so that it cannot drift from what
was measured.

Each scorecard run updates the targets it measured in a record (``performance.json``
beside the page): the median of its rounds' ratios, in how many rounds the target was
met, the peer and its version, the command, the date and the machine; targets it did
not measure keep their last reading. :func:`render` makes the page from the record.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

__all__ = ["BOARD", "PEERS", "Target", "machine", "peer_version", "record", "render", "update"]


class Target(Protocol):
    """A target as the scorecard states it (:class:`loadtest.scorecard.Goal`)."""

    @property
    def key(self) -> str: ...

    @property
    def what(self) -> str: ...

    @property
    def line(self) -> str: ...

BOARD = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
"""The page; its record is the ``.json`` beside it."""

PEERS = {
    "http_uvicorn": "uvicorn[standard]",
    "http_granian": "granian",
    "http_attack_p99": "ours, unattacked",
    "http_attack_kept": "ours, unattacked",
    "mqtt_memory": "Mosquitto",
    "mqtt_cpu": "Mosquitto",
    "mqtt_cpu_pings": "Mosquitto",
    "qos_forwarding": "Mosquitto",
    "qos_drain": "Mosquitto",
    "tls_handshake": "Mosquitto",
}
"""Each target's peer: what a user would run instead."""

_HEAD = """# Performance: where idlekeeper stands

Every speed and memory target, its latest reading against the peer a user would pick
instead: Mosquitto for MQTT, uvicorn[standard] and granian for HTTP. A ratio is taken
inside one run (these shared machines drift by tens of percent between runs), and a
run's figure is the median of its rounds. This page is written by
`python -m loadtest scorecard` (`make scorecard`) from what it measured, never by
hand; every measurement, with its method and what it taught, is in the
[benchmarks journal](benchmarks.md).
"""


def peer_version(peer: str) -> str:
    """The installed version of ``peer`` ("" if it is not installed here)."""
    if peer == "Mosquitto":
        binary = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else "")
        if not binary:
            return ""
        try:
            out = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
        found = re.search(r"version (\S+)", out)
        return found.group(1) if found else ""
    name = {"uvicorn[standard]": "uvicorn"}.get(peer, peer)
    if name.startswith("ours"):
        return ""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def machine() -> str:
    """This machine, as the journal names machines: cores, CPU, memory, Python, trio."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {round(kib / 1024 / 1024)} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        trio = ", trio " + metadata.version("trio")
    except metadata.PackageNotFoundError:
        trio = ""
    return f"{os.cpu_count()} cores ({model or platform.machine()}){memory}, Python {platform.python_version()}{trio}"


_UNMEASURED = {"--out": True, "--board": True, "--quiet": False}
"""The scorecard's options that change where its results go or how much it prints, not
what it measures (whether each takes a value): the board's command leaves them out."""


def measured_by(args: Sequence[str]) -> str:
    """The scorecard command of ``args`` as the board shows it: without :data:`_UNMEASURED`
    options, so the line reads the same wherever its results were written."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        name, eq, _ = arg.partition("=")
        if name in _UNMEASURED:
            skip = _UNMEASURED[name] and not eq
            continue
        kept.append(arg)
    return " ".join(["python -m loadtest scorecard", *kept])


def record(path: Path) -> dict[str, Any]:
    """The board's record (empty if there is none yet)."""
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"targets": {}}
    return loaded if isinstance(loaded, dict) and isinstance(loaded.get("targets"), dict) else {"targets": {}}


def update(
    board: Path,
    goals: Sequence[Target],
    readings: Sequence[Mapping[str, Any]],
    *,
    command: str,
    when: float | None = None,
    where: str | None = None,
) -> dict[str, Any]:
    """Fold one run's ``readings`` (each round's goal key -> an object with ``ratio`` and
    ``met``) into ``board``'s record and write the record and the page; returns the record."""
    data = record(board.with_suffix(".json"))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() if when is None else when))
    host = machine() if where is None else where
    for goal in goals:
        taken = [r[goal.key] for r in readings if goal.key in r]
        if not taken:
            continue
        ratios = [float(t.ratio) for t in taken if t.ratio == t.ratio]
        peer = PEERS.get(goal.key, "")
        data["targets"][goal.key] = {
            "ratio": statistics.median(ratios) if ratios else None,
            "rounds": [None if t.ratio != t.ratio else round(float(t.ratio), 3) for t in taken],
            "met": sum(1 for t in taken if t.met),
            "peer": peer,
            "peer_version": peer_version(peer),
            "command": command,
            "date": stamp,
            "machine": host,
        }
    board.with_suffix(".json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    board.write_text(render(data, goals))
    return data


def render(data: Mapping[str, Any], goals: Sequence[Target]) -> str:
    """The page (Markdown) for a record: a row per target, those not measured yet too."""
    targets = data.get("targets", {})
    machines: list[str] = []
    rows = [
        "| target | goal | latest | met in | peer | measured | machine |",
        "|---|---|---:|---|---|---|---|",
    ]
    commands: list[str] = []
    for goal in goals:
        t = targets.get(goal.key)
        if t is None:
            rows.append(f"| {goal.what} | {goal.line} | not measured yet | | {PEERS.get(goal.key, '')} | | |")
            continue
        if t["machine"] not in machines:
            machines.append(t["machine"])
        if t["command"] not in commands:
            commands.append(t["command"])
        ratio = "—" if t["ratio"] is None else f"{t['ratio']:.2f}×"
        rounds = len(t["rounds"])
        plural = "s" if rounds != 1 else ""
        met = "all" if t["met"] == rounds else "none" if not t["met"] else f"{t['met']}"
        mark = f"{met} of {rounds} round{plural}" if met != "all" else f"all {rounds} round{plural}"
        peer = t["peer"] + (f" {t['peer_version']}" if t["peer_version"] else "")
        label = f"M{machines.index(t['machine']) + 1}"
        rows.append(f"| {goal.what} | {goal.line} | {ratio} | {mark} | {peer} | {t['date']} | {label} |")
    lines = [_HEAD, *rows, ""]
    lines += [f"- M{i + 1}: {m}" for i, m in enumerate(machines)]
    if commands:
        lines += ["", "Measured by:", "", "```sh", *commands, "```"]
    return "\n".join(lines) + "\n"

