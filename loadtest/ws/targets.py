"""The servers ``python -m loadtest ws`` measures, all serving :mod:`loadtest.asgi_app`, and
how each is told its WebSocket ping interval and pong timeout.

- ``idlekeeper``: ``servers.http`` on its dense engine (no task per idle connection
  beyond the app's own);
- ``idlekeeper-streams``: the same on the streams engine (a task per connection);
- ``uvicorn-standard``: uvicorn as ``uvicorn[standard]`` runs it (httptools, uvloop, the
  ``websockets`` library): ``--ws-ping-interval`` and ``--ws-ping-timeout``, as ours;
- ``hypercorn`` (trio worker, as ``compare`` runs it): ``--websocket-ping-interval``
  only; it has no pong timeout (it sends pings and never looks for the answer).

Each is started as ``compare`` starts the HTTP peers (:func:`loadtest.http.load.start_target`:
a free port, the same HTTP timeouts, pinned when asked), with these flags on top.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from ..http.load import start_target
from ..http.workload import HttpLoad
from ..processes import CpuSplit

__all__ = ["WS_TARGETS", "Pings", "WsServer", "ping_flags", "start_ws_target"]

WS_TARGETS = ("idlekeeper", "idlekeeper-streams", "uvicorn-standard", "hypercorn")


@dataclass(frozen=True)
class Pings:
    """A WebSocket ping interval and pong timeout, in seconds; None leaves the server's default."""

    interval: float | None = None
    timeout: float | None = None


def ping_flags(name: str, pings: Pings) -> list[str]:
    """``name``'s command-line flags for ``pings`` (hypercorn has no pong timeout to set)."""
    flags: list[str] = []
    if name == "hypercorn":
        if pings.interval is not None:
            flags += ["--websocket-ping-interval", f"{pings.interval:g}"]
        return flags
    # Ours took uvicorn's names.
    if pings.interval is not None:
        flags += ["--ws-ping-interval", f"{pings.interval:g}"]
    if pings.timeout is not None:
        flags += ["--ws-ping-timeout", f"{pings.timeout:g}"]
    return flags


@dataclass
class WsServer:
    """A running target: its process, port and PIDs (its whole process tree)."""

    name: str
    proc: subprocess.Popen[str]
    port: int
    pids: list[int]


def start_ws_target(name: str, pings: Pings, timeout: float, split: CpuSplit | None = None) -> WsServer:
    """Start ``name`` on a free loopback port with ``pings`` (pinned to ``split``'s server CPUs
    when given); ``timeout`` is the HTTP header, keep-alive and (ours) send timeout."""
    if name not in WS_TARGETS:
        raise ValueError(f"unknown WebSocket target {name!r} (known: {', '.join(WS_TARGETS)})")
    load = HttpLoad(header_timeout=timeout)
    proc, port, pids = start_target(name, load, split, extra=ping_flags(name, pings))
    return WsServer(name, proc, port, pids)
