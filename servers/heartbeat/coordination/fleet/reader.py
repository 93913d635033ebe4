"""Reading a fleet node's streams: every presence event, routed message, session packet
and filters notice, in order, once each, with one blocking XREAD.

**The presence stream** ``<prefix>presence`` is the fleet's presence feed. Each entry
has the fields ``event`` (the event's JSON, as :meth:`PresenceEvent.to_dict`),
``origin`` (the node that emitted it), ``evict`` (for a takeover: the node that must
close the displaced session, else empty) and, on an online a gateway's re-claim wrote
again because the store had lost the session, ``reclaim`` (``1``). A reader passes
over a session's second online or second end (a failover's: the old primary took the
first unreplicated, and this node had read it), so subscribers and logs have each once.
Every node reads the whole stream with ``XREAD`` and delivers each event to its own
MQTT subscribers; external consumers read it with a consumer group of their own
(``XGROUP CREATE idlekeeper:presence mine $ MKSTREAM``, then ``XREADGROUP``).
Telling the previous owner of a taken-over session through the same stream (rather
than a Pub/Sub message) means the eviction is never lost by a node that was briefly
disconnected, and it is ordered with the events its subscribers see. The same goes
for routed messages: a node reads the presence stream, its own route stream and the
filters notices in one blocking ``XREAD``.

On Redis Cluster there is a presence stream per shard (:mod:`.shards`), in its own
slot, and one ``XREAD`` may only name keys of one slot: a task reads each shard's
stream, and another the hub's streams. Each device's events are in one shard, so
they are still read in order; events of devices in different shards have no order
between them, as they had none before they were written. A shard's task that read
something waits ``READ_WINDOW_PER_SHARD`` times the shards before it reads again, as
Kafka's ``fetch.max.wait.ms`` does: one stream wakes a blocked reader per event, and
with many streams busy the calls, not the events, took most of a gateway's CPU
(py-spy: 40 % in a 30,000-device run); waiting lets events gather into one read.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import trio

from ...mqtt.publication import Publication
from ...presence.event import PresenceEvent, PresenceSink
from .. import Host, publish_to_sinks
from ..retention import live_presence, presence_properties
from .filters import Filters
from .keys import FleetKeys
from .link import RedisLink
from .metrics import FleetCounts
from .routes import decode_route
from .values import as_bytes, stream_id, text

__all__ = ["ENDS_REMEMBERED", "READ_WINDOW_PER_SHARD", "STARTS_REMEMBERED", "StreamReader"]

READ_WINDOW_PER_SHARD = 0.001
"""Seconds a busy shard's reader waits before reading again, per shard: with 16 shards,
16 ms, which bounds its calls to ~1,000 a second whatever the event rate."""
ENDS_REMEMBERED = 16_384
"""Session ends a reader remembers, to pass over a second one: a failover's gap is the
last second or so of writes, far fewer ends than this at any rate a node can read."""
STARTS_REMEMBERED = 16_384
"""Session starts (online events) a reader remembers, likewise: an online re-written
after a failover is one the old primary took in its last moments, unreplicated."""

logger = logging.getLogger("servers.heartbeat.coordination.fleet")


class StreamReader:
    """The reader tasks, and how far each presence stream was read (``read_pos``)."""

    def __init__(
        self,
        link: RedisLink,
        keys: FleetKeys,
        counts: FleetCounts,
        filters: Filters,
        *,
        node: str,
        sinks: Sequence[PresenceSink],
        seen: PresenceSink | None = None,
        presence_prefix: str,
        offline_ttl: float | None = None,
        retain_presence: bool = True,
        moved_on: Callable[[], None],
    ) -> None:
        self.link = link
        self.counts = counts
        self.filters = filters
        self.node = node
        self.sinks = sinks
        self.seen = seen
        """Told of every event read, whichever node's (the operator's page keeps the latest)."""
        self.presence_prefix = presence_prefix
        self.offline_ttl = offline_ttl
        """How long offline presence is retained: the Message Expiry its events carry."""
        self.retain_presence = retain_presence
        """Whether presence is retained: the retain flag its live events carry."""
        self.moved_on = moved_on
        self.presence_streams = {shard.stream for shard in keys.shards}
        self.keys = keys
        self.k_routes = keys.routes
        self.k_changed = keys.changed
        self.k_pchanged = keys.pchanged
        self.ready = trio.Event()
        """Set once every stream's position was first taken: what this node emits after is read back."""
        self.read_pos: dict[str, tuple[int, int]] = {}
        """How far each presence stream was read."""
        self.ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        """The sessions whose end was read lately (client id, epoch), newest last."""
        self.started: OrderedDict[tuple[str, str], None] = OrderedDict()
        """The sessions whose online event was read lately and whose end was not (client
        id, epoch), newest last."""

    def groups(self) -> list[list[str]]:
        """The streams each task reads with one ``XREAD``: the first holds the hub's."""
        hub = [self.k_routes, self.k_changed, self.k_pchanged]
        if not self.keys.sharded:
            return [[self.keys.shards[0].stream, *hub]]
        return [hub, *([shard.stream] for shard in self.keys.shards)]

    def caught_up(self, emitted: dict[str, tuple[int, int]]) -> bool:
        """Whether every presence stream was read as far as ``emitted`` says."""
        return all(self.read_pos.get(stream, (0, 0)) >= top for stream, top in emitted.items())

    async def run(self, host: Host) -> None:
        """Deliver to ``host`` everything read, until cancelled, retrying after failures."""
        groups = self.groups()
        positioned = [trio.Event() for _ in groups]
        async with trio.open_nursery() as nursery:
            for group, done in zip(groups, positioned, strict=True):
                nursery.start_soon(self._read, host, group, done)
            for done in positioned:
                await done.wait()
            self.ready.set()

    async def _read(self, host: Host, keys: list[str], first_positioned: trio.Event) -> None:
        """Read the streams ``keys`` (one slot's) until cancelled, retrying after failures."""
        positioned = False
        attempt = 0
        block_ms = max(100, int(self.link.renew * 1000))
        positions = dict.fromkeys(keys, (0, 0))
        shards = len(self.keys.shards)
        window = READ_WINDOW_PER_SHARD * shards if self.keys.sharded and keys[0] in self.presence_streams else 0.0
        while True:
            try:
                redis = self.link.redis()
                if not positioned:
                    await self._position(positions, first_positioned.is_set())
                    positioned = True
                    first_positioned.set()
                asked = {key: f"{ms}-{seq}" for key, (ms, seq) in positions.items()}
                with trio.fail_after(self.link.timeout + block_ms / 1000):
                    res = await redis.xread(asked, count=1000, block=block_ms)
                attempt = 0
                probes = await self._apply(host, res or {}, positions)
                # Answered once all of the read is applied, whichever stream held it.
                await self.filters.answer_probes(probes)
                self.moved_on()
                if res and window:
                    await trio.sleep(window)
            except (Exception, trio.TooSlowError) as exc:
                positioned = False
                attempt += 1
                await self.link.failed_attempt(exc, attempt)

    async def _position(self, positions: dict[str, tuple[int, int]], before: bool) -> None:
        """Where to read from: the streams' tops at the start; after an outage (``before``:
        positioned once already), where reading stopped, unless Redis came back without
        what was read."""
        redis = self.link.redis()
        for key in positions:
            last = await self.link.call(redis.xrevrange(key, "+", "-", count=1))
            top = stream_id(last[0].identifier) if last else None
            if not before:
                positions[key] = top or (0, 0)
            elif top is not None and top < positions[key] and self._read_already(key, last[0].field_values):
                # A replica promoted (or a restart from a snapshot) without the old
                # primary's last writes: its stream is a first part of what was read, so
                # what comes after its top is new. Read from 0, every session in it
                # would be announced again to this node's subscribers and log.
                positions[key] = top
            elif top is None or top < positions[key]:
                # The stream is gone or younger than what was read: Redis came
                # back empty. Everything in the new stream is new to us.
                positions[key] = (0, 0)
            if key in self.presence_streams:
                self.read_pos[key] = positions[key]
        if self.k_changed in positions:
            # After the positions, as below: a node's filters written before are read here,
            # those written after are announced in what is read next. The renewer reads
            # them too, but may have read them before the positions were taken.
            await self.filters.refresh()
        if self.k_pchanged in positions:
            # After the positions: a change made meanwhile is in both, applied twice, harmlessly.
            await self.filters.load_persistent()

    async def _apply(
        self, host: Host, res: dict[Any, Any], positions: dict[str, tuple[int, int]]
    ) -> list[tuple[str, str]]:
        """Deliver what one XREAD returned; the probes it holds, to answer."""
        filters = self.filters
        probes: list[tuple[str, str]] = []
        for raw_key, entries in res.items():
            key = text(raw_key)
            for entry in entries:
                positions[key] = stream_id(entry.identifier)
                if key in self.presence_streams:
                    self.read_pos[key] = positions[key]
                    self._handle_entry(host, entry.field_values)
                elif key == self.k_routes:
                    if b"c" in entry.field_values:
                        self._transmit(host, entry.field_values)
                    elif b"probed" in entry.field_values:
                        filters.probed(entry.field_values)
                    else:
                        self._deliver_routed(host, as_bytes(entry.field_values.get(b"m", b"")))
                elif key == self.k_pchanged:
                    await filters.persistent_notice(entry.field_values)
                else:
                    node = text(entry.field_values.get(b"node", b""))
                    probe = entry.field_values.get(b"probe")
                    if probe is not None:
                        if node and node != self.node:
                            probes.append((node, text(probe)))
                    elif node and node != self.node:
                        await filters.refresh(node)
        return probes

    def _handle_entry(self, host: Host, fields: Any) -> None:
        try:
            event = PresenceEvent.from_dict(json.loads(fields[b"event"]))
        except (KeyError, ValueError, TypeError):
            logger.exception("node %s: unreadable presence stream entry %r", self.node, fields)
            return
        reclaimed = fields.get(b"reclaim") == b"1"
        if event.client_id is not None and self._read_before(event.client_id, event.epoch, event.status, reclaimed):
            # A session starts once and ends once. A second copy is a failover's: the old
            # primary took the first in its last moments and this node read it, the new
            # primary never had it, and the gateway's re-claim (an online) or reconcile
            # (an end) wrote it again for the fleet. Subscribers and the log had it.
            if event.status == "offline":
                self.counts.repeated_ends += 1
            else:
                self.counts.repeated_onlines += 1
            return
        self.counts.delivered += 1
        if self.seen is not None:
            self.seen(event)
        origin = text(fields.get(b"origin", b""))
        evict = text(fields.get(b"evict", b""))
        if evict == self.node and event.client_id is not None:
            try:
                host.evict(event.client_id, event.epoch, event.detail or "reconnected")
            except Exception:
                logger.exception("node %s: evict raised", self.node)
        if origin == self.node:
            publish_to_sinks(self.sinks, event)
        if event.client_id is not None:
            try:
                topic = self.presence_prefix + event.client_id
                # Every node reads every event: each serves the shared subscriptions it owns for it.
                groups = self.filters.shares.owned(topic, f"{event.epoch}\0{event.status}")
                properties = presence_properties(event, self.offline_ttl, time.time())
                host.deliver(live_presence(topic, event, properties, self.retain_presence), groups=groups)
            except Exception:
                logger.exception("node %s: deliver raised", self.node)

    def _read_before(self, client_id: str, epoch: str, status: str, reclaimed: bool) -> bool:
        """Whether session ``epoch``'s online (or, ``status`` "offline", its end) was read
        already; notes it if not. An online written by a re-claim (``reclaimed``: the
        store had lost the session) that this reader does not remember is delivered, and
        counted: it was forgotten (a fleet of more sessions than :data:`STARTS_REMEMBERED`
        starting meanwhile, or this gateway restarted), or never read."""
        key = (client_id, epoch)
        if status == "offline":
            self.started.pop(key, None)  # its end is remembered instead, longer
            if key in self.ended:
                return True
            self.ended[key] = None
            if len(self.ended) > ENDS_REMEMBERED:
                self.ended.popitem(last=False)
            return False
        if key in self.started or key in self.ended:
            return True
        if reclaimed:
            self.counts.reclaimed_onlines += 1
        self.started[key] = None
        if len(self.started) > STARTS_REMEMBERED:
            self.started.popitem(last=False)
        return False

    def _read_already(self, stream: str, fields: Any) -> bool:
        """Whether the entry ``fields`` of presence stream ``stream`` is one this reader
        read (its session's online or end is remembered), without noting it."""
        if stream not in self.presence_streams:
            return False
        try:
            event = json.loads(fields[b"event"])
            key = (str(event["client_id"]), str(event["epoch"]))
        except (KeyError, ValueError, TypeError):
            return False
        return key in self.ended or (event.get("status") != "offline" and key in self.started)

    def _transmit(self, host: Host, fields: Any) -> None:
        """A persistent session's packets for the connection this node holds (if it still does)."""
        try:
            client_id, epoch, packets = text(fields[b"c"]), text(fields[b"e"]), as_bytes(fields[b"p"])
        except KeyError:
            logger.warning("node %s: malformed session packets", self.node)
            return
        v5 = fields.get(b"v") == b"1"  # written for MQTT 5.0 (absent from an older node: 3.1.1)
        try:
            host.transmit(client_id, epoch, [packets], v5)
        except Exception:
            logger.exception("node %s: transmit raised", self.node)

    def _deliver_routed(self, host: Host, data: bytes) -> None:
        try:
            message = decode_route(data)
        except ValueError:
            logger.warning("node %s: malformed routed message", self.node)
            return
        try:
            group = message.group
            groups = (group,) if group else ()
            m = message
            host.deliver(Publication(m.topic, m.payload, m.qos, m.retain, m.properties), groups, plain=not group)
        except Exception:
            logger.exception("node %s: deliver raised", self.node)
