"""The coordinator of a lone worker: the registry lives in the process, nothing is shared."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

import trio

from ...logs import OncePer
from ...prometheus import Families, Metric
from ..broker.reports import Delivery, Opened, Report
from ..mqtt.policy import DEFAULT_PRESENCE_PREFIX
from ..mqtt.publication import Publication
from ..presence.event import PresenceEvent, PresenceSink
from ..presence.overview import RecentEnds, registry_overview
from . import (
    Coordinator,
    Health,
    Host,
    log_session_drops,
    log_sessions_full,
    publish_to_sinks,
    retained_figures,
    session_figures,
)
from .registry import DEFAULT_MAX_BYTES as DEFAULT_RECORD_BYTES
from .registry import Registry
from .retention import MqttState, RetainedMessage

logger = logging.getLogger("servers.heartbeat.coordination")

# How often sessions whose clients never came back are looked for.
EXPIRY_SWEEP = 60.0

__all__ = ["InProcessCoordinator"]


class InProcessCoordinator(Coordinator):
    """Applies the registry's rules in-process and publishes at once (no I/O)."""

    refills_here = True

    def __init__(
        self,
        sinks: Sequence[PresenceSink] = (),
        *,
        presence_prefix: str = DEFAULT_PRESENCE_PREFIX,
        max_records: int = 1_000_000,
        max_record_bytes: int = DEFAULT_RECORD_BYTES,
        state: MqttState | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.presence_prefix = presence_prefix
        self.registry = Registry(max_records, max_record_bytes)
        self.recent = RecentEnds()
        """The latest ends, for the operator's page."""
        state = state if state is not None else MqttState()
        self.store = state.store
        self._logged = OncePer()
        self.retention = state.retention(self.registry, presence_prefix, time.time)
        self._host: Host | None = None

    async def run(self, host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Attach to ``host``; then expire persistent sessions whose clients stay away."""
        self._host = host
        task_status.started()
        while True:
            await trio.sleep(EXPIRY_SWEEP)
            expired = self.store.expire(trio.current_time())
            if expired:
                logger.info("%d persistent sessions expired (their clients stayed away)", len(expired))
            self.retention.store.prune(time.time())

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

    def route(self, message: Publication, groups: Sequence[str] = (), *, origin: str = "") -> Sequence[str]:
        """No other worker to route to (every shared subscription is served here);
        persistent sessions take their QoS 1 and 2 copies."""
        for delivery in self.store.route(message, origin):
            self._transmit(delivery)
        log_session_drops(self.store)
        return groups

    async def open_session(
        self,
        client_id: str,
        username: str | None = None,
        v5: bool = False,
        *,
        expiry: int | None = None,
        create: bool = True,
    ) -> Opened | None:
        """See :meth:`Coordinator.open_session`."""
        now = trio.current_time()
        opened = self.store.open(client_id, False, now, username, v5, expiry=expiry, create=create)
        if opened is None:
            log_sessions_full(self.store, self._logged)
        return opened

    def discard_session(self, client_id: str) -> None:
        """See :meth:`Coordinator.discard_session`."""
        self.store.discard(client_id)

    def session(self, report: Report) -> None:
        """See :meth:`Coordinator.session`."""
        delivery = self.store.apply(report, trio.current_time())
        if delivery is not None:
            self._transmit(delivery)

    def acknowledged(self, client_id: str, epoch: str, acks: Sequence[tuple[str, int]]) -> None:
        """See :meth:`Coordinator.acknowledged`: the store takes them at once."""
        delivery = self.store.acknowledge_all(client_id, epoch, acks)
        if delivery is not None:
            self._transmit(delivery)

    def retain(self, topic: str, payload: bytes, qos: int, owner: str = "", properties: bytes = b"") -> None:
        """See :meth:`Coordinator.retain`."""
        self.retention.retain(topic, payload, qos, owner, properties)

    async def retained(self, topic_filter: str, cursor: str | None) -> tuple[list[RetainedMessage], str | None]:
        """See :meth:`Coordinator.retained`."""
        return self.retention.page(topic_filter, cursor)

    def _transmit(self, delivery: Delivery) -> None:
        if self._host is not None:
            self._host.transmit(delivery.client_id, str(delivery.holder), delivery.packets, delivery.v5)

    def filters_changed(self, added: Collection[str], removed: Collection[str] = ()) -> None:
        """Nobody else to tell."""

    async def lookup(self, client_id: str) -> PresenceEvent | None:
        """See :meth:`Coordinator.lookup`."""
        return self.registry.get(client_id)

    async def overview(self, query: str = "", limit: int = 100) -> dict[str, Any] | None:
        """See :meth:`Coordinator.overview`: this worker's registry."""
        registry = self.registry
        return registry_overview("worker", registry.online_count, len(registry), self.recent, query, limit)

    async def drain(self) -> None:
        """Everything is published synchronously."""

    def health(self) -> Health:
        """Always fine: there is nothing to fall behind."""
        return Health(True)

    def figures(self) -> list[Metric]:
        """The registry's size."""
        f = Families({})
        f.gauge("heartbeat_registry_records", "Device records kept for /devices.", len(self.registry))
        return f.families + session_figures(self.store) + retained_figures(self.retention)

    def _publish(self, event: PresenceEvent) -> None:
        self.recent(event)
        publish_to_sinks(self.sinks, event)
        if self._host is not None and event.client_id is not None:
            properties = self.retention.presence_properties(event)
            topic = self.presence_prefix + event.client_id
            self._host.deliver(Publication(topic, event.payload(), 0, False, properties))
