"""Judging a fleet run (pure functions, unit-tested): the presence feed's sessions, a
killed node's devices, and the devices' own view of the connections closed under them.

Every accepted connection is a session with an epoch, fleet-wide unique; the
fleet's contract is one online event and one offline event per session. The feed
is seen twice: the presence stream as a reader of Redis got it (with which run of
Redis each entry came from), and the gateways' presence logs (each node logs the
events it emitted). A session is **lost** when neither shows an offline event for
it and **duplicated** when either shows more than one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..stats import summary_ms

__all__ = ["Session", "classify_drops", "judge_sessions", "killed_node_view", "node_of", "sessions_of"]


@dataclass
class Session:
    """What the feed said about one epoch."""

    epoch: str
    client_id: str | None = None
    node: str = ""
    online_stream: list[int] = field(default_factory=list)
    """The Redis incarnation of each online event read from the stream."""
    online_log: int = 0
    offline_stream: list[dict[str, Any]] = field(default_factory=list)
    offline_log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def offline(self) -> list[dict[str, Any]]:
        """The offline events of the source that saw more of them (the stream, on a tie)."""
        return self.offline_stream if len(self.offline_stream) >= len(self.offline_log) else self.offline_log

    @property
    def seen_online(self) -> bool:
        """Whether any source showed this session coming online."""
        return bool(self.online_stream) or self.online_log > 0


def node_of(node: str) -> str:
    """The gateway of a fleet node: ``gw1/w0`` -> ``gw1`` (each worker is a node of its own)."""
    return node.split("/", 1)[0]


def sessions_of(stream: Iterable[tuple[int, dict[str, Any]]], logs: Iterable[dict[str, Any]]) -> dict[str, Session]:
    """Fold the stream's (incarnation, event) pairs and the logs' events into sessions by epoch.

    Events without an epoch (a socket that never said CONNECT, a refused one) are no session's.
    """
    out: dict[str, Session] = {}

    def session(event: dict[str, Any]) -> Session | None:
        epoch = event.get("epoch")
        if not epoch:
            return None
        s = out.get(epoch)
        if s is None:
            s = out[epoch] = Session(str(epoch))
        if event.get("client_id") is not None:
            s.client_id = str(event["client_id"])
        if event.get("node") and not s.node:
            s.node = str(event["node"])
        return s

    for incarnation, event in stream:
        s = session(event)
        if s is None:
            continue
        if event.get("status") == "online":
            s.online_stream.append(incarnation)
        elif event.get("status") == "offline":
            s.offline_stream.append(event)
    for event in logs:
        s = session(event)
        if s is None:
            continue
        if event.get("status") == "online":
            s.online_log += 1
        elif event.get("status") == "offline":
            s.offline_log.append(event)
    return out


def judge_sessions(sessions: dict[str, Session], examples: int = 10) -> dict[str, Any]:
    """Lost and duplicated offline events, duplicated online events, and the offline reasons.

    An online event may legitimately come twice, in different runs of Redis: a node
    whose registry was lost with Redis announces its sessions again (after a restart,
    or a failover whose promoted replica lacks the lost primary's last writes: a
    re-claim). Twice in one run is a duplicate.
    """
    lost = [s for s in sessions.values() if s.seen_online and not s.offline_stream and not s.offline_log]
    duplicated = [s for s in sessions.values() if len(s.offline_stream) > 1 or len(s.offline_log) > 1]
    online_dup = [s for s in sessions.values() if len(s.online_stream) != len(set(s.online_stream))]
    reannounced = sum(1 for s in sessions.values() if len(set(s.online_stream)) > 1)
    no_online = [s for s in sessions.values() if not s.seen_online]
    reasons: dict[str, int] = {}
    for s in sessions.values():
        for event in s.offline[:1]:
            reason = str(event.get("reason"))
            reasons[reason] = reasons.get(reason, 0) + 1
    stream_only = sum(1 for s in sessions.values() if s.offline_stream and not s.offline_log)
    log_only = sum(1 for s in sessions.values() if s.offline_log and not s.offline_stream)
    return {
        "sessions": len(sessions),
        "lost": len(lost),
        "lost_examples": [(s.epoch, s.client_id, s.node) for s in lost[:examples]],
        "duplicated": len(duplicated),
        "duplicated_examples": [
            (s.epoch, s.client_id, [e.get("reason") for e in s.offline]) for s in duplicated[:examples]
        ],
        "online_duplicated": len(online_dup),
        "reannounced_after_restart": reannounced,
        "offline_without_online": len(no_online),
        "offline_by_reason": dict(sorted(reasons.items())),
        "offline_seen_in_stream_only": stream_only,
        "offline_seen_in_logs_only": log_only,
    }


def killed_node_view(sessions: dict[str, Session], gateway: str, kill_wall: float) -> dict[str, Any]:
    """How the sessions a killed gateway held at ``kill_wall`` (Unix seconds) ended.

    Held: its sessions with no offline event stamped before the kill. Each must end
    ``node-lost`` (another node swept it) or ``takeover`` (the device reconnected to
    another node first); anything else, or nothing, is listed.
    """
    held = 0
    node_lost: list[float] = []
    taken_over = 0
    other: dict[str, int] = {}
    unended = 0
    for s in sessions.values():
        if node_of(s.node) != gateway or not s.seen_online:
            continue
        first = s.offline[0] if s.offline else None
        if first is not None and float(first.get("time", 0.0)) < kill_wall:
            continue
        held += 1
        if first is None:
            unended += 1
            continue
        reason = str(first.get("reason"))
        if reason == "node-lost":
            node_lost.append(float(first.get("time", math.nan)) - kill_wall)
        elif reason == "takeover":
            taken_over += 1
        else:
            other[reason] = other.get(reason, 0) + 1
    return {
        "gateway": gateway,
        "held": held,
        "node_lost": len(node_lost),
        "taken_over": taken_over,
        "other": other,
        "unended": unended,
        "first_node_lost_s": min(node_lost, default=math.nan),
        "last_node_lost_s": max(node_lost, default=math.nan),
        "accounted": held > 0 and held == len(node_lost) + taken_over,
    }


def classify_drops(
    drops: Iterable[dict[str, Any]], killed_port: int | None, kill_mono: float | None, window: float
) -> dict[str, Any]:
    """Sort the connections gateways closed under healthy devices.

    One closed by the killed gateway from the kill on is the kill's doing (the device
    fails over). Any other is a false expiry, unless the device itself had been
    silent (or its generator late) for a whole window: then the generator is to blame.
    """
    by_kill = 0
    false: list[dict[str, Any]] = []
    generator_late = 0
    for d in drops:
        # 10 ms of slack: the orchestrator reads its clock just before the kill signal.
        killed = killed_port is not None and kill_mono is not None and d["port"] == killed_port
        if killed and d["at"] >= (kill_mono or 0.0) - 0.01:
            by_kill += 1
        elif d["silent_for"] < window and d["max_gap"] < window:
            false.append(d)
        else:
            generator_late += 1
    return {
        "by_kill": by_kill,
        "false_expiries": len(false),
        "false_examples": false[:20],
        "generator_late": generator_late,
    }


def takeover_summary(values: list[float]) -> dict[str, float]:
    """Takeover latencies (s) as milliseconds, with how many closed before the new CONNACK came."""
    out = summary_ms(values)
    out["before_connack"] = sum(1 for v in values if v < 0)
    return out
