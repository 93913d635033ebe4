"""The several-listeners benchmark (``python -m benchmarks.listeners``, issue 63): ours
and Mosquitto each serving a plain, a TLS and a WebSocket listener at once, devices
beating on all three, side by side in one run. The command is :mod:`.cli` (its names
are exported here); the run's figures, the devices and the servers are modules here."""

from __future__ import annotations

from .cli import main, measure, render, run
from .model import KINDS, TARGETS, ListenerResult, Load, Report, TargetResult
from .targets import Served, check_figures

__all__ = [
    "KINDS",
    "TARGETS",
    "ListenerResult",
    "Load",
    "Report",
    "Served",
    "TargetResult",
    "check_figures",
    "main",
    "measure",
    "render",
    "run",
]
