"""Who subscribes to what across the fleet: this node's topic filters published for the
others, theirs read back, the persistent sessions' filters cached; and the probes
that confirm every other node routes by what this one published.

A node routes a message only to the nodes whose subscribers' filters match it, and
calls Redis for persistent sessions only if its cache of their filters matches.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import trio

from ...broker.topics import FilterIndex, TopicTree
from .keys import ROUTE_TTL_MS, TRIM_NOTICES, TRIM_ROUTES, FleetKeys
from .link import RedisLink
from .shares import SharePicker
from .values import text

__all__ = ["FilterCache", "Filters"]


class FilterCache:
    """The persistent sessions' topic filters fleet-wide, as this node last heard them.

    Exact filters sit in a set and wildcards in a tree of levels, so a publish nobody
    persistent wants costs a set lookup plus a step per level of its topic, and no
    Redis call. Kept up to date from ``pfilters-changed`` notices, each numbered
    (``version``): a gap means notices were trimmed away, and the whole set is read again.
    """

    def __init__(self) -> None:
        self._index = FilterIndex()
        self.version = 0

    @property
    def exact(self) -> set[str]:
        """The filters without wildcards."""
        return self._index.exact

    @property
    def wild(self) -> TopicTree[str]:
        """The wildcard filters (each its own value)."""
        return self._index.wild

    def __len__(self) -> int:
        return len(self._index)

    def set(self, topic_filter: str, present: bool) -> None:
        """A filter gained its first persistent session (``present``) or lost its last."""
        if present:
            self._index.add(topic_filter)
        else:
            self._index.discard(topic_filter)

    def replace(self, filters: Iterable[str], version: int) -> None:
        """The whole set, as read at notice number ``version``."""
        self._index.replace(frozenset(filters))
        self.version = version

    def matching(self, topic: str) -> list[str]:
        """The filters that match ``topic`` (a persistent session's shared subscription
        is served while it is connected, not stored for it: not among them)."""
        index = self._index
        return ([topic] if topic in index.exact else []) + index.wild.match(topic)


@dataclass
class _Probe:
    """A settle waiting for the nodes it probed to answer."""

    waiting: set[str]
    done: trio.Event


class Filters:
    """The filters this node publishes and the ones it routes by.

    ``remote`` (node -> its filters) and ``persistent`` are updated in place: the
    coordinator reads them on every publish.
    """

    def __init__(self, link: RedisLink, keys: FleetKeys, *, node: str) -> None:
        self.link = link
        self.keys = keys
        self.node = node
        self.own: set[str] = set()
        """The filters this node's subscribers hold."""
        self.dirty = True
        """``own`` is not yet in Redis as it is now."""
        self.version = 0  # bumped by each change
        self.written = 0  # the version last written to Redis
        self.remote: dict[str, FilterIndex] = {}
        """Each other node's filters, changed in place by what each of its updates changes."""
        self.persistent = FilterCache()
        """The fleet's persistent sessions' filters, as this node last heard them."""
        self.shares = SharePicker(node, self.remote)
        """Which node serves each shared subscription's messages."""
        self._changed = trio.Event()
        # Reads of the other nodes' filters are numbered as they begin, and each node's
        # entry in ``remote`` remembers the read that set it: a read answered late (the
        # renewer's full one, on another pooled connection) must not put back what a
        # read begun after it has replaced. A read begun after a node's change notice is
        # answered after the change, so the node's last notice always wins.
        self._reads = itertools.count(1)
        self._read_by: dict[str, int] = {}
        self._probes: dict[str, _Probe] = {}
        self._probe_numbers = itertools.count(1)

    def change(self, added: Collection[str], removed: Collection[str]) -> None:
        """This node's subscribers came to hold ``added`` and let go of ``removed``: to be
        published soon. Changes between two writes make one write (of the whole set)."""
        self.own.difference_update(removed)
        self.own.update(added)
        self.shares.changed(added, removed)
        self.version += 1
        self.dirty = True
        self._changed.set()

    def republish(self) -> None:
        """Publish this node's filters again at the next chance (it registered afresh)."""
        self.dirty = True

    async def next_change(self) -> None:
        """Until the filters change (at once if they changed since the last return)."""
        await self._changed.wait()
        self._changed = trio.Event()

    async def publish(self) -> bool:
        """Write this node's filters and announce them, if they changed; whether it did."""
        if not self.dirty:
            return False
        redis, call = self.link.redis(), self.link.call
        self.dirty = False
        version = self.version
        try:
            await call(redis.hset(self.keys.filters, {self.node: json.dumps(sorted(self.own))}))
            await call(redis.xadd(self.keys.changed, {"node": self.node}, **TRIM_NOTICES))
        except BaseException:
            self.dirty = True
            raise
        self.written = version
        return True

    async def refresh(self, node: str | None = None) -> None:
        """Read ``node``'s filters again (None: every node's).

        A node whose filters a read begun later has set already keeps them: the two
        reads may be answered in either order."""
        redis = self.link.redis()
        read = next(self._reads)
        if node is not None:
            raw = await self.link.call(redis.hget(self.keys.filters, node))
            self._apply(node, None if raw is None else frozenset(json.loads(raw)), read)
            return
        table = await self.link.call(redis.hgetall(self.keys.filters))
        fresh = {text(k): frozenset(json.loads(v)) for k, v in table.items()}
        for gone in self.remote.keys() - fresh.keys():
            self._apply(gone, None, read)
        for name, filters in fresh.items():
            self._apply(name, filters, read)

    def forget(self, node: str) -> None:
        """``node`` is gone (swept): route nothing to it, even if a read begun before says otherwise."""
        self._apply(node, None, next(self._reads))

    def _apply(self, node: str, filters: frozenset[str] | None, read: int) -> None:
        if self._read_by.get(node, 0) > read:
            return  # set by a read begun after this one
        self._read_by[node] = read
        if filters is None:
            self.remote.pop(node, None)
        else:
            self.remote.setdefault(node, FilterIndex()).replace(filters)

    async def persistent_notice(self, fields: Any) -> None:
        """A ``pfilters-changed`` entry: a persistent filter appeared or went."""
        cache = self.persistent
        version = int(fields.get(b"v", 0))
        if version <= cache.version:
            return  # already in what was read
        if version != cache.version + 1:
            await self.load_persistent()  # notices were trimmed away unread
            return
        cache.set(text(fields.get(b"f", b"")), fields.get(b"on") == b"1")
        cache.version = version

    async def load_persistent(self) -> None:
        """Read the fleet's persistent filters afresh (at start, after an outage, after a gap)."""
        redis, call = self.link.redis(), self.link.call
        version = int(await call(redis.get(self.keys.pfilters_version)) or 0)
        filters: list[str] = []
        cursor: int | None = 0
        while True:
            cursor, chunk = await call(redis.hscan(self.keys.pfilters, cursor, count=1000))
            filters += [text(f) for f in chunk]
            if not cursor:
                break
        self.persistent.replace(filters, version)

    async def probe(self, others: set[str]) -> None:
        """Ask ``others`` to answer once they applied all they read so far; wait for every answer."""
        token = f"{self.node}#{next(self._probe_numbers)}"
        probe = self._probes[token] = _Probe(others, trio.Event())
        try:
            fields = {"node": self.node, "probe": token}
            await self.link.call(self.link.redis().xadd(self.keys.changed, fields, **TRIM_NOTICES))
            await probe.done.wait()
        finally:
            del self._probes[token]

    def probed(self, fields: Any) -> None:
        """An answer to one of this node's probes, read from its route stream."""
        probe = self._probes.get(text(fields.get(b"probed", b"")))
        if probe is not None:
            probe.waiting.discard(text(fields.get(b"node", b"")))
            if not probe.waiting:
                probe.done.set()

    async def answer_probes(self, probes: list[tuple[str, str]]) -> None:
        """Answer other nodes' probes ((node, token) pairs) in their route streams."""
        redis = self.link.redis()
        for node, token in probes:
            key = self.keys.route_prefix + node
            await self.link.call(redis.xadd(key, {"probed": token, "node": self.node}, **TRIM_ROUTES))
            await self.link.call(redis.pexpire(key, ROUTE_TTL_MS))
