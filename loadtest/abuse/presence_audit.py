"""Presence messages and the server's presence log, made comparable: a message is the
server's own only if the log holds an event whose topic and content are the same.

Both sides are reduced to a digest of the topic and the payload read as JSON (key
order and spacing aside: the log and the wire space their JSON differently), so the
healthy subscriber need not carry 60 KB topics to the judge, and the log is read a
line at a time however large the hostile ids made it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX

from .observation import LogSummary, PresenceSeen

__all__ = ["EXCERPT", "PRESENCE_PREFIX", "digest", "excerpt", "read_log", "seen"]

PRESENCE_PREFIX = DEFAULT_PRESENCE_PREFIX
"""Where the heartbeat server publishes presence (its default ``presence_prefix``, ``$SYS/presence/``)."""
EXCERPT = 80
"""Characters of a topic or client id kept for the report."""


def excerpt(text: str) -> str:
    """``text`` cut to :data:`EXCERPT` characters, saying how long it was."""
    return text if len(text) <= EXCERPT else f"{text[:EXCERPT]}...({len(text):,} chars)"


def _canonical(payload: bytes) -> tuple[bytes, Any]:
    try:
        data = json.loads(payload)
    except ValueError:
        return payload, None
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode(), data


def digest(topic: str, payload: bytes) -> str:
    """What identifies a presence message: its topic and its payload's JSON, however spaced."""
    body, _ = _canonical(payload)
    return hashlib.sha1(topic.encode("utf-8", "surrogatepass") + b"\0" + body).hexdigest()


def seen(topic: str, payload: bytes, retained: bool = False) -> PresenceSeen:
    """The record of a presence message as the subscriber got it, now (``retained``:
    sent with the retain flag, on subscribing)."""
    _, data = _canonical(payload)
    client_id = status = None
    if isinstance(data, dict):
        client_id = None if data.get("client_id") is None else excerpt(str(data.get("client_id")))
        status = None if data.get("status") is None else str(data.get("status"))
    return PresenceSeen(
        excerpt(topic), digest(topic, payload), client_id, status, time.time(), "+" in topic or "#" in topic, retained
    )


def read_log(path: Path, healthy: Collection[str]) -> LogSummary:
    """The presence log at ``path`` in brief; ``healthy``: the client ids whose every event
    is listed (the fleet's devices and probes)."""
    summary = LogSummary()
    try:
        lines = path.open(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return summary
    with lines:
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            status = event.get("status")
            client_id = event.get("client_id")
            if status == "refused":
                summary.refused += 1
                continue
            if client_id is None or status not in ("online", "offline"):
                continue  # a socket that never identified itself: no presence topic
            topic = PRESENCE_PREFIX + str(client_id)
            key = digest(topic, json.dumps(event).encode("utf-8", "surrogatepass"))
            summary.events[key] += 1
            if status == "online":
                summary.sessions.add(excerpt(str(client_id)))
            if client_id in healthy:
                summary.healthy.append((str(client_id), str(status), float(event.get("time", 0.0)), key))
    return summary
