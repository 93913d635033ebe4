"""The coordinator of a lone worker: the registry lives in the process, nothing is shared."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ...prometheus import Families, Metric
from ..presence import PresenceEvent, PresenceSink
from . import Coordinator, Health, Host, publish_to_sinks
from .registry import Registry

__all__ = ["InProcessCoordinator"]


class InProcessCoordinator(Coordinator):
    """Applies the registry's rules in-process and publishes at once (no I/O)."""

    def __init__(
        self, sinks: Sequence[PresenceSink] = (), *, presence_prefix: str = "presence/", max_records: int = 1_000_000
    ) -> None:
        self.sinks = list(sinks)
        self.presence_prefix = presence_prefix
        self.registry = Registry(max_records)
        self._host: Host | None = None

    async def run(self, host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Attach to ``host``; nothing else to run."""
        self._host = host
        task_status.started()
        await trio.sleep_forever()

    def attach(self, host: Host) -> None:
        """Attach without a task (for embedding where nothing must run)."""
        self._host = host

    def online(self, event: PresenceEvent) -> None:
        """See :meth:`Coordinator.online`."""
        claim = self.registry.online(event)
        for e in claim.emit:
            self._publish(e)
        if claim.evict is not None and self._host is not None:
            assert claim.evict.client_id is not None
            self._host.evict(claim.evict.client_id, claim.evict.epoch, "reconnected")

    def offline(self, event: PresenceEvent, *, forget: bool = False) -> None:
        """See :meth:`Coordinator.offline`."""
        if self.registry.offline(event, forget=forget) is not None:
            self._publish(event)

    def note(self, event: PresenceEvent) -> None:
        """See :meth:`Coordinator.note`."""
        publish_to_sinks(self.sinks, event)

    def route(self, topic: str, payload: bytes, qos: int) -> None:
        """Nobody else to route to."""

    def filters_changed(self, filters: set[str]) -> None:
        """Nobody else to tell."""

    async def lookup(self, client_id: str) -> PresenceEvent | None:
        """See :meth:`Coordinator.lookup`."""
        return self.registry.get(client_id)

    async def drain(self) -> None:
        """Everything is published synchronously."""

    def health(self) -> Health:
        """Always fine: there is nothing to fall behind."""
        return Health(True)

    def figures(self) -> list[Metric]:
        """The registry's size."""
        f = Families({})
        f.gauge("heartbeat_registry_records", "Device records kept for /devices.", len(self.registry))
        return f.families

    def _publish(self, event: PresenceEvent) -> None:
        publish_to_sinks(self.sinks, event)
        if self._host is not None and event.client_id is not None:
            self._host.deliver(self.presence_prefix + event.client_id, event.payload(), 0)
