"""Retained messages (MQTT 3.1.1, 3.3.1.3): the last RETAIN=1 message of each topic,
sent to every new subscription whose filter matches the topic.

Pure (no I/O, no clock: ``now`` is passed in, on whatever clock the caller uses for
``expires_at``). :func:`~servers.heartbeat.mqtt.filters.topic_matches` decides what a
filter matches, so retained delivery follows the same rules as live routing,
``$``-topics included.

Lookups. The messages sit in a dict by topic, so an exact filter (a device asking for
its own last state) is one dict lookup. Beside it, every topic is kept in code-point
order in blocks of sorted lists. A wildcard filter can only match topics that start
with its literal head (``sensors/`` for ``sensors/+``, ``devices/42/`` for
``devices/42/#``), and in sorted order those are one contiguous run found by
bisection, so only that run is walked; ``#`` and ``+/...`` have no head and walk
everything, as they must.

Slices. A server must not stop its event loop to send a million retained messages.
:meth:`RetainedStore.matching` takes ``after`` (a topic) and ``limit`` and returns
matches in topic order, so ``after=batch[-1].topic`` continues where a batch ended,
however the store changed in between. :meth:`RetainedStore.page` bounds the entries
*examined* instead of those returned, for sparse filters such as ``+/status`` where
a million topics might be walked to find a few.

Bounds. ``max_count`` messages and ``max_bytes`` of topic (UTF-8) plus payload in
all, and for each *owner* (the client, or its user, whose PUBLISH put a message
there) ``max_owner_count`` and ``max_owner_bytes``, so that no one client can fill
the store for everyone. A store that would pass any of them is refused and counted in
``refused`` (``refused_quota`` for an owner's share); one that replaces a message of
its own owner with one no larger always succeeds. A refused store leaves the topic's
retained message as it was: dropping it, as this store did and as MQTT-3.3.1-7 reads
for a QoS 0 message (the previous one is discarded, the new one kept "at the server's
discretion"), let a client that had filled the store erase other clients' values by
making their next updates fail (issue 33). Clearing (an empty payload) always works.

Expiry. A message may carry ``expires_at``; from then on it is never returned, and
:meth:`RetainedStore.prune` frees it. A heap of ``(expires_at, topic)`` finds them in
order; replacing or clearing a topic leaves its old heap item behind rather than
searching the heap for it, and a stale item is skipped when it surfaces (the heap is
rebuilt once stale items outnumber live ones by more than a thousand).

Memory. One :class:`Retained` (six slots, 80 bytes) per topic, sharing its
topic string with the dict key, the sorted index and the heap. Measured with
tracemalloc on CPython 3.11 (``tests/test_mqtt_retained.py``) for a 60-byte topic and
a 200-byte payload: 435 to 449 bytes per entry in all, depending on where the dict is
in its growth; 342 of them are the topic and payload objects themselves, so the
store's own cost is 93 to 107. That is three allocations per entry (topic, payload,
entry) plus the amortized dict and index. An expiry adds 88 bytes and two allocations
(the float and its heap tuple).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

from ..mqtt.filters import topic_matches

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_COUNT",
    "DEFAULT_MAX_OWNER_BYTES",
    "DEFAULT_MAX_OWNER_COUNT",
    "Page",
    "Retained",
    "RetainedStore",
]

DEFAULT_MAX_COUNT = 2_000_000
"""Retained messages held at most unless told otherwise (a million devices' presence, twice over)."""
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
"""Topic plus payload bytes held at most unless told otherwise."""
DEFAULT_MAX_OWNER_COUNT = 10_000
"""Retained messages one owner (a client, or its user) may hold unless told otherwise."""
DEFAULT_MAX_OWNER_BYTES = 16 * 1024 * 1024
"""Topic plus payload bytes one owner may hold unless told otherwise."""

# Keys per block of the sorted index: an insert or removal moves at most 2 * _CHUNK
# pointers, yet a million topics still make only a few thousand blocks to bisect.
_CHUNK = 512
# A store that does not fit first frees this many expired messages at most, so a full
# store of stale presence does not refuse fresh messages, and one store stays cheap.
_PRUNE_ON_FULL = 256
# Stale heap items tolerated beyond the live ones before the heap is rebuilt.
_HEAP_SLACK = 1024


@dataclass(frozen=True, slots=True)
class Retained:
    """One retained message: deliver it with RETAIN=1 at ``min(qos, granted qos)``.

    ``expires_at`` is on the store's clock; ``None`` means it never expires.
    ``owner`` is whose share it counts against ("": nobody's). ``properties`` are an
    MQTT 5 publisher's, packed as they reach subscribers (empty for a 3.1.1 one's).
    """

    topic: str
    payload: bytes
    qos: int
    expires_at: float | None = None
    owner: str = ""
    properties: bytes = b""

    def expired(self, now: float) -> bool:
        """Whether the message has expired at ``now`` (expiry is inclusive)."""
        return self.expires_at is not None and self.expires_at <= now


class Page(NamedTuple):
    """One slice of a walk by :meth:`RetainedStore.page`."""

    messages: list[Retained]
    """The matching messages found in this slice, in topic order."""
    cursor: str | None
    """Pass as ``after=`` to continue; ``None`` once the walk is complete."""


def _size(topic: str, payload: bytes, properties: bytes = b"") -> int:
    # Counted as on the wire; almost every topic is ASCII, which skips the encode.
    return (len(topic) if topic.isascii() else len(topic.encode())) + len(payload) + len(properties)


def _first_wildcard(topic_filter: str) -> int:
    plus = topic_filter.find("+")
    hash_ = topic_filter.find("#")
    if plus < 0:
        return hash_
    return plus if hash_ < 0 else min(plus, hash_)


class _SortedTopics:
    """Topics in code-point order, as a list of sorted blocks of ``chunk`` to ``2 * chunk``.

    One flat sorted list would make every insert a memmove of the whole index (8 MB
    at a million topics); blocks bound it to one block while a prefix stays one
    contiguous run. The caller guarantees a topic is added once and removed only if present.
    """

    __slots__ = ("_blocks", "_maxes", "_chunk")

    def __init__(self, chunk: int = _CHUNK) -> None:
        self._blocks: list[list[str]] = []
        self._maxes: list[str] = []
        self._chunk = chunk

    def __iter__(self) -> Iterator[str]:
        for block in self._blocks:
            yield from block

    def add(self, topic: str) -> None:
        """Insert ``topic`` (not already present)."""
        blocks, maxes = self._blocks, self._maxes
        if not maxes:
            blocks.append([topic])
            maxes.append(topic)
            return
        i = bisect_left(maxes, topic)
        if i == len(maxes):
            i -= 1
            block = blocks[i]
            block.append(topic)
            maxes[i] = topic
        else:
            block = blocks[i]
            insort(block, topic)
        if len(block) > 2 * self._chunk:
            self._split(i)

    def remove(self, topic: str) -> None:
        """Remove ``topic`` (present)."""
        blocks, maxes = self._blocks, self._maxes
        i = bisect_left(maxes, topic)
        block = blocks[i]
        del block[bisect_left(block, topic)]
        if not block:
            del blocks[i], maxes[i]
            return
        maxes[i] = block[-1]
        if len(block) < self._chunk // 2 and len(blocks) > 1:
            # Mass removals (an expired fleet) would otherwise leave thousands of
            # near-empty blocks to bisect and iterate.
            j = i if i + 1 < len(blocks) else i - 1
            blocks[j : j + 2] = [blocks[j] + blocks[j + 1]]
            maxes[j : j + 2] = [blocks[j][-1]]
            if len(blocks[j]) > 2 * self._chunk:
                self._split(j)

    def _split(self, i: int) -> None:
        block = self._blocks[i]
        half = len(block) // 2
        self._blocks[i : i + 1] = [block[:half], block[half:]]
        self._maxes[i : i + 1] = [block[half - 1], block[-1]]

    def since(self, start: str, inclusive: bool) -> Iterator[str]:
        """Topics from ``start`` on (``>= start`` if ``inclusive``, else ``> start``), in order.

        Not safe across a change to the index: consume it before the next add or remove.
        """
        find = bisect_left if inclusive else bisect_right
        i = find(self._maxes, start)
        if i == len(self._maxes):
            return
        blocks = self._blocks
        yield from islice(blocks[i], find(blocks[i], start), None)
        for block in islice(blocks, i + 1, None):
            yield from block


class RetainedStore:
    """The server's retained messages: stored on PUBLISH with RETAIN=1, found on SUBSCRIBE.

    ``count`` and ``bytes`` are what is held, including expired messages not yet
    pruned; ``refused`` counts stores turned away by a bound, ``refused_quota`` those
    turned away by their owner's share.
    """

    __slots__ = (
        "max_count",
        "max_bytes",
        "max_owner_count",
        "max_owner_bytes",
        "refused",
        "refused_quota",
        "_entries",
        "_topics",
        "_expiry",
        "_expiring",
        "_bytes",
        "_owners",
    )

    def __init__(
        self,
        *,
        max_count: int = DEFAULT_MAX_COUNT,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_owner_count: int = DEFAULT_MAX_OWNER_COUNT,
        max_owner_bytes: int = DEFAULT_MAX_OWNER_BYTES,
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.max_owner_count = max_owner_count
        self.max_owner_bytes = max_owner_bytes
        self.refused = 0
        self.refused_quota = 0
        self._entries: dict[str, Retained] = {}
        self._topics = _SortedTopics()
        self._expiry: list[tuple[float, str]] = []
        self._expiring = 0  # live entries with an expiry: each has exactly one valid heap item
        self._bytes = 0
        self._owners: dict[str, list[int]] = {}  # owner -> [messages, bytes]

    @property
    def count(self) -> int:
        """Retained messages held."""
        return len(self._entries)

    def store(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        now: float,
        expires_at: float | None = None,
        owner: str = "",
        properties: bytes = b"",
    ) -> bool:
        """Apply a PUBLISH with RETAIN=1 from ``owner``: replace the topic's retained message.

        An empty payload clears the topic and stores nothing (MQTT-3.3.1-10/11), as does
        an ``expires_at`` already reached. Returns False if the message would pass
        ``max_count`` or ``max_bytes`` even after freeing some expired messages, or
        ``owner``'s share; the topic then keeps the message it had. Replacing one's own
        message with one no larger always succeeds.
        """
        old = self._entries.get(topic)
        if not payload or (expires_at is not None and expires_at <= now):
            if old is not None:
                self._drop(topic, old)
            return True
        size = _size(topic, payload, properties)
        if not self._fits(topic, size, old):
            self.prune(now, _PRUNE_ON_FULL)
            old = self._entries.get(topic)
            if not self._fits(topic, size, old):
                self.refused += 1
                return False
        if owner and not self._owner_fits(owner, size, old):
            self.refused += 1
            self.refused_quota += 1
            return False
        if old is None:
            self._topics.add(topic)
        else:
            # Keep the string the dict, the index and the heap already hold: a
            # replacement's equal topic is another object, and a copy per entry.
            topic = old.topic
            old_size = _size(topic, old.payload, old.properties)
            self._bytes -= old_size
            self._charge(old.owner, -1, -old_size)
            if old.expires_at is not None:
                self._expiring -= 1
        self._entries[topic] = Retained(topic, payload, qos, expires_at, owner, properties)
        self._charge(owner, 1, size)
        self._bytes += size
        if expires_at is not None:
            self._expiring += 1
            heapq.heappush(self._expiry, (expires_at, topic))
            if len(self._expiry) > 2 * self._expiring + _HEAP_SLACK:
                self._compact()
        return True

    def get(self, topic: str, now: float) -> Retained | None:
        """The retained message of ``topic``, unless there is none or it has expired."""
        entry = self._entries.get(topic)
        if entry is None or entry.expired(now):
            return None
        return entry

    def matching(
        self, topic_filter: str, now: float, *, after: str | None = None, limit: int | None = None
    ) -> list[Retained]:
        """Unexpired retained messages whose topic matches ``topic_filter``, in topic order.

        Topic order is code-point order of the topic string. Only topics greater than
        ``after`` are considered and at most ``limit`` are returned, so a caller sends a
        large result in slices: repeat with ``after=result[-1].topic`` until fewer than
        ``limit`` come back. Costs a dict lookup for an exact filter, else a walk of
        the topics that start with the filter's literal head (all of them for ``#``).
        """
        out: list[Retained] = []
        if limit is not None and limit <= 0:
            return out
        for _, entry in self._walk(topic_filter, now, after):
            if entry is not None:
                out.append(entry)
                if len(out) == limit:
                    break
        return out

    def page(self, topic_filter: str, now: float, *, after: str | None = None, budget: int = 1000) -> Page:
        """Like :meth:`matching` but examining at most ``budget`` stored topics per call
        (and one more, to tell whether the walk is over).

        For filters whose walk is long but whose matches are few (``+/status``), where
        even a small ``limit`` could walk everything in one call. Repeat with
        ``after=page.cursor`` until the cursor is None.
        """
        if budget <= 0:
            raise ValueError("budget must be positive")
        messages: list[Retained] = []
        cursor: str | None = None
        walk = self._walk(topic_filter, now, after)
        for topic, entry in islice(walk, budget):
            cursor = topic
            if entry is not None:
                messages.append(entry)
        if next(walk, None) is None:
            return Page(messages, None)
        return Page(messages, cursor)

    def prune(self, now: float, limit: int | None = None) -> int:
        """Remove expired messages, at most ``limit``; returns how many were removed."""
        heap, entries = self._expiry, self._entries
        removed = 0
        while heap and heap[0][0] <= now and (limit is None or removed < limit):
            _, topic = heapq.heappop(heap)
            entry = entries.get(topic)
            # The item may be stale (the topic was replaced since), but an entry that
            # has expired goes whichever item found it; its own item is stale after.
            if entry is not None and entry.expired(now):
                self._drop(topic, entry)
                removed += 1
        return removed

    @property
    def bytes(self) -> int:
        """Topic (UTF-8) plus payload bytes held, as counted against ``max_bytes``."""
        return self._bytes

    def held_by(self, owner: str) -> tuple[int, int]:
        """Messages and bytes ``owner`` holds."""
        share = self._owners.get(owner)
        return (0, 0) if share is None else (share[0], share[1])

    def _owner_fits(self, owner: str, size: int, old: Retained | None) -> bool:
        count, held = self.held_by(owner)
        if old is not None and old.owner == owner:
            old_size = _size(old.topic, old.payload, old.properties)
            return size <= old_size or held - old_size + size <= self.max_owner_bytes
        return count < self.max_owner_count and held + size <= self.max_owner_bytes

    def _charge(self, owner: str, count: int, size: int) -> None:
        if not owner:
            return
        share = self._owners.get(owner)
        if share is None:
            share = self._owners[owner] = [0, 0]
        share[0] += count
        share[1] += size
        if not share[0]:
            del self._owners[owner]

    def _fits(self, topic: str, size: int, old: Retained | None) -> bool:
        if old is None:
            return len(self._entries) < self.max_count and self._bytes + size <= self.max_bytes
        old_size = _size(topic, old.payload, old.properties)
        return size <= old_size or self._bytes - old_size + size <= self.max_bytes

    def _drop(self, topic: str, entry: Retained) -> None:
        del self._entries[topic]
        self._topics.remove(topic)
        size = _size(topic, entry.payload, entry.properties)
        self._bytes -= size
        self._charge(entry.owner, -1, -size)
        if entry.expires_at is not None:
            self._expiring -= 1

    def _compact(self) -> None:
        # Keep one item per live expiring entry: the one that carries its current expiry.
        live: dict[str, float] = {}
        for expires_at, topic in self._expiry:
            entry = self._entries.get(topic)
            if entry is not None and entry.expires_at == expires_at:
                live[topic] = expires_at
        self._expiry = [(expires_at, topic) for topic, expires_at in live.items()]
        heapq.heapify(self._expiry)

    def _walk(self, topic_filter: str, now: float, after: str | None) -> Iterator[tuple[str, Retained | None]]:
        """Each candidate topic after ``after`` in order, with its message if that matches
        and is live, else None. Consume it before the store changes."""
        entries = self._entries
        cut = _first_wildcard(topic_filter)
        if cut < 0:
            entry = entries.get(topic_filter)
            if entry is not None and (after is None or topic_filter > after):
                yield topic_filter, None if entry.expired(now) else entry
            return
        head = topic_filter[:cut]
        # "a/#" (only the trailing #) matches every topic under "a/", so the walk
        # needs no per-topic check; "#" alone must still turn away $-topics.
        whole_run = cut == len(topic_filter) - 1 and topic_filter.endswith("/#")
        if whole_run:
            # '#' also matches its parent ("sport/#" matches "sport"), which sorts just before the run.
            parent = head[:-1]
            entry = entries.get(parent)
            if entry is not None and (after is None or parent > after):
                yield parent, None if entry.expired(now) else entry
        if after is None or after < head:
            topics = self._topics.since(head, inclusive=True)
        else:
            topics = self._topics.since(after, inclusive=False)
        for topic in topics:
            if not topic.startswith(head):
                return
            entry = entries[topic]
            if entry.expired(now) or not (whole_run or topic_matches(topic_filter, topic)):
                yield topic, None
            else:
                yield topic, entry
