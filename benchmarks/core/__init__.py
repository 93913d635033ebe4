"""The core benchmark (``python -m benchmarks.core``, ``make bench``): activity cost, reaper
CPU and memory per watched connection, side by side in one run. The command is
:mod:`.cli` (and its names are exported here); each part, the null transport they share
and the report are modules here."""

from __future__ import annotations

from .cli import machine, main

__all__ = ["machine", "main"]
