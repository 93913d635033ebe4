"""Who holds a client id, fleet-wide: the claims, offlines and losses that change a
device's record and write its presence events, what their replies mean, and the
re-claiming of the host's sessions after this node registered again.

Each is one script call, compare-and-set on the device's epoch and owner, so a resent
report or a second caller never emits twice. A claim never displaces a newer session
of the same device held elsewhere: claims from different nodes can cross on the way,
and the later accept ``time`` wins (the registry's rule).

**Resynchronisation.** When a node finds its lease gone (Redis restarted empty, or the
node was cut off longer than its lease and declared lost), it registers again,
republishes its filters and re-claims every session its host holds; if reports were
dropped, devices the registry has it holding that it no longer holds go offline
(``connection-lost``). A session the fleet ended meanwhile (``node-lost``: its end is
in the history) is not brought back: the node closes its connection (**fenced**,
counted), and the device's next connection is a new session, so every session still
ends exactly once. A re-claim that finds a newer session elsewhere evicts the
local one, stale; if Redis had lost the record of the local one (a failover to a
replica behind, a restart), the newer one displaced it without an event, and the
re-claim writes its end (``takeover``). The record keeps the last few sessions a
takeover ended (``displaced``), so none is ended twice.
"""

from __future__ import annotations

import json
import time
from typing import Any

import trio

from ...mqtt.endings import Offline
from ...presence.event import PresenceEvent
from .. import Host
from ..registry import takeover_of
from .keys import FleetKeys
from .link import RedisLink
from .metrics import FleetCounts
from .queue import ReportQueue
from .sessions import PersistentSessions
from .values import stream_id, text

__all__ = ["RESYNC_BATCH", "Claims", "event_json", "record_fields"]

RESYNC_BATCH = 256
"""Sessions re-claimed per pipeline in a resynchronisation."""


def event_json(event: PresenceEvent) -> str:
    """``event`` as the presence stream and the device record carry it."""
    return json.dumps(event.to_dict(), separators=(",", ":"))


def record_fields(event: PresenceEvent, owner: str, encoded: str) -> list[str]:
    """The device hash's fields for ``event`` (flattened name/value pairs for HSET);
    ``encoded`` is :func:`event_json`'s."""
    return [
        "status", event.status,
        "epoch", event.epoch,
        "node", event.node,
        "worker", str(event.worker),
        "peer", event.peer,
        "time", repr(event.time),  # exact: crossing claims are ordered by it
        "reason", "" if event.reason is None else event.reason.value,
        "keep_alive", str(event.keep_alive),
        "owner", owner,
        "event", encoded,
    ]  # fmt: skip


