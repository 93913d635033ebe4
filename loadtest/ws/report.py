"""The tables of ``python -m loadtest ws``: a row per server, each figure with its ratio to
ours (:func:`loadtest.report.table`); the MQTT part in ``compare``'s device columns."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..compare import DEVICE_COLUMNS, device_row
from ..report import Column, number, plural, table
from ..stats import percentile
from .workload import PARTS, WsLoad

__all__ = ["MQTT_COLUMNS", "WS_COLUMNS", "headlines", "mqtt_table", "ws_row", "ws_table"]

WS_COLUMNS: tuple[Column, ...] = (
    ("idle_rss_per_conn", "RSS per idle WebSocket", "B", False),
    ("echo_msgs_per_s", "echo msg/s", "", True),
    ("echo_p99_ms", "echo p99", "ms", False),
    ("dead_closed", "dead peers closed", "", True),
    ("dead_close_p50_s", "dead close p50 (since last byte)", "s", False),
    ("dead_close_max_s", "dead close max (since last byte)", "s", False),
    ("healthy_closed", "healthy closed", "", False),
    ("slow_cut", "slow readers cut", "", True),
    ("slow_cut_p50_s", "slow reader cut p50", "s", False),
    ("slow_rss_per_reader", "RSS per slow reader", "B", False),
)

MQTT_COLUMNS: tuple[Column, ...] = tuple(c for c in DEVICE_COLUMNS if c[0] != "cpu_pct_per_1k_hbps")
"""``compare``'s device columns, but CPU per heartbeat (a WebSocket fleet this small says
little about it)."""


def ws_row(r: dict[str, Any]) -> dict[str, float]:
    """The figures of one server's run that go into the table (NaN for a part not run)."""
    idle, echo, dead, slow = (r.get(part) or {} for part in ("idle", "echo", "dead", "slow"))
    close_after = dead.get("close_after_s") or []
    cut_after = slow.get("cut_after_s") or []
    return {
        "idle_rss_per_conn": number(idle.get("per_connection")),
        "echo_msgs_per_s": number(echo.get("rps")),
        "echo_p99_ms": number(echo.get("p99_ms")),
        "dead_closed": number(dead.get("dead_closed")),
        "dead_close_p50_s": percentile(close_after, 50),
        "dead_close_max_s": max(close_after, default=math.nan),
        "healthy_closed": number(dead.get("healthy_closed")),
        "slow_cut": number(slow.get("cut")),
        "slow_cut_p50_s": percentile(cut_after, 50),
        "slow_rss_per_reader": number(slow.get("per_reader")),
    }


_PART_OF = {"idle": "idle", "echo": "echo", "dead": "dead", "healthy": "dead", "slow": "slow"}


def ws_table(runs: dict[str, dict[str, Any]], missing: dict[str, str], parts: Sequence[str] = PARTS) -> str:
    """The WebSocket servers' table, with the columns of the parts run."""
    columns = tuple(c for c in WS_COLUMNS if _PART_OF[c[0].split("_")[0]] in parts)
    return table({name: ws_row(r) for name, r in runs.items()}, columns, missing)


def mqtt_table(runs: dict[str, dict[str, Any]], missing: dict[str, str]) -> str:
    """The MQTT-over-WebSocket servers' table."""
    return table({name: device_row(r) for name, r in runs.items()}, MQTT_COLUMNS, missing)


def headlines(load: WsLoad, pinned: bool, parts: Sequence[str] = PARTS) -> tuple[str, str]:
    """What each table measured (the parts run), in a line each."""
    said = {
        "idle": f"{load.connections:,} idle connections",
        "echo": f"echo of {load.echo_size} B messages by {plural(load.echo_clients, 'client')}, "
        f"{load.echo_duration:g} s x "
        f"{plural(load.rounds, 'round')} taken in turn (median)"
        + (", each server pinned to a core of its own and the load to the others" if pinned else ""),
        "dead": f"{load.dead} dead + {load.dead} healthy peers with pings every {load.ping_interval:g} s "
        f"and a {load.ping_timeout:g} s pong timeout, watched {load.dead_window:g} s",
        "slow": f"{load.slow_readers} slow readers of /flood, watched {load.slow_window:g} s "
        f"(our send timeout {load.timeout:g} s)",
    }
    ws = "WebSockets on the same ASGI app: " + "; ".join(text for part, text in said.items() if part in parts)
    mqtt = (
        f"MQTT over WebSockets: {load.mqtt_devices:,} devices, keep-alive {load.mqtt_keepalive} s, "
        f"{load.mqtt_silent} going silent (deadline 1.5 x keep-alive; lateness = close - deadline)"
    )
    return ws, mqtt
