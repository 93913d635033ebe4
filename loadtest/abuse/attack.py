"""What every attack is made of: the :class:`Scene` it plays in (the server, the loopback
addresses, the time it has, where its outcome goes), the :class:`Attack` base class
(its options for each server, its phases), and the bounded loops and clients the
attacks share.

An attack has three phases, each bounded in time: :meth:`Attack.prepare` before the
healthy fleet's baseline (a victim connects and subscribes), :meth:`Attack.run` for at
most ``scene.seconds`` (the attacker), and :meth:`Attack.verify` after it (what the
victim has now). What the server answered goes to ``scene.outcome.answers``; the
attack's own checks to ``scene.outcome.findings``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

import trio

from .client import Client, OnPublish
from .observation import AttackOutcome, Finding
from .targets import is_ours

__all__ = ["ATTACKER", "VICTIM", "Attack", "Inbox", "Scene", "bounded", "connected", "quiet", "victim"]

ATTACKER = "127.0.0.2"
"""The attacker's source address: another loopback address than the healthy fleet's, so
a bound per address meant for it does not fall on them."""
VICTIM = "127.0.0.1"
"""The victims' source address (the healthy fleet's)."""
QUIET = 0.3
"""Seconds without a message after which nothing more is taken to be coming."""


@dataclass
class Scene:
    """Where an attack plays: one server, fresh for it, with the healthy fleet beside it."""

    target: str
    """``idlekeeper`` or ``mosquitto``."""
    port: int
    seconds: float
    """How long :meth:`Attack.run` may take."""
    healthy: list[str]
    """The healthy fleet's client ids."""
    status_port: int | None = None
    outcome: AttackOutcome = field(default_factory=AttackOutcome)

    @property
    def ours(self) -> bool:
        """The server under attack is ours (it has presence topics and a status port)."""
        return is_ours(self.target)

    def answer(self, what: str, n: int = 1) -> None:
        """Count an answer the server gave the attacker."""
        self.outcome.answers[what] += n

    def find(self, name: str, passed: bool, detail: str) -> None:
        """Record one of the attack's own checks."""
        self.outcome.findings[name] = Finding(passed, detail)


class Attack:
    """One attack: a subclass per attack, an instance per run (it keeps the run's state)."""

    name: ClassVar[str]
    summary: ClassVar[str]
    unit: ClassVar[str] = "id"
    """What one hostile unit is (memory is reported per unit)."""
    per_unit: ClassVar[float] = 4096.0
    """Bytes of server memory a hostile unit may add (beyond the judge's slack)."""
    not_for_mosquitto: ClassVar[str | None] = None
    """Why the attack does not apply to Mosquitto; None when it does."""
    ours_args: ClassVar[tuple[str, ...]] = ()
    """More options for ``servers.heartbeat``."""
    mosquitto_config: ClassVar[str] = ""
    """More lines for Mosquitto's configuration."""
    acl: ClassVar[bool] = False
    """Both servers get the ACL file (:data:`~.targets.ACL_RULES`)."""

    async def prepare(self, scene: Scene, nursery: trio.Nursery) -> None:
        """Before the baseline: victims connect (they may keep tasks in ``nursery``)."""

    async def run(self, scene: Scene) -> None:
        """The attack itself, for at most ``scene.seconds``."""
        raise NotImplementedError

    async def verify(self, scene: Scene) -> None:
        """After the attack: what the victims have now, as findings."""


async def bounded(
    seconds: float,
    count: int,
    job: Callable[[int], Awaitable[None]],
    concurrency: int = 1,
    rate: float = math.inf,
) -> int:
    """Run ``job(0)``, ``job(1)``, ... at most ``concurrency`` at once and ``rate`` started a
    second, until ``count`` have started or ``seconds`` have passed (jobs still running
    then are cancelled). How many started."""
    started = 0
    began = time.monotonic()
    limit = trio.Semaphore(concurrency)

    async def one(i: int) -> None:
        try:
            await job(i)
        finally:
            limit.release()

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for i in range(count):
                if rate != math.inf:
                    await trio.sleep(max(0.0, began + i / rate - time.monotonic()))
                await limit.acquire()
                nursery.start_soon(one, i)
                started += 1
    return started


@contextlib.asynccontextmanager
async def connected(port: int, source: str, on_publish: OnPublish | None = None) -> AsyncIterator[Client]:
    """A client connection (not yet MQTT-connected) for the block, closed after it."""
    async with trio.open_nursery() as nursery:
        client = await Client.start(nursery, port, source, on_publish)
        try:
            yield client
        finally:
            client.close()


async def victim(scene: Scene, nursery: trio.Nursery, client_id: str, inbox: Inbox | None = None) -> Client:
    """A healthy client the attack aims at, connected from :data:`VICTIM` for the whole run
    (its reader in ``nursery``); with ``inbox``, subscribed to its own tree
    ``devices/<client_id>/#``. Raises RuntimeError if the server refuses either."""
    client = await Client.start(nursery, scene.port, VICTIM, inbox)
    code = await client.connect(client_id)
    if code != 0:
        raise RuntimeError(f"the victim {client_id} was not accepted: CONNACK {code}")
    if inbox is not None:
        codes = await client.subscribe(1, [f"devices/{client_id}/#"])
        if codes != b"\x00":
            raise RuntimeError(f"the victim {client_id} may not read its own tree: SUBACK {codes!r}")
    return client


async def quiet(client: Client, inbox: Inbox, limit: float = 5.0) -> None:
    """Wait (at most ``limit`` s) until ``client`` has had a round trip and then nothing
    for :data:`QUIET` s: what the server had queued for it has come."""
    with trio.move_on_after(limit):
        await client.round_trip(limit)
        while True:
            before = inbox.count
            await trio.sleep(QUIET)
            if inbox.count == before:
                return


@dataclass
class Inbox:
    """The messages a client was sent: (topic, payload, retain) each, at most ``keep``."""

    keep: int = 10_000
    messages: list[tuple[str, bytes, bool]] = field(default_factory=list)
    count: int = 0

    def __call__(self, topic: str, payload: bytes, retain: bool) -> None:
        self.count += 1
        if len(self.messages) < self.keep:
            self.messages.append((topic, payload, retain))