class Claims:
    """This node's changes to device records, and the presence events they wrote.

    ``emitted`` has, for each presence stream (one per shard), the id of the latest
    event this node is known to have written there: the reader has delivered
    everything once it has read each stream that far.
    """

    def __init__(
        self,
        link: RedisLink,
        keys: FleetKeys,
        counts: FleetCounts,
        *,
        node: str,
        lease: float,
        stream_maxlen: int,
        offline_ttl: float,
        once_ttl: float = 0.0,
    ) -> None:
        self.link = link
        self.scripts = link.scripts
        self.keys = keys
        self.counts = counts
        self.node = node
        self.lease = lease
        # The bound is the feed's: on Redis Cluster each shard's stream keeps its share.
        self.stream_maxlen = max(1000, stream_maxlen // len(keys.shards))
        self.offline_ttl = offline_ttl
        self.once_ttl = once_ttl
        """Seconds an offline record lives when its id had one session only (0: as long as any)."""
        self.sweep_lock_ms = str(int(max(lease * 2, 1.0) * 1000))
        """How long a sweep lock lives: a few leases, so a sweep whose sweeper died is
        resumed by the next node to take it. Each batch its holder ends renews it."""
        self.emitted: dict[str, tuple[int, int]] = {}

    def _wrote(self, stream: str, ids: Any) -> None:
        top = max(stream_id(i) for i in ids)
        if top > self.emitted.get(stream, (0, 0)):
            self.emitted[stream] = top

    def claim_request(self, event: PresenceEvent, mode: str, client: Any) -> Any:
        """The claim of ``event`` (``mode`` "claim", or "reclaim" in a resynchronisation) on
        ``client`` (a connection or a pipeline)."""
        assert event.client_id is not None
        detail = takeover_of(event, event).detail
        encoded = event_json(event)
        shard = self.keys.shard(event.client_id)
        args = [shard.prefix, self.node, event.client_id, event.epoch, encoded, str(self.stream_maxlen), mode]
        args += [detail, repr(event.time), *record_fields(event, self.node, encoded)]
        keys = [shard.dev_prefix + event.client_id, shard.stream, shard.owned]
        return self.scripts.claim(keys, args, client=client)

    def claimed(self, out: Any, client_id: str) -> bool:
        """Count the reply to ``client_id``'s claim; False if a newer session (by accept
        time) holds the device."""
        ids = list(out or [])
        stream = self.keys.shard(client_id).stream
        if ids and ids[0] == b"stale":
            if len(ids) > 1:  # a re-claimed session's end, written for it (see the script)
                self.counts.offlines += 1
                self._wrote(stream, ids[1:])
            return False
        if ids:
            self.counts.claims += 1
            self.counts.takeovers += len(ids) - 1
            self._wrote(stream, ids)
        return True

    async def claim(self, event: PresenceEvent, mode: str) -> bool:
        """Apply a claim; False if a newer session (by accept time) holds the device, or
        (a re-claim) if the session was ended meanwhile."""
        return await self.reclaim(event, mode) is None

    async def reclaim(self, event: PresenceEvent, mode: str = "reclaim") -> str | None:
        """Apply a (re-)claim; None if it holds, else why the connection must close."""
        assert event.client_id is not None
        out = await self.link.call(self.claim_request(event, mode, self.link.redis()))
        return self._outcome(out, event.client_id)

    def _outcome(self, out: Any, client_id: str) -> str | None:
        if list(out or [])[:1] == [b"ended"]:
            self.counts.fenced += 1
            return "this session was ended while its gateway could not reach redis"
        if not self.claimed(out, client_id):
            return "a newer session holds this client id"
        return None

    async def _reclaim_batch(self, events: list[PresenceEvent]) -> list[str | None]:
        """Re-claim ``events`` in one pipeline (in order); what :meth:`reclaim` says of each."""
        redis = self.link.redis()
        started = time.perf_counter()
        with trio.fail_after(self.link.timeout * 2):
            async with redis.pipeline(transaction=False) as pipe:
                requests = [self.claim_request(event, "reclaim", pipe) for event in events]
            outs = [await request for request in requests]
        self.link.ok(started)
        return [self._outcome(out, event.client_id or "") for out, event in zip(outs, events, strict=True)]

    def offline_request(self, event: PresenceEvent, forget: bool, client: Any) -> Any:
        """The end of ``event``'s session (``forget``: its record goes, a tombstone kept)."""
        assert event.client_id is not None
        ttl = self._ttls()
        tomb = str(int(max(60.0, self.lease * 10) * 1000))
        encoded = event_json(event)
        shard = self.keys.shard(event.client_id)
        args = [shard.prefix, self.node, event.client_id, event.epoch, encoded, str(self.stream_maxlen)]
        args += ["1" if forget else "0", ttl, tomb, *record_fields(event, "", encoded)]
        keys = [shard.dev_prefix + event.client_id, shard.stream, shard.owned]
        return self.scripts.offline(keys, args, client=client)

    def offline_done(self, out: Any, client_id: str) -> None:
        """Count the reply to ``client_id``'s offline (empty: the session had ended already)."""
        if out:
            self.counts.offlines += 1
            self._wrote(self.keys.shard(client_id).stream, out[:1])

    def _ttls(self) -> str:
        """The scripts' "<ttl>,<ttl seen once>" argument, in ms."""
        return f"{int(self.offline_ttl * 1000)},{int(self.once_ttl * 1000)}"

    async def lose(self, owner: str, client_ids: list[str], reason: Offline, detail: str, check_lease: bool) -> int:
        """End the online sessions of ``client_ids`` that ``owner`` holds; -1 if its lease is back.

        One call per shard the ids are in; with ``check_lease``, it stops at the first
        shard where ``owner``'s lease (or its copy there) exists again."""
        total = 0
        for shard, ids in self.keys.by_shard(client_ids):
            keys = [shard.stream, shard.owned_prefix + owner, shard.lease_prefix + owner]
            now = repr(round(time.time(), 3))
            args = [shard.prefix, self.node, owner, str(self.stream_maxlen), reason.value, detail, now]
            args += [self._ttls(), "1" if check_lease else "0", *ids]
            n = int(await self.link.call(self.scripts.lose(keys, args)))
            if n < 0:
                return -1
            if n > 0:
                if reason is Offline.NODE_LOST:
                    self.counts.node_lost += n
                else:
                    self.counts.offlines += n
                # The stream's top is at least as far as what this call added.
                last = await self.link.call(self.link.redis().xrevrange(shard.stream, "+", "-", count=1))
                if last:
                    self._wrote(shard.stream, [last[0].identifier])
            total += n
        return total

    async def owned(self, node: str) -> list[str]:
        """The client ids whose online session ``node`` holds, over every shard."""
        redis, found = self.link.redis(), []
        for shard in self.keys.shards:
            found += [text(m) for m in await self.link.call(redis.smembers(shard.owned_prefix + node))]
        return sorted(found)

    async def resynchronise(self, host: Host, queue: ReportQueue, sessions: PersistentSessions) -> None:
        """Re-claim every session ``host`` holds; with ``queue.reconcile``, end those it no longer holds."""
        # Taken before any await: reports made after this moment are queued behind,
        # so they apply after the re-claims (an offline never precedes its re-claim).
        held_now = host.sessions()
        reconcile = queue.reconcile
        queue.resync = queue.reconcile = False
        try:
            # In pipelined batches: one call at a time, 11,000 sessions of a worker took
            # minutes on a loaded machine, and its reports (takeovers) waited behind.
            held = [e for e in held_now if e.client_id is not None]
            for start in range(0, len(held), RESYNC_BATCH):
                batch = held[start : start + RESYNC_BATCH]
                for event, refused in zip(batch, await self._reclaim_batch(batch), strict=True):
                    assert event.client_id is not None
                    if refused is not None:
                        # A later session of this device is online elsewhere, or this one was
                        # declared lost meanwhile: ours is stale.
                        host.evict(event.client_id, event.epoch, refused)
                    elif sessions.attached.get(event.client_id) == event.epoch:
                        # A persistent session: attached again, or closed if Redis lost it.
                        await sessions.reattach(host, event.client_id, event.epoch)
            if reconcile:
                live = {e.client_id for e in held_now}
                # Devices with a report still queued are settled by that report (with its reason).
                live |= {r.event.client_id for r in queue.items if r.event is not None}
                gone = [c for c in await self.owned(self.node) if c not in live]
                await self.lose(self.node, gone, Offline.CONNECTION_LOST, "its offline report was dropped", False)
                # Persistent sessions whose Detach may have been dropped wait for their clients.
                live |= {r.report.client_id for r in queue.items if r.report is not None}
                held = await self.link.call(self.link.redis().smembers(self.keys.held))
                await sessions.detach_lost(self.node, sorted(c for c in map(text, held) if c not in live), False)
        except BaseException:
            queue.resync = True
            queue.reconcile = queue.reconcile or reconcile
            raise
        self.counts.resyncs += 1
