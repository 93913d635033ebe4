"""The durability benchmark (``python -m benchmarks.durability``, issue 62): throughput
with a durable store, start-up on a big one, and a crash drill, beside Mosquitto's
persistence in one run. The command is :mod:`.cli` (its names are exported here); the
raw MQTT clients, the servers, and each part are modules here."""

from __future__ import annotations

from .cli import Report, main, run

__all__ = ["Report", "main", "run"]
