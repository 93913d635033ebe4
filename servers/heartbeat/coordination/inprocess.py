"""The coordinator of a lone worker: the registry lives in the process, nothing is shared."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from functools import partial
from typing import Any

import trio

from ...logs import OncePer
from ...prometheus import Families, Metric
from ..broker.reports import Delivery, Opened, Report
from ..mqtt.endings import Offline
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
from .durable import Durability
from .durable.driver import Committer, durability_figures, restored
from .durable.wills import HeldWill
from .registry import DEFAULT_MAX_BYTES as DEFAULT_RECORD_BYTES
from .registry import Registry
from .retention import MqttState, RetainedMessage, live_presence
from .sys_figures import BrokerCounts, with_store

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
        durability: Durability | None = None,
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
        self.durability = durability
        """Where the state is kept across restarts (None: in memory only)."""
        self.keeps_wills = durability is not None
        self.committer = None if durability is None else Committer(durability)
        """Commits ``durability`` (None without it)."""
        if durability is not None:
            for event in restored(durability, self.registry, self.retention, self.store, self.recent, self.sinks):
                self._publish(event)

    async def run(self, host: Host, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Attach to ``host``; then expire persistent sessions whose clients stay away
        (and commit the state, if it is kept durably)."""
        self._host = host
        async with trio.open_nursery() as nursery:
            if self.committer is not None:
                nursery.start_soon(self.committer.run)
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
        """See :meth:`Coordinator.offline`. Kept durably, a session the server's stop
        ends stays online in the record: the next start ends it (``server-shutdown``)."""
        if self.committer is not None and event.reason is Offline.SHUTDOWN:
            self.committer.stopping = True
            return
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
        durability = self.durability
        if durability is not None and durability.later(partial(self._send, delivery), ("always",)):
            return  # a packet id or a PUBREL goes once it is on disk: exactly once through a crash
        self._send(delivery)

    def _send(self, delivery: Delivery) -> None:
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
        """Everything is published synchronously (and the server is stopping)."""
        if self.committer is not None:
            self.committer.stopping = True

    def will_held(self, held: HeldWill) -> None:
        """See :meth:`Coordinator.will_held`."""
        if self.durability is not None:
            self.durability.will_held(held)

    def will_done(self, client_id: str, epoch: str) -> None:
        """See :meth:`Coordinator.will_done`."""
        if self.durability is not None:
            self.durability.will_done(client_id, epoch)

    async def pending_wills(self) -> list[HeldWill]:
        """See :meth:`Coordinator.pending_wills`."""
        return [] if self.durability is None else list(self.durability.wills.values())

    def commit_mark(self) -> int | None:
        """See :meth:`Coordinator.commit_mark`."""
        return None if self.committer is None else self.committer.mark()

    async def committed(self, mark: int) -> bool:
        """See :meth:`Coordinator.committed`."""
        return True if self.committer is None else await self.committer.committed(mark)

    async def broker_counts(self, own: BrokerCounts) -> BrokerCounts:
        """``own`` with this worker's persistent sessions and retained messages."""
        return with_store(own, self.store, self.retention)

    def health(self) -> Health:
        """Fine unless the durable store cannot write."""
        if self.durability is not None and self.durability.failure is not None:
            return Health(False, f"the durable store cannot write: {self.durability.failure}")
        return Health(True)

    def figures(self) -> list[Metric]:
        """The registry's size."""
        f = Families({})
        f.gauge("heartbeat_registry_records", "Device records kept for /devices.", len(self.registry))
        durable = [] if self.durability is None else durability_figures(self.durability, self.store, self.retention)
        return f.families + session_figures(self.store) + retained_figures(self.retention) + durable

    def _publish(self, event: PresenceEvent) -> None:
        if self.durability is None or not self.durability.tell_later(event, partial(self._tell, event)):
            self._tell(event)  # else once its record is on disk

    def _tell(self, event: PresenceEvent) -> None:
        self.recent(event)
        publish_to_sinks(self.sinks, event)
        if self._host is not None and event.client_id is not None:
            properties = self.retention.presence_properties(event)
            topic = self.presence_prefix + event.client_id
            self._host.deliver(live_presence(topic, event, properties, self.retention.presence))
