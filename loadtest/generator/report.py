"""A generator's results when its run ends: its own counters (connects, refusals,
pings, DISCONNECTs, failovers) beside its devices' judged figures
(:func:`~loadtest.generator.results.judge_devices`), as one dict for the results file."""

from __future__ import annotations

from typing import Any

from ..mqtt_versions import NAMES
from .events import Generator
from .results import judge_devices

__all__ = ["generator_results", "protocols"]


def protocols(gen: Generator) -> dict[str, int]:
    """The generator's devices by the MQTT version they speak."""
    versions = gen.spec.versions or "4" * len(gen.devices)
    return {NAMES[int(v)]: versions.count(v) for v in sorted(set(versions))}


def generator_results(gen: Generator) -> dict[str, Any]:
    """Per-generator results; :mod:`loadtest.devices` merges them. The connections
    still open are closed."""
    spec = gen.spec
    judged = judge_devices(gen.devices, gen.window, spec.failover)
    for conn in list(gen.conns.values()):
        gen.drop(conn)
    return {
        "index": spec.index,
        "devices": len(gen.devices),
        "silent": len(spec.silent),
        "vanished": len(spec.vanish),
        "reconnected": len(spec.reconnect),
        **judged,
        "connect_failed": gen.connect_failed,
        "connect_sent_late": gen.connect_sent_late,
        "connect_send_max": gen.connect_send_max,
        "refused": gen.refused,
        "refusals": gen.refusals,
        "protocols": protocols(gen),
        "disconnects": gen.disconnects,
        "server_keepalive": gen.server_keepalive,
        "errors": gen.errors,
        "pings": gen.pings,
        "drops": gen.drops,
        "failovers": gen.failovers,
        "retries": gen.retries,
        "dead_ports": sorted(gen.dead_ports),
        "online_at_end": gen.online,
    }
