"""What a generator's devices add up to when its run ends: connect times, how late each
silent device was found, takeovers, and the healthy devices the server cut (false
expiries) told apart from those whose own generator fell behind."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .records import Device

__all__ = ["judge_devices"]

CONNECT_SAMPLES = 5000
"""Connect times kept per generator: enough for percentiles, small enough for the results file."""


def judge_devices(devices: Sequence[Device], window: float, failover: bool) -> dict[str, Any]:
    """The devices' figures for a generator's results. ``window`` is 1.5 x keep-alive;
    ``failover`` (a fleet run) leaves judging the closed connections to the orchestrator.
    A device the server told to keep another keep-alive (a 5.0 CONNACK's Server Keep
    Alive) is judged by 1.5 x that one."""
    lateness: list[float] = []
    undetected = 0
    false: list[dict[str, Any]] = []
    generator_late = 0
    takeovers: list[float] = []
    takeover_missed = 0
    connect_s: list[float] = []
    connack_times: list[float] = []
    silent_last: dict[str, float] = {}
    silent_window: dict[str, float] = {}
    for d in devices:
        w = 1.5 * d.keepalive if d.keepalive else window
        if d.connack_at == d.connack_at:
            connack_times.append(d.connack_at)
            if len(connect_s) < CONNECT_SAMPLES:
                connect_s.append(d.connack_at - d.connect_started)
        closed = d.closed_at == d.closed_at
        if d.role == "silent" and d.acted_at == d.acted_at:
            silent_last[d.client_id] = d.last_sent
            if w != window:
                silent_window[d.client_id] = w
            if closed:
                lateness.append(d.closed_at - (d.last_sent + w))
            else:
                undetected += 1
            continue
        if d.role == "reconnect" and d.acted_at == d.acted_at:
            if d.takeover_s == d.takeover_s:
                takeovers.append(d.takeover_s)
            else:
                takeover_missed += 1
        if d.role == "vanish" and d.acted_at == d.acted_at:
            continue
        if closed and not failover:  # failover mode: the orchestrator judges the generator's drops
            # A device that kept to its keep-alive and was cut anyway is a false expiry;
            # one whose own heartbeat was late (an overloaded generator) is not the server's fault.
            silent_for = d.closed_at - d.last_sent
            if silent_for < w and d.max_gap < w:
                false.append(
                    {"client_id": d.client_id, "silent_for": round(silent_for, 3), "max_gap": round(d.max_gap, 3)}
                )
            else:
                generator_late += 1
    return {
        "connected": len(connack_times),
        "first_connack": min(connack_times, default=math.nan),
        "last_connack": max(connack_times, default=math.nan),
        "connack_times": sorted(connack_times),
        "connect_s": connect_s,
        "lateness": lateness,
        "silent_last": silent_last,
        "silent_window": silent_window,
        "undetected": undetected,
        "takeover_s": takeovers,
        "takeover_missed": takeover_missed,
        "false_expiries": false,
        "generator_late": generator_late,
        "max_gap": max((d.max_gap for d in devices), default=0.0),
    }
