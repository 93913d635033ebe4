"""``retained-fill``: one client fills the retained store, then a victim updates its own
retained topic.

Ours runs with ``--max-retained-bytes`` small (:data:`STORE_BYTES`); the attacker
publishes several times that. The victim's value must survive: its update kept, or
refused with the previous value left in place; never the topic emptied. Mosquitto has
no bound on retained bytes: it keeps everything, and its figure is the memory that
costs.
"""

from __future__ import annotations

import json

import trio

from .attack import ATTACKER, VICTIM, Attack, Inbox, Scene, bounded, connected, quiet, victim
from .client import Client

__all__ = ["RetainedFill"]

STORE_BYTES = 100_000
"""Our server's ``--max-retained-bytes`` for this attack."""
FILL_PAYLOAD = 1000
VICTIM_ID = "sensor1"
VICTIM_TOPIC = f"devices/{VICTIM_ID}/state"
FIRST = json.dumps({"v": 1}).encode()
SECOND = json.dumps({"v": 2, "pad": "x" * 2 * FILL_PAYLOAD}).encode()
"""Larger than :data:`FIRST` (a replacement no larger always fits, and would prove
nothing), and than the room one of the attacker's messages could leave in a full store."""


class RetainedFill(Attack):
    """An attacker's retained messages past the store's bound, then the victim's update."""

    name = "retained-fill"
    summary = f"retained messages past --max-retained-bytes {STORE_BYTES}, then a victim's update"
    unit = "message"
    per_unit = 4096.0
    ours_args = ("--max-retained-bytes", str(STORE_BYTES))
    messages = 400
    """Four times the store, in :data:`FILL_PAYLOAD`-byte payloads."""

    def __init__(self) -> None:
        self.victim: Client | None = None
        self.second_acked = False

    async def prepare(self, scene: Scene, nursery: trio.Nursery) -> None:
        """The victim retains its first value."""
        self.victim = await victim(scene, nursery, VICTIM_ID)
        if not await self.victim.publish(1, VICTIM_TOPIC, FIRST, retain=True):
            raise RuntimeError("the victim's first retained value was not acknowledged")

    async def run(self, scene: Scene) -> None:
        """Fill the store, then the victim updates its value."""
        async with connected(scene.port, ATTACKER) as filler:
            code = await filler.connect("filler")
            scene.answer(f"connack-{code}" if code >= 0 else "no-connack")
            if code == 0:

                async def fill(i: int) -> None:
                    acked = await filler.publish(i % 60000 + 1, f"fill/{i}", bytes(FILL_PAYLOAD), retain=True)
                    scene.answer("puback" if acked else "no-puback")

                # Spread over half the attack's time, so the fleet is measured while it lasts.
                rate = self.messages / (scene.seconds / 2)
                scene.outcome.units = await bounded(scene.seconds / 2, self.messages, fill, 16, rate)
                await filler.disconnect()
        owner = self.victim
        assert owner is not None
        self.second_acked = await owner.publish(2, VICTIM_TOPIC, SECOND, retain=True)

    async def verify(self, scene: Scene) -> None:
        """A new subscriber to the victim's topic gets one of its two values."""
        inbox = Inbox()
        async with connected(scene.port, VICTIM, inbox) as reader:
            await reader.connect("retained-reader")
            await reader.subscribe(1, [VICTIM_TOPIC, "fill/#"])
            await quiet(reader, inbox)
            await reader.disconnect()
        values = [payload for topic, payload, retain in inbox.messages if topic == VICTIM_TOPIC and retain]
        kept = sum(1 for topic, _, retain in inbox.messages if topic.startswith("fill/") and retain)
        scene.outcome.notes.append(
            f"the store kept {kept} of the attacker's {scene.outcome.units} retained messages; the victim's update "
            + ("was acknowledged" if self.second_acked else "had no PUBACK")
        )
        if values == [SECOND]:
            scene.find("victim-retained", True, "the victim's update was kept")
        elif values == [FIRST]:
            scene.find("victim-retained", True, "the victim's update was refused and its previous value kept")
        else:
            got = "nothing" if not values else f"{values[0][:40]!r}"
            scene.find(
                "victim-retained",
                False,
                f"the victim's retained topic {VICTIM_TOPIC} holds {got}: its update was refused"
                + (" and its previous value removed" if not values else ""),
            )
