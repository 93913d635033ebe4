"""Retained messages of a fleet on Redis: stored by a script within the bounds, and
read back a page at a time with the devices' retained presence.

The store is ``retained`` and its sorted index (``lua/retain_message.lua`` keeps
both); retained presence is read from the ``dev:`` records (SCAN), offline ones older
than ``offline_ttl`` skipped. The semantics are those of :class:`~..retention.Retention`.

A stored value is a head, then the payload. The head of a message without MQTT 5
properties or expiry is its QoS digit (``0``-``2``), as it always was; otherwise it is
``a``-``c`` (the QoS), the expiry in ms of the wall clock (8 bytes, 0 for never), the
properties' length (4 bytes) and the properties. An expired message is skipped when
read and freed by the script once the store is full.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import coredis
import trio

from ....logs import OncePer, shown
from ...mqtt.filters import topic_matches
from ...mqtt.v5.outbound import expiring, message_expiry
from ...presence.event import PresenceEvent
from ..retention import (
    RETAINED_PAGE,
    RetainedMessage,
    exact_presence,
    matches_every_presence_topic,
    presence_possible,
    presence_properties,
)
from .keys import FleetKeys
from .link import RedisLink
from .metrics import FleetCounts
from .queue import Request
from .values import text

__all__ = ["FleetRetained", "glob_escape", "live_messages", "retained_head", "retained_message"]

logger = logging.getLogger("servers.heartbeat.coordination.fleet")

Page = tuple[list[RetainedMessage], str | None]


def _first_wildcard(topic_filter: str) -> int:
    cuts = [i for i in (topic_filter.find("+"), topic_filter.find("#")) if i >= 0]
    return min(cuts) if cuts else -1


def glob_escape(value: str) -> str:
    """``value`` as a literal in a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in value)


_LONG_HEAD = ord("a")


def retained_head(qos: int, properties: bytes, expires_at: float | None) -> bytes:
    """The head stored before a retained message's payload (see the module's docstring)."""
    if not properties and expires_at is None:
        return str(qos).encode()
    when = 0 if expires_at is None else int(expires_at * 1000)
    return bytes([_LONG_HEAD + qos]) + when.to_bytes(8, "big") + len(properties).to_bytes(4, "big") + properties


def retained_message(topic: str, value: bytes, now: float) -> RetainedMessage | None:
    """A stored retained value (its head, then the payload) as a message, its Message
    Expiry lowered to the time left; None if it has expired."""
    if value[0] < _LONG_HEAD:
        return RetainedMessage(topic, value[1:], value[0] - ord("0"))
    when = int.from_bytes(value[1:9], "big")
    expires_at = when / 1000 if when else None
    if expires_at is not None and expires_at <= now:
        return None
    end = 13 + int.from_bytes(value[9:13], "big")
    return RetainedMessage(topic, value[end:], value[0] - _LONG_HEAD, expiring(value[13:end], expires_at, now))


def live_messages(stored: list[tuple[str, bytes | None]], now: float) -> list[RetainedMessage]:
    """The stored values (topic, value or None for none) that are there and unexpired, as messages."""
    out: list[RetainedMessage] = []
    for topic, value in stored:
        message = None if value is None else retained_message(topic, value, now)
        if message is not None:
            out.append(message)
    return out


