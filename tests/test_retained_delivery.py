"""Retained messages for many subscriptions at once: one task per subscribing
connection, a bounded number of reads from the store (MockClock)."""

from __future__ import annotations

from functools import partial

import trio
from trio.testing import MockClock

from servers.heartbeat.config import HeartbeatConfig
from servers.heartbeat.coordination.inprocess import InProcessCoordinator
from servers.heartbeat.coordination.retention import RetainedMessage
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.server.retained_delivery import READS_AT_ONCE
from servers.heartbeat.worker import serve_heartbeat

from .test_heartbeat import Client, engine, publish_topic

__all__ = ["engine"]  # the fixture: every test here runs on both engines

FILTERS = 400


class SlowStore(InProcessCoordinator):
    """The in-process store, each page a round trip away, as Redis's is in a fleet."""

    reading = 0
    most = 0
    pages = 0

    async def retained(self, topic_filter: str, cursor: str | None) -> tuple[list[RetainedMessage], str | None]:
        self.reading += 1
        self.most = max(self.most, self.reading)
        self.pages += 1
        try:
            await trio.sleep(0.001)
            return await super().retained(topic_filter, cursor)
        finally:
            self.reading -= 1


async def test_a_client_subscribing_to_many_filters_reads_a_few_pages_at_once(clock: MockClock, engine: str) -> None:
    # Issue 33: a thousand filters in one SUBSCRIBE started a thousand reads, each a
    # Redis call in a fleet, run by trio in one batch: 60-110 ms without a PINGRESP.
    config = HeartbeatConfig(port=0, tick=0.05, engine=engine, max_subscriptions=FILTERS)
    store = SlowStore(config.extra_sinks)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_heartbeat, config, coordinator=store))
        owner = await Client.connect(server.port, "owner")
        for i in (0, FILTERS - 1):
            await owner.send(encoders.encode_publish(f"zz/{i}/x", b"kept", retain=True))
        greedy = await Client.connect(server.port, "greedy")
        await greedy.send(encoders.encode_subscribe(1, [(f"zz/{i}/+", 0) for i in range(FILTERS)]))
        assert await greedy.read_packet() == encoders.encode_suback(1, [0] * FILTERS)
        got = sorted([publish_topic(await greedy.read_packet())[0] for _ in range(2)])
        assert got == ["zz/0/x", f"zz/{FILTERS - 1}/x"]
        assert store.pages >= FILTERS and 1 <= store.most <= READS_AT_ONCE
        nursery.cancel_scope.cancel()
