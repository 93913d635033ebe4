"""``pattern-escape``: client ids that widen an ACL pattern's ``%c`` beyond the client's
own tree.

With ``pattern readwrite devices/%c/#``, the id ``sensor1/cmd`` expands it to
``devices/sensor1/cmd/#``, inside device ``sensor1``'s tree: a write escape. The id
``+`` expands it to ``devices/+/#``, every device's tree: a read escape. The victim,
``sensor1``, subscribes to its own tree and publishes in it; neither attacker may
reach it.
"""

from __future__ import annotations

import trio

from .attack import ATTACKER, Attack, Inbox, Scene, bounded, connected, quiet, victim
from .client import Client

__all__ = ["PatternEscape"]

VICTIM_ID = "sensor1"
WRITER = f"{VICTIM_ID}/cmd"
"""The write escape's client id: ``devices/%c/#`` becomes ``devices/sensor1/cmd/#``."""
READERS = ("+", "#")
"""The read escape's client ids: ``devices/%c/#`` becomes ``devices/+/#`` (or an invalid filter)."""


class PatternEscape(Attack):
    """A writer into another device's tree and readers of every tree, through ``%c``."""

    name = "pattern-escape"
    summary = "client ids sensor1/cmd, + and # widening the ACL pattern devices/%c/#"
    acl = True
    rounds = 10
    rate = 2.0

    def __init__(self) -> None:
        self.victim_inbox = Inbox()
        self.stolen = Inbox()
        self.victim: Client | None = None
        self.sent = 0

    async def prepare(self, scene: Scene, nursery: trio.Nursery) -> None:
        """The victim subscribes to its own tree."""
        self.victim = await victim(scene, nursery, VICTIM_ID, self.victim_inbox)

    async def run(self, scene: Scene) -> None:
        """Each round: the writer publishes into the victim's tree; a reader subscribes to
        every tree, and the victim publishes in its own."""
        owner = self.victim
        assert owner is not None

        async def round_(i: int) -> None:
            async with connected(scene.port, ATTACKER) as writer:
                code = await writer.connect(WRITER)
                scene.answer(f"writer-connack-{code}" if code >= 0 else "writer-no-connack")
                if code == 0:
                    await writer.publish(1, f"devices/{VICTIM_ID}/cmd", f"escaped-{i}".encode())
                    self.sent += 1
                    await writer.disconnect()
            async with connected(scene.port, ATTACKER, self.stolen) as reader:
                code = await reader.connect(READERS[i % len(READERS)])
                scene.answer(f"reader-connack-{code}" if code >= 0 else "reader-no-connack")
                if code == 0:
                    codes = await reader.subscribe(1, ["devices/+/#", "devices/#"])
                    for c in codes or b"":
                        scene.answer(f"reader-suback-{c}")
                    await owner.publish(i + 2, f"devices/{VICTIM_ID}/state", f"private-{i}".encode())
                    await quiet(reader, self.stolen)
                    await reader.disconnect()

        scene.outcome.units = await bounded(scene.seconds, self.rounds, round_, rate=self.rate)

    async def verify(self, scene: Scene) -> None:
        """The victim got none of the writer's messages; the readers none of the victim's."""
        if self.victim is not None:
            await quiet(self.victim, self.victim_inbox)
        escaped = [m for m in self.victim_inbox.messages if m[1].startswith(b"escaped-")]
        scene.find(
            "write-escape",
            not escaped,
            f"{len(escaped)} of the {self.sent} messages {WRITER!r} published reached {VICTIM_ID}'s subscriber"
            if escaped
            else f"none of the {self.sent} messages {WRITER!r} published reached {VICTIM_ID}'s subscriber",
        )
        scene.find(
            "read-escape",
            not self.stolen.count,
            f"clients {' and '.join(READERS)} read {self.stolen.count} of {VICTIM_ID}'s messages"
            if self.stolen.count
            else f"clients {' and '.join(READERS)} read none of {VICTIM_ID}'s messages",
        )
