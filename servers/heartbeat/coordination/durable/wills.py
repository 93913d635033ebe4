"""MQTT 5 delayed Wills as the durable store keeps them: a Will waiting out its delay
survives a restart (and a crash), and the next start waits out what is left of it."""

from __future__ import annotations

from dataclasses import dataclass

from ...mqtt.effects import Will

__all__ = ["HeldWill", "WillRow", "held_will_of", "will_row"]

WillRow = tuple[str, str, float, str, bytes, int, int, bytes, int, int]
"""client_id, epoch, due (wall), topic, message, qos, retain, properties, delay, asked_delay."""


@dataclass(frozen=True, slots=True)
class HeldWill:
    """A Will waiting for its delay: the session that left it, and when it is due (wall clock)."""

    client_id: str
    epoch: str
    will: Will
    due: float


def will_row(held: HeldWill) -> WillRow:
    """A held Will's row."""
    w = held.will
    return (
        held.client_id, held.epoch, held.due, w.topic, w.message, w.qos, int(w.retain), w.properties, w.delay,
        w.asked_delay,
    )  # fmt: skip


def held_will_of(row: WillRow) -> HeldWill:
    """The held Will a row holds."""
    client_id, epoch, due, topic, message, qos, retain, properties, delay, asked_delay = row
    return HeldWill(client_id, epoch, Will(topic, message, qos, bool(retain), properties, delay, asked_delay), due)
