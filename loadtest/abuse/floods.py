"""Attacks by volume, each from one source address: client ids of 60 KB
(``huge-ids``), connections as fast as they are accepted (``connect-flood``), and tens
of thousands of wildcard filters under a stream of messages (``wildcard-flood``).

Their harm shows in the healthy fleet's round trips and reconnects, and in the
server's memory per hostile unit; the answers (CONNACK and SUBACK codes) say what
the server made of them.
"""

from __future__ import annotations

import math

import trio

from servers.heartbeat.mqtt import encoders

from .attack import ATTACKER, Attack, Inbox, Scene, bounded, connected

__all__ = ["ConnectFlood", "HugeIds", "WildcardFlood"]

HUGE_ID = 60_000
"""Characters in a huge client id."""
LONG_USERNAME = 8_000


class HugeIds(Attack):
    """Connect and DISCONNECT, each time under a new 60 KB client id and a long username."""

    name = "huge-ids"
    summary = f"connect/disconnect cycles with {HUGE_ID // 1000} KB client ids and {LONG_USERNAME // 1000} KB usernames"
    per_unit = 2048.0
    count = 3000
    concurrency = 4

    async def run(self, scene: Scene) -> None:
        """Cycle through new ids until the count or the time is reached."""
        username = "u" * LONG_USERNAME

        async def cycle(i: int) -> None:
            client_id = f"huge-{i:06d}-".ljust(HUGE_ID, "x")
            try:
                async with connected(scene.port, ATTACKER) as client:
                    code = await client.connect(client_id, username=username)
                    scene.answer(f"connack-{code}" if code >= 0 else "no-connack")
                    if code == 0:
                        await client.disconnect()
            except OSError:
                scene.answer("connect-failed")

        scene.outcome.units = await bounded(scene.seconds, self.count, cycle, self.concurrency)


class ConnectFlood(Attack):
    """New connections from one address at a steady rate, each CONNECT under an id of its own."""

    name = "connect-flood"
    summary = "connects as fast as a steady rate allows from one address, each with an id of its own"
    unit = "connect"
    per_unit = 2048.0
    rate = 400.0
    concurrency = 64

    async def run(self, scene: Scene) -> None:
        """Connect, wait for the CONNACK, DISCONNECT; ``rate`` a second."""

        async def once(i: int) -> None:
            try:
                async with connected(scene.port, ATTACKER) as client:
                    code = await client.connect(f"flood-{i}")
                    scene.answer(f"connack-{code}" if code >= 0 else "closed" if client.closed else "no-connack")
                    if code == 0:
                        await client.disconnect()
            except (OSError, trio.TooSlowError):
                scene.answer("connect-failed")

        count = math.ceil(self.rate * scene.seconds)
        scene.outcome.units = await bounded(scene.seconds, count, once, self.concurrency, self.rate)


class WildcardFlood(Attack):
    """One client subscribes to 20,000 filters ``zz/+/<i>``; another publishes to them."""

    name = "wildcard-flood"
    summary = "20,000 filters zz/+/<i> on one client, messages to them at a steady rate"
    unit = "filter"
    per_unit = 2048.0
    filters = 20_000
    per_packet = 500
    rate = 300.0

    async def run(self, scene: Scene) -> None:
        """Subscribe to every filter (the SUBACKs' codes counted), then publish until time's up."""
        began = trio.current_time()
        flooded = Inbox(keep=0)
        async with connected(scene.port, ATTACKER, flooded) as sub, connected(scene.port, ATTACKER) as pub:
            if await sub.connect("flood-sub", keep_alive=0) != 0 or await pub.connect("flood-pub", keep_alive=0) != 0:
                scene.answer("refused")
                return
            for packet, first in enumerate(range(0, self.filters, self.per_packet)):
                codes = await sub.subscribe(packet + 1, [f"zz/+/{i}" for i in range(first, first + self.per_packet)])
                if codes is None:
                    scene.answer("no-suback")
                    break
                for code in set(codes):
                    scene.answer(f"suback-{code}", codes.count(code))
                if trio.current_time() - began > scene.seconds / 2:
                    break
            scene.outcome.units = sum(n for key, n in scene.outcome.answers.items() if key.startswith("suback-"))
            left = scene.seconds - (trio.current_time() - began)

            async def publish(j: int) -> None:
                await pub.send(encoders.encode_publish(f"zz/x/{j % self.filters}", b"flood"))

            sent = await bounded(left, math.ceil(self.rate * left), publish, rate=self.rate)
            await pub.round_trip()
            await sub.round_trip()
            scene.outcome.notes.append(f"{sent:,} messages published; the flooded subscriber got {flooded.count:,}")
