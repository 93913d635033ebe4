"""``python -m loadtest qos``: QoS 1 throughput and memory per queued message, ours beside
Mosquitto. The command is :mod:`.cli` (and its names are exported here); the workload,
the blocking client, the throughput and queued parts, their tally and the report are
modules here."""

from __future__ import annotations

from .cli import PARTS, QOS_TARGETS, main, run_qos, start_qos_target

__all__ = ["PARTS", "QOS_TARGETS", "main", "run_qos", "start_qos_target"]