class FleetRetained:
    """How retained messages are stored, and read back with retained presence, a page at a time.

    Cursors are strings, as :class:`~..retention.Retention`'s: ``s:<topic>`` continues the
    retained store after that topic (its index is sorted), ``p:<n>`` continues a SCAN of
    the device records at SCAN cursor ``n`` (a SCAN may return a device twice when Redis
    rehashes meanwhile; a subscriber then gets its presence twice, which MQTT allows).
    """

    def __init__(
        self,
        link: RedisLink,
        keys: FleetKeys,
        counts: FleetCounts,
        *,
        presence_prefix: str,
        presence: bool,
        offline_ttl: float | None,
        max_bytes: int,
        max_count: int,
        max_owner_count: int,
        max_owner_bytes: int,
        page: int = RETAINED_PAGE,
    ) -> None:
        self.link = link
        self.counts = counts
        self.prefix = keys.prefix
        self.keys = keys
        self.presence_prefix = presence_prefix
        self.presence = presence
        self.offline_ttl = offline_ttl
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.max_owner_count = max_owner_count
        self.max_owner_bytes = max_owner_bytes
        self._logged = OncePer()
        self.page = page
        self.k_retained = keys.retained
        self.k_index = keys.retained_index

    # ------------------------------------------------------------------ store

    def request(
        self, topic: str, payload: bytes, qos: int, owner: str, client: Any, properties: bytes = b""
    ) -> Request:
        """The script call that keeps (or, with an empty payload, clears) ``topic``'s message
        from client ``owner`` (with an MQTT 5 publisher's ``properties``, whose Message
        Expiry ends its retention), and what to do with its reply."""
        now = time.time()
        expiry = message_expiry(properties) if properties else None
        expires_at = None if expiry is None else now + expiry
        args: list[str | bytes] = [
            *(self.prefix, topic, payload, retained_head(qos, properties, expires_at)),
            *(str(self.max_bytes), str(self.max_count), owner, str(self.max_owner_count), str(self.max_owner_bytes)),
            *("" if expires_at is None else str(int(expires_at * 1000)), str(int(now * 1000))),
        ]

        def done(out: Any) -> None:
            if int(out) == 0:
                self.counts.retained_refused += 1
                if self._logged.due(owner, time.monotonic()):
                    logger.warning(
                        "node %s: retained message on %s from %s refused: the store is full, or the client's"
                        " share is; the topic keeps its message; more are counted, not logged",
                        self.link.node,
                        shown(topic),
                        shown(owner),
                    )

        # The key names the hub's slot, which routes the call on Redis Cluster.
        return self.link.scripts.retain([self.k_retained], args, client=client), done

    # ------------------------------------------------------------------- read

    async def read(self, topic_filter: str, cursor: str | None) -> Page:
        """The page of retained messages, then of retained presence, ``topic_filter``
        matches after ``cursor`` (None: from the start), and the cursor of the rest."""
        if cursor is None or cursor.startswith("s:"):
            out, rest = await self._store_page(topic_filter, None if cursor is None else cursor[2:])
            if rest is not None or not self.presence_possible(topic_filter):
                return out, rest
            exact = self.exact_presence(topic_filter)
            if exact is not None:
                record = self.link.redis().hmget(self.keys.shard(exact).dev_prefix + exact, ["status", "event"])
                status, raw = await self.link.call(record)
                message = self.presence_message(exact, status, raw, time.time())
                return out + ([message] if message is not None else []), None
            return out, "p:0:0"
        shard, _, scan_cursor = cursor[2:].partition(":")
        if not cursor.startswith("p:") or not shard.isdigit() or not scan_cursor.isdigit():
            return [], None
        if int(shard) >= len(self.keys.shards):
            return [], None
        return await self._presence_scan(topic_filter, int(shard), int(scan_cursor))

    async def _store_page(self, topic_filter: str, after: str | None) -> Page:
        redis, call = self.link.redis(), self.link.call
        stored: list[tuple[str, bytes | None]] = []
        if "+" not in topic_filter and "#" not in topic_filter:
            if after is None:
                stored.append((topic_filter, await call(redis.hget(self.k_retained, topic_filter))))
            return live_messages(stored, time.time()), None
        low, high, parent = self.store_range(topic_filter, after)
        if parent is not None and after is None:
            stored.append((parent, await call(redis.hget(self.k_retained, parent))))
        found = await call(
            redis.zrange(self.k_index, low, high, sortby=coredis.PureToken.BYLEX, offset=0, count=self.page + 1)
        )
        walked = [text(t) for t in found]
        page = walked[: self.page]
        matched = [t for t in page if topic_matches(topic_filter, t)]
        if matched:
            stored += zip(matched, await call(redis.hmget(self.k_retained, matched)), strict=True)
        return live_messages(stored, time.time()), ("s:" + page[-1] if len(walked) > self.page else None)

    async def _presence_scan(self, topic_filter: str, shard: int, scan_cursor: int) -> Page:
        """A page of the device records of one shard (SCAN, on the server serving it)."""
        redis = self.link.redis()
        scan = redis.scan(scan_cursor, match=self.scan_pattern(topic_filter, shard), count=self.page)
        if self.keys.sharded:
            scan = scan.route(self.keys.shards[shard].stream)
        scan_cursor, keys = await self.link.call(scan)
        records: list[Any] = []
        if keys:
            async with redis.pipeline(transaction=False) as pipe:
                requests = [pipe.hmget(k, ["status", "event"]) for k in keys]
            with trio.fail_after(self.link.timeout):
                records = [await r for r in requests]
        out = self.presence_page(topic_filter, keys, records, shard)
        if scan_cursor:
            return out, f"p:{shard}:{scan_cursor}"
        return out, (f"p:{shard + 1}:0" if shard + 1 < len(self.keys.shards) else None)

    # ------------------------------------------------------------------ pure

    def store_range(self, topic_filter: str, after: str | None) -> tuple[bytes, bytes, str | None]:
        """ZRANGEBYLEX bounds of the topics ``topic_filter`` may match after ``after``, and
        the parent topic a trailing ``/#`` also matches (to look up on the first page)."""
        cut = _first_wildcard(topic_filter)
        head = topic_filter[:cut]
        parent = head[:-1] if cut == len(topic_filter) - 1 and topic_filter.endswith("/#") else None
        low = b"[" + head.encode() if after is None or after < head else b"(" + after.encode()
        # No UTF-8 string holds 0xff, so every topic that starts with ``head`` sorts before this.
        high = b"(" + head.encode() + b"\xff" if head else b"+"
        return (b"-" if after is None and not head else low), high, parent

    def presence_possible(self, topic_filter: str) -> bool:
        """Whether ``topic_filter`` may match a presence topic (and presence is retained)."""
        return self.presence and presence_possible(topic_filter, self.presence_prefix)

    def exact_presence(self, topic_filter: str) -> str | None:
        """The client id ``topic_filter`` names if it is one presence topic, else None."""
        return exact_presence(topic_filter, self.presence_prefix)

    def scan_pattern(self, topic_filter: str, shard: int = 0) -> str:
        """The SCAN MATCH pattern of the device records in ``shard`` whose presence
        ``topic_filter`` may match."""
        head = ""
        prefix = self.presence_prefix
        if topic_filter.startswith(prefix):
            rest = topic_filter[len(prefix) :]
            cut = _first_wildcard(rest)
            head = rest if cut < 0 else rest[:cut]
        return glob_escape(self.keys.shards[shard].dev_prefix + head) + "*"

    def presence_message(self, client_id: str, status: Any, raw: Any, now: float) -> RetainedMessage | None:
        """A device record's retained presence (None: forgotten, or offline past the TTL)."""
        if raw is None or text(status or b"") == "forgotten":
            return None
        try:
            event = PresenceEvent.from_dict(json.loads(raw))
        except (ValueError, TypeError, KeyError):
            return None
        ttl = self.offline_ttl
        if event.status == "offline" and ttl is not None and event.time + ttl <= now:
            return None
        return RetainedMessage(
            self.presence_prefix + client_id, event.payload(), 0, presence_properties(event, ttl, now)
        )

    def presence_page(
        self, topic_filter: str, keys: Sequence[bytes], records: Sequence[Sequence[Any]], shard: int = 0
    ) -> list[RetainedMessage]:
        """The retained presence among SCAN's ``keys`` of ``shard`` (with their status and
        event fields)."""
        out: list[RetainedMessage] = []
        strip = len(self.keys.shards[shard].dev_prefix)
        everything = matches_every_presence_topic(topic_filter, self.presence_prefix)
        now = time.time()
        for key, (status, raw) in zip(keys, records, strict=True):
            client_id = text(key)[strip:]
            if everything or topic_matches(topic_filter, self.presence_prefix + client_id):
                message = self.presence_message(client_id, status, raw, now)
                if message is not None:
                    out.append(message)
        return out
