"""Clusters of coordinators for the contract tests: hosts that record what they are
told, and a way to kill one member without it reporting anything."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from servers.bus import Hub
from servers.heartbeat.coordination import Coordinator
from servers.heartbeat.coordination.authority import Authority, epoch_of
from servers.heartbeat.coordination.local import BusCoordinator
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.publication import Publication
from servers.heartbeat.presence.event import PresenceEvent

from .redis_server import RedisServer, require_binary


@dataclass
class RecordingHost:
    """A worker stand-in: records deliveries and evictions, holds sessions."""

    worker: int
    node: str = ""
    delivered: list[tuple[str, bytes, int]] = field(default_factory=list)
    transmitted: list[tuple[str, str, list[bytes]]] = field(default_factory=list)
    evicted: list[tuple[str, str]] = field(default_factory=list)
    held: dict[str, PresenceEvent] = field(default_factory=dict)
    subscribed: set[str] = field(default_factory=set)
    count: int = 0
    properties: list[bytes] = field(default_factory=list)
    """The MQTT 5 properties of each delivered message, in step with ``delivered``."""
    retains: list[bool] = field(default_factory=list)
    """The retain flag each was published with, in step with ``delivered``."""
    groups: list[tuple[str, ...] | None] = field(default_factory=list)
    """The shared subscriptions each was for, in step with ``delivered``."""

    def deliver(self, message: Publication, groups: Collection[str] | None = None, plain: bool = True) -> None:
        self.delivered.append((message.topic, message.payload, message.qos))
        self.properties.append(message.properties)
        self.retains.append(message.retain)
        self.groups.append(None if groups is None else tuple(groups))

    def evict(self, client_id: str, epoch: str, detail: str) -> None:
        self.evicted.append((client_id, epoch))
        self.held.pop(epoch, None)

    def sessions(self) -> list[PresenceEvent]:
        return list(self.held.values())

    def filters(self) -> set[str]:
        return set(self.subscribed)

    def transmit(self, client_id: str, epoch: str, packets: list[bytes], v5: bool = False) -> None:
        self.transmitted.append((client_id, epoch, packets))

    def presence(self) -> list[dict[str, object]]:
        """Presence events delivered here, in order."""
        return [json.loads(p) for t, p, _ in list(self.delivered) if t.startswith(PRESENCE)]

    def new_event(self, client_id: str, status: str = "online") -> PresenceEvent:
        self.count += 1
        epoch = epoch_of(self.worker, os.getpid(), self.count, self.node)
        event = PresenceEvent(
            status, client_id, "127.0.0.1:1", None, 0.0, time.time(), worker=self.worker, epoch=epoch, node=self.node
        )
        if status == "online":
            self.held[epoch] = event
        return event


@dataclass
class Member:
    coordinator: Coordinator
    host: RecordingHost
    scope: trio.CancelScope


@dataclass
class Cluster:
    members: list[Member]
    kill: Callable[[int], None]
    """Member i dies without a word: its link ends and its sessions are its holder's loss."""
    loss_reason: str
    drop_link: Callable[[int], None] | None = None
    """The supervisor's hub drops member i's link, as it does for a worker that stopped
    reading; returns once it has (members that share no hub have none)."""


class _HubThread:
    """The supervisor's hub and authority, polled on a thread as the supervisor does."""

    def __init__(self) -> None:
        self.authority = Authority()
        self.hub = Hub(self.authority)
        self.calls: queue.Queue[Callable[[], object]] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.hub.poll(0.005)
            while not self.calls.empty():
                self.calls.get()()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.hub.close()


async def _start(nursery: trio.Nursery, coordinator: Coordinator, host: RecordingHost) -> Member:
    """Run ``coordinator`` for ``host`` in a scope of its own, so one member can be killed."""
    scope = trio.CancelScope()

    async def run(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await coordinator.run(host, task_status=task_status)

    await nursery.start(run)
    return Member(coordinator, host, scope)


@asynccontextmanager
async def local_cluster(n: int) -> AsyncIterator[Cluster]:
    """``n`` workers of one supervisor (BusCoordinators and a real hub and authority)."""
    hub = _HubThread()
    try:
        async with trio.open_nursery() as nursery:
            members = [
                await _start(nursery, BusCoordinator(hub.hub.path, worker=i), RecordingHost(worker=i)) for i in range(n)
            ]

            def kill(i: int) -> None:
                members[i].scope.cancel()  # its link closes; it reports nothing more
                pid = os.getpid()
                # Every member shares this test's pid, so the worker is named directly.
                hub.calls.put(lambda: _lose(hub.authority, i, pid))

            def drop_link(i: int) -> None:
                dropped = threading.Event()

                def drop() -> None:
                    for link in hub.hub.links:
                        if hub.authority.worker_of(link) == i:
                            hub.hub.drop(link, overflowed=True)
                    dropped.set()

                hub.calls.put(drop)
                # Blocking on purpose: the member's own task must not see the end before
                # the test has made its next reports.
                assert dropped.wait(5), "the hub did not drop the link"

            yield Cluster(members, kill, "worker-lost", drop_link)
            nursery.cancel_scope.cancel()
    finally:
        hub.close()


@asynccontextmanager
async def redis_cluster(n: int) -> AsyncIterator[Cluster]:
    """``n`` gateways (RedisCoordinators, short leases) on a real ``redis-server``."""
    from servers.heartbeat.coordination.fleet import RedisCoordinator

    redis = RedisServer(binary=require_binary())
    redis.start()
    try:
        async with trio.open_nursery() as nursery:
            members = [
                await _start(
                    nursery,
                    RedisCoordinator(redis.url, f"gw{i}", lease=0.6, renew=0.2),
                    RecordingHost(worker=0, node=f"gw{i}"),
                )
                for i in range(n)
            ]

            def kill(i: int) -> None:
                members[i].scope.cancel()  # stops renewing its lease; the others sweep it

            yield Cluster(members, kill, "node-lost")
            nursery.cancel_scope.cancel()
    finally:
        redis.stop()


def _lose(authority: Authority, worker: int, pid: int) -> None:
    authority.worker_lost(worker, pid, f"worker {worker} killed by the test")
