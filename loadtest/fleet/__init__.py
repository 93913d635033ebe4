"""``python -m loadtest fleet``: a fleet of heartbeat gateways sharing presence through
Redis, under load and faults. The command is :mod:`.cli` (and its names are exported
here); the workload, the gateways, the presence stream's reader, the judging and the
results are modules here."""

from __future__ import annotations

from .cli import load_from, main, parser, run_fleet

__all__ = ["load_from", "main", "parser", "run_fleet"]
