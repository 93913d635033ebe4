"""The state as the durable store's rows, and back.

Pure. Times cross a restart as wall-clock times: a session's departure, a queued
message's birth (for its MQTT 5 Message Expiry) and a retained message's expiry keep
counting while the server is down; in memory each is on its own clock (the session
store's, the outbox's), so each row is converted with both clocks' readings of now.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ...broker.outbox import Message, Stage
from ...broker.persistent import SessionStore, StoredSession
from ...presence.event import PresenceEvent

__all__ = [
    "Clocks",
    "MessageRow",
    "SessionRow",
    "device_row",
    "event_of",
    "message_of",
    "message_row",
    "session_of",
    "session_row",
]

SessionRow = tuple[str, str | None, int, float, float, str, str]
"""client_id, username, v5, expiry, left_at (wall; 0: its client was connected), subscriptions, inbound."""
MessageRow = tuple[int, str, str, bytes, int, int, bytes | None, str, int, int, float | None]
"""seq, client_id, topic, payload, qos, retain, properties, group, packet_id, stage, born (wall)."""

_STAGES = (Stage.PUBLISHED, Stage.RELEASED)


@dataclass(frozen=True, slots=True)
class Clocks:
    """One moment on each clock the state uses: the wall, the session store's and the outboxes'."""

    wall: float
    store: float
    outbox: float

    def to_wall(self, store_time: float) -> float:
        """A session store's time as wall-clock time."""
        return self.wall - (self.store - store_time)

    def from_wall(self, wall_time: float) -> float:
        """A wall-clock time on the session store's clock."""
        return self.store - (self.wall - wall_time)


def device_row(event: PresenceEvent, once: bool, written: int) -> tuple[str, str, int, int]:
    """A device record's row."""
    assert event.client_id is not None
    return event.client_id, json.dumps(event.to_dict(), separators=(",", ":")), int(once), written


def event_of(text: str) -> PresenceEvent:
    """The presence event a device row holds."""
    data: dict[str, Any] = json.loads(text)
    return PresenceEvent.from_dict(data)


def session_row(stored: StoredSession, options: dict[str, int] | None, clocks: Clocks) -> SessionRow:
    """A persistent session's row (its messages are rows of their own)."""
    subscriptions = [[f, qos, (options or {}).get(f, 0)] for f, qos in stored.subscriptions.items()]
    left = 0.0 if stored.holder is not None else clocks.to_wall(stored.left_at)
    return (
        stored.client_id,
        stored.username,
        int(stored.v5),
        stored.expiry,
        left,
        json.dumps(subscriptions, separators=(",", ":")),
        json.dumps(sorted(stored.inbound)),
    )


def message_row(client_id: str, message: Message, clocks: Clocks) -> MessageRow:
    """A queued or in-flight message's row."""
    born = clocks.wall - (clocks.outbox - message.born) if message.born else None
    return (
        message.seq,
        client_id,
        message.topic,
        message.payload,
        message.qos,
        int(message.retain),
        message.properties,
        message.group,
        message.packet_id,
        _STAGES.index(message.stage),
        born,
    )


def message_of(row: MessageRow, clocks: Clocks) -> Message:
    """The message a row holds (``packet_id`` nonzero: it was in flight)."""
    seq, _client, topic, payload, qos, retain, properties, group, packet_id, stage, born = row
    message = Message(topic, payload, qos, bool(retain), properties, group)
    message.seq = seq
    message.packet_id = packet_id
    message.stage = _STAGES[stage]
    if born is not None:
        message.born = clocks.outbox - (clocks.wall - born)
    return message


def session_of(
    row: SessionRow,
    rows: Iterable[MessageRow],
    store: SessionStore,
    clocks: Clocks,
    ended_at: float,
    outbox_clock: Callable[[], float],
) -> tuple[StoredSession, dict[str, int]]:
    """The session a row holds with its messages (in order), for ``store``; one whose
    client was connected when the server stopped left at ``ended_at`` (wall). Returns
    it with its subscriptions' MQTT 5 options."""
    client_id, username, v5, expiry, left, subscriptions, inbound = row
    outbox = store.outbox(client_id, clock=outbox_clock)
    messages = [message_of(r, clocks) for r in rows]
    outbox.restore([m for m in messages if m.packet_id], [m for m in messages if not m.packet_id])
    stored = StoredSession(client_id, outbox, username, bool(v5), expiry)
    stored.left_at = clocks.from_wall(left or ended_at)
    stored.inbound = set(json.loads(inbound))
    options = {}
    for topic_filter, qos, packed in json.loads(subscriptions):
        stored.subscriptions[topic_filter] = qos
        if packed:
            options[topic_filter] = packed
    return stored, options
