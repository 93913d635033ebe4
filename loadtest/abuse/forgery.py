"""Attacks on presence itself: Wills that forge it (``will-forgery``) and client ids that
make presence topics with wildcards (``wildcard-ids``).

Their harm shows in what the healthy presence subscriber is told, which the judge
compares with the server's own presence log; ``will-forgery`` also checks that a Will
on a topic the ACL denies reaches no subscriber, and that no forged presence is left
retained for the next dashboard to read.
"""

from __future__ import annotations

import json

import trio

from .attack import ATTACKER, VICTIM, Attack, Inbox, Scene, bounded, connected, quiet, victim
from .client import Client
from .presence_audit import PRESENCE_PREFIX

__all__ = ["WildcardIds", "WillForgery"]

VICTIM_ID = "sensor1"
"""The device whose tree (``devices/sensor1/...``) the attackers aim at."""
DENIED_WILL = f"devices/{VICTIM_ID}/cmd"
"""A Will topic the ACL denies the attacker (it may write under devices/<its id>/ only)."""
GHOSTS = 3
"""Devices that never connect, whose presence the Wills claim."""
KINDS = ("ghost", "impostor", "denied")


class WillForgery(Attack):
    """Wills on ``$SYS/presence/ghost-<n>`` (retained: a device that never connected, online),
    on a healthy device's presence (offline), and on a topic the ACL denies; each forger
    resets its connection, so its Will goes out. The answers are counted by kind
    (:meth:`kind`): ``ghost-connack-0``, ``denied-connack-5``, ..."""

    name = "will-forgery"
    summary = "Wills forging presence (retained) or on an ACL-denied topic, then RST"
    unit = "forger"
    acl = True
    forgers = 30
    rate = 6.0

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.victim: Client | None = None

    async def prepare(self, scene: Scene, nursery: trio.Nursery) -> None:
        """The victim subscribes to its own tree, where the denied Will would land."""
        self.victim = await victim(scene, nursery, VICTIM_ID, self.inbox)

    @staticmethod
    def kind(scene: Scene, i: int) -> str:
        """Forger ``i``'s Will: ``ghost`` (a device that never connected, online, retained),
        ``impostor`` (a healthy device, offline) or ``denied`` (a topic the ACL denies)."""
        return KINDS[i % len(KINDS)] if scene.ours else "denied"  # Mosquitto has no presence to forge

    @staticmethod
    def will(scene: Scene, i: int) -> tuple[str, bytes, bool]:
        """Forger ``i``'s Will: topic, message, retain."""
        kind = WillForgery.kind(scene, i)
        if kind == "ghost":
            ghost = f"ghost-{i // len(KINDS) % GHOSTS}"
            return PRESENCE_PREFIX + ghost, json.dumps({"status": "online", "client_id": ghost}).encode(), True
        if kind == "impostor":
            target = scene.healthy[0]
            claim = {"status": "offline", "client_id": target, "reason": "keepalive-timeout"}
            return PRESENCE_PREFIX + target, json.dumps(claim).encode(), False
        return DENIED_WILL, b"reboot", False

    async def run(self, scene: Scene) -> None:
        """Forgers connect with a Will and reset their connection."""

        async def forge(i: int) -> None:
            async with connected(scene.port, ATTACKER) as client:
                code = await client.connect(f"forger-{i}", will=self.will(scene, i))
                kind = self.kind(scene, i)
                scene.answer(f"{kind}-connack-{code}" if code >= 0 else f"{kind}-no-connack")
                if code == 0:
                    await client.round_trip()
                client.abort()

        scene.outcome.units = await bounded(scene.seconds, self.forgers, forge, rate=self.rate)

    async def verify(self, scene: Scene) -> None:
        """The victim heard no Will; no forged presence is retained."""
        if self.victim is not None:
            await quiet(self.victim, self.inbox)
        denied = [m for m in self.inbox.messages if m[0] == DENIED_WILL]
        scene.find(
            "denied-will",
            not denied,
            f"the victim got {len(denied)} Wills on {DENIED_WILL}, a topic the ACL denies their senders"
            if denied
            else f"no Will on {DENIED_WILL} (denied by the ACL) reached the victim",
        )
        if scene.ours:
            await self._retained_ghosts(scene)

    async def _retained_ghosts(self, scene: Scene) -> None:
        inbox = Inbox()
        async with connected(scene.port, VICTIM, inbox) as reader:
            await reader.connect("presence-reader")
            await reader.subscribe(1, [f"{PRESENCE_PREFIX}ghost-{g}" for g in range(GHOSTS)])
            await quiet(reader, inbox)
            await reader.disconnect()
        kept = sorted({topic for topic, _, retain in inbox.messages if retain})
        scene.find(
            "retained-ghosts",
            not kept,
            f"forged presence retained for devices that never connected: {', '.join(kept)}"
            if kept
            else "no presence retained for the devices that never connected",
        )


WILDCARD_IDS = ("wild+{i}", "wild#{i}", "wild/+/{i}", "wild/{i}/#", "+", "#")


class WildcardIds(Attack):
    """Client ids holding ``+`` or ``#``: each would name a presence topic with a wildcard,
    which no topic name may hold (MQTT-4.7.1-1)."""

    name = "wildcard-ids"
    summary = "client ids with + or #, each connected and gone"
    not_for_mosquitto = "no presence topics: a client id never becomes a topic there"
    count = 60
    rate = 20.0

    async def run(self, scene: Scene) -> None:
        """Connect and DISCONNECT under each id."""

        async def once(i: int) -> None:
            client_id = WILDCARD_IDS[i % len(WILDCARD_IDS)].format(i=i)
            async with connected(scene.port, ATTACKER) as client:
                code = await client.connect(client_id)
                scene.answer(f"connack-{code}" if code >= 0 else "no-connack")
                if code == 0:
                    await client.disconnect()

        scene.outcome.units = await bounded(scene.seconds, self.count, once, rate=self.rate)
