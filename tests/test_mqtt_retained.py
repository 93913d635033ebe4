"""Retained messages: replace and clear, wildcard lookups, caps, expiry, slices, memory,
and a model of the whole store (a dict scanned with topic_matches)."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from servers.heartbeat.broker.retained import Page, Retained, RetainedStore, _SortedTopics
from servers.heartbeat.mqtt.filters import topic_matches


def topics_of(messages: list[Retained]) -> list[str]:
    return [m.topic for m in messages]


def filled(*topics: str) -> RetainedStore:
    store = RetainedStore()
    for topic in topics:
        assert store.store(topic, topic.encode(), 1, now=0.0)
    return store


def walk_pages(store: RetainedStore, topic_filter: str, now: float, budget: int) -> tuple[list[Retained], int]:
    """Every message a page-by-page walk finds, and how many pages it took."""
    found: list[Retained] = []
    after: str | None = None
    for pages in range(1, 10_000):
        page = store.page(topic_filter, now, after=after, budget=budget)
        found += page.messages
        if page.cursor is None:
            return found, pages
        after = page.cursor
    raise AssertionError("the walk never ended")


# -- set, replace, clear ----------------------------------------------------------


def test_store_replace_and_clear() -> None:
    store = RetainedStore()
    assert store.get("a/b", now=0.0) is None
    assert store.store("a/b", b"one", 1, now=0.0)
    assert store.get("a/b", now=0.0) == Retained("a/b", b"one", 1)
    assert (store.count, store.bytes) == (1, 3 + 3)
    # A new retained message replaces the old one, QoS as published.
    assert store.store("a/b", b"second", 0, now=1.0)
    assert store.get("a/b", now=1.0) == Retained("a/b", b"second", 0)
    assert (store.count, store.bytes) == (1, 3 + 6)
    # An empty payload clears the topic and is not stored (MQTT-3.3.1-10/11).
    assert store.store("a/b", b"", 1, now=2.0)
    assert store.get("a/b", now=2.0) is None
    assert store.matching("#", now=2.0) == []
    assert (store.count, store.bytes) == (0, 0)
    # Clearing a topic with nothing retained is harmless.
    assert store.store("a/b", b"", 0, now=3.0)
    assert (store.count, store.bytes, store.refused) == (0, 0, 0)


def test_bytes_count_topic_as_utf8() -> None:
    store = RetainedStore()
    store.store("café/é", b"xy", 0, now=0.0)
    assert store.bytes == len("café/é".encode()) + 2 == 10


def test_replacement_keeps_one_topic_string() -> None:
    # An equal topic from another packet is another str object; holding both would
    # double the topic's memory for every device that republishes.
    store = RetainedStore()
    first = "".join(["state/", "dev-1"])
    second = "".join(["state/", "dev-1"])
    assert first == second and first is not second
    store.store(first, b"online", 1, now=0.0)
    store.store(second, b"offline", 1, now=1.0, expires_at=100.0)
    entry = store.get(second, now=1.0)
    assert entry is not None and entry.topic is first
    assert all(topic is first for _, topic in store._expiry)


# -- matching ---------------------------------------------------------------------

TOPICS = (
    "sport",
    "sport/",
    "sport/tennis",
    "sport/tennis/player1",
    "sport/tennis/player1/ranking",
    "sport/tennis/player2",
    "sport/golf",
    "sports",
    "sport-news",
    "/finance",
    "finance",
    "$SYS/broker/clients",
    "$SYS/monitor/Clients",
    "a/b/c",
    "a//c",
)


@pytest.mark.parametrize(
    ("topic_filter", "expected"),
    [
        ("sport", ["sport"]),
        ("sport/tennis/player1", ["sport/tennis/player1"]),
        ("nothing/here", []),
        ("$SYS/broker/clients", ["$SYS/broker/clients"]),
        ("sport/#", ["sport", "sport/", "sport/golf", "sport/tennis", "sport/tennis/player1",
                     "sport/tennis/player1/ranking", "sport/tennis/player2"]),
        ("sport/tennis/player1/#", ["sport/tennis/player1", "sport/tennis/player1/ranking"]),
        ("sport/tennis/+", ["sport/tennis/player1", "sport/tennis/player2"]),
        ("sport/+", ["sport/", "sport/golf", "sport/tennis"]),
        ("+/tennis/#", ["sport/tennis", "sport/tennis/player1", "sport/tennis/player1/ranking",
                        "sport/tennis/player2"]),
        ("+", ["finance", "sport", "sport-news", "sports"]),
        ("/+", ["/finance"]),
        ("+/+", ["/finance", "sport/", "sport/golf", "sport/tennis"]),
        ("a/+/c", ["a//c", "a/b/c"]),
        # $-topics are not for filters that start with a wildcard (MQTT-4.7.2-1).
        ("#", sorted(t for t in TOPICS if not t.startswith("$"))),
        ("+/monitor/Clients", []),
        ("$SYS/#", ["$SYS/broker/clients", "$SYS/monitor/Clients"]),
        ("$SYS/+/Clients", ["$SYS/monitor/Clients"]),
    ],
)  # fmt: skip
def test_matching(topic_filter: str, expected: list[str]) -> None:
    store = filled(*TOPICS)
    found = store.matching(topic_filter, now=0.0)
    assert topics_of(found) == expected
    assert topics_of(found) == sorted(t for t in TOPICS if topic_matches(topic_filter, t))
    assert all(m.payload == m.topic.encode() and m.qos == 1 for m in found)


def test_matching_walks_only_the_filters_subtree() -> None:
    # A page that examines at most `budget` topics and still finishes proves the walk
    # never looked at the 2,000 topics outside the filter's head.
    store = filled(*(f"other/{i}" for i in range(1000)), *(f"devices/{i}/state" for i in range(1000)))
    store.store("devices/42/state", b"on", 1, now=0.0)
    store.store("devices/42/cmd/reboot", b"1", 1, now=0.0)
    store.store("devices/42", b"root", 1, now=0.0)
    page = store.page("devices/42/#", now=0.0, budget=3)
    assert page.cursor is None
    assert topics_of(page.messages) == ["devices/42", "devices/42/cmd/reboot", "devices/42/state"]
    assert store.page("devices/42/state", now=0.0, budget=1) == Page([Retained("devices/42/state", b"on", 1)], None)
    found, pages = walk_pages(store, "devices/+/state", now=0.0, budget=500)
    # The 1,002 topics under devices/ take three pages of 500; other/ is never walked.
    assert len(found) == 1000 and pages == 3


def test_matching_in_slices_follows_changes_between_slices() -> None:
    store = filled(*(f"state/{i:03d}" for i in range(100)))
    first = store.matching("state/+", now=0.0, limit=30)
    assert topics_of(first) == [f"state/{i:03d}" for i in range(30)]
    # Between slices: one topic already sent changes, one ahead is cleared, one new arrives.
    store.store("state/005", b"again", 1, now=1.0)
    store.store("state/050", b"", 1, now=1.0)
    store.store("state/0505", b"new", 1, now=1.0)
    rest: list[Retained] = []
    after = first[-1].topic
    while batch := store.matching("state/+", now=1.0, after=after, limit=30):
        rest += batch
        after = batch[-1].topic
    expected = [f"state/{i:03d}" for i in range(30, 100) if i != 50]
    expected.insert(expected.index("state/051"), "state/0505")
    assert topics_of(rest) == expected
    assert store.matching("state/+", now=1.0, limit=0) == []
    assert store.matching("state/+", now=1.0, after="state/099") == []
    assert store.matching("state/+", now=1.0, after="zzz") == []
    assert topics_of(store.matching("state/+", now=1.0, after="a", limit=1)) == ["state/000"]


def test_page_with_sparse_matches() -> None:
    store = filled(*(f"dev/{i:04d}/{'status' if i % 100 == 0 else 'data'}" for i in range(1000)))
    found, pages = walk_pages(store, "+/+/status", now=0.0, budget=64)
    assert topics_of(found) == [f"dev/{i:04d}/status" for i in range(0, 1000, 100)]
    assert pages == 16  # ceil(1000 / 64): every page bounded, most of them empty
    with pytest.raises(ValueError, match="budget"):
        store.page("#", now=0.0, budget=0)
    assert store.page("nothing/+", now=0.0) == Page([], None)


# -- caps ---------------------------------------------------------------------------


def test_count_cap_refuses_new_topics_but_not_replacements() -> None:
    store = RetainedStore(max_count=2)
    assert store.store("a", b"1", 0, now=0.0)
    assert store.store("b", b"2", 0, now=0.0)
    assert not store.store("c", b"3", 0, now=0.0)
    assert store.refused == 1
    assert store.get("c", now=0.0) is None
    assert store.store("a", b"11", 0, now=0.0)  # a replacement adds no message
    assert store.store("b", b"", 0, now=0.0)  # clearing makes room
    assert store.store("c", b"3", 0, now=0.0)
    assert (store.count, store.refused) == (2, 1)


def test_byte_cap_refuses_growth_allows_shrinking() -> None:
    store = RetainedStore(max_bytes=20)
    assert store.store("t1", b"12345678", 1, now=0.0)  # 10 bytes
    assert store.store("t2", b"12345678", 1, now=0.0)  # 20: exactly full
    assert not store.store("t3", b"x", 1, now=0.0)
    assert store.store("t1", b"abcdefgh", 0, now=0.0)  # same size: fine at the cap
    assert store.store("t1", b"1234", 1, now=0.0)  # smaller: always fine
    assert store.bytes == 16
    assert store.store("t1", b"123456", 1, now=0.0)  # grows into the room it left
    assert store.bytes == 18
    assert store.refused == 1
    # A replacement that does not fit is refused, and the old message stays: dropping it
    # let a client that filled the store erase others' values (issue 33).
    assert not store.store("t1", b"123456789", 1, now=0.0)
    assert store.get("t1", now=0.0) == Retained("t1", b"123456", 1)
    assert (store.count, store.bytes, store.refused) == (2, 18, 2)
    assert not store.store("big", b"x" * 100, 1, now=0.0)  # larger than the whole cap
    assert store.refused == 3


def test_a_client_fills_only_its_own_share_and_a_refusal_keeps_the_old_value() -> None:
    # Issue 33: an attacker filled the store, then the victim's update to its own topic
    # was refused and its old value removed.
    store = RetainedStore(max_bytes=100, max_owner_count=3, max_owner_bytes=42)
    assert store.store("victim/state", b"on", 1, now=0.0, owner="victim")
    for i in range(10):
        store.store(f"junk/{i}", b"x" * 8, 0, now=0.0, owner="attacker")
    assert store.held_by("attacker") == (3, 3 * 14)  # its share, no more
    assert store.refused_quota == 7
    assert store.store("victim/state", b"off", 1, now=0.0, owner="victim")  # room left for others
    assert store.get("victim/state", now=0.0) == Retained("victim/state", b"off", 1, None, "victim")
    # Another client taking a topic over takes its bytes into its own share.
    assert store.store("junk/0", b"mine", 0, now=0.0, owner="victim")
    assert store.held_by("attacker") == (2, 2 * 14) and store.held_by("victim") == (2, 15 + 10)
    # Past the whole store's bound, a refused update leaves the old value.
    store.max_bytes = store.bytes
    assert not store.store("victim/state", b"offline", 1, now=0.0, owner="victim")
    assert store.get("victim/state", now=0.0) == Retained("victim/state", b"off", 1, None, "victim")
    assert store.store("victim/state", b"", 1, now=0.0, owner="attacker")  # clearing always works
    assert store.held_by("victim") == (1, 10)


def test_shrinking_replacement_succeeds_even_over_the_cap() -> None:
    store = RetainedStore(max_bytes=20)
    store.store("a", b"x" * 9, 0, now=0.0)
    store.store("b", b"x" * 9, 0, now=0.0)
    store.max_bytes = 5  # lowered while full: the store is now over its cap
    assert store.store("a", b"x" * 8, 0, now=0.0)
    assert not store.store("a", b"x" * 9, 0, now=0.0)
    assert store.refused == 1


def test_full_store_frees_expired_messages_before_refusing() -> None:
    store = RetainedStore(max_count=3)
    store.store("state/a", b"offline", 1, now=0.0, expires_at=10.0)
    store.store("state/b", b"offline", 1, now=0.0, expires_at=20.0)
    store.store("state/c", b"online", 1, now=0.0)
    assert not store.store("state/d", b"online", 1, now=5.0)
    assert store.store("state/d", b"online", 1, now=10.0)  # a has expired: it makes room
    assert topics_of(store.matching("state/+", now=10.0)) == ["state/b", "state/c", "state/d"]
    assert (store.count, store.refused) == (3, 1)


# -- expiry -------------------------------------------------------------------------


def test_expired_messages_are_never_returned_even_before_prune() -> None:
    store = RetainedStore()
    store.store("state/dev-1", b"offline", 1, now=0.0, expires_at=60.0)
    store.store("state/dev-2", b"online", 1, now=0.0)
    assert topics_of(store.matching("state/+", now=59.9)) == ["state/dev-1", "state/dev-2"]
    assert store.get("state/dev-1", now=59.9) is not None
    # Expiry is inclusive: at expires_at the message is gone.
    assert topics_of(store.matching("state/+", now=60.0)) == ["state/dev-2"]
    assert store.matching("state/dev-1", now=60.0) == []
    assert store.matching("state/#", now=60.0, limit=1) == [Retained("state/dev-2", b"online", 1)]
    assert store.page("state/dev-1", now=60.0) == Page([], None)
    assert store.get("state/dev-1", now=60.0) is None
    assert store.count == 2  # still held until pruned
    assert store.prune(now=60.0) == 1
    assert store.count == 1 and store.bytes == len("state/dev-2") + 6


def test_store_already_expired_clears() -> None:
    store = RetainedStore()
    store.store("t", b"x", 0, now=0.0)
    assert store.store("t", b"y", 0, now=10.0, expires_at=10.0)
    assert store.count == 0 and store.refused == 0


def test_prune_in_expiry_order_with_limit() -> None:
    store = RetainedStore()
    for i in range(10):
        store.store(f"t/{i}", b"x", 0, now=0.0, expires_at=float(10 - i))
    store.store("t/forever", b"x", 0, now=0.0)
    assert store.prune(now=0.5) == 0
    assert store.prune(now=5.0, limit=2) == 2
    assert topics_of(store.matching("t/+", now=0.0)) == [
        "t/0", "t/1", "t/2", "t/3", "t/4", "t/5", "t/6", "t/7", "t/forever"
    ]  # fmt: skip
    assert store.prune(now=5.0) == 3  # t/7, t/6, t/5 (expiring at 3, 4, 5: inclusive)
    assert store.prune(now=1000.0) == 5
    assert topics_of(store.matching("#", now=0.0)) == ["t/forever"]
    assert store.prune(now=1000.0) == 0
    assert store._expiry == []


def test_replaced_entrys_old_expiry_does_not_remove_the_new_one() -> None:
    store = RetainedStore()
    store.store("state/d", b"offline", 1, now=0.0, expires_at=10.0)
    store.store("state/d", b"online", 1, now=5.0)  # reconnected: no expiry now
    assert store.prune(now=11.0) == 0
    assert store.get("state/d", now=11.0) == Retained("state/d", b"online", 1)
    store.store("state/d", b"offline", 1, now=12.0, expires_at=100.0)
    store.store("state/d", b"offline!", 1, now=13.0, expires_at=200.0)
    assert store.prune(now=150.0) == 0
    assert store.get("state/d", now=150.0) is not None
    store.store("state/d", b"", 1, now=160.0)
    store.store("state/d", b"back", 1, now=161.0)
    assert store.prune(now=1000.0) == 0
    assert store.get("state/d", now=1000.0) == Retained("state/d", b"back", 1)


def test_stale_expiry_items_stay_bounded() -> None:
    # A device flapping online/offline leaves one stale heap item per flap until the
    # heap is rebuilt; it must not grow with the number of flaps.
    store = RetainedStore()
    for i in range(20_000):
        store.store("state/flappy", b"offline", 1, now=float(i), expires_at=1e9 + i)
    assert len(store._expiry) <= 2 * 1 + 1024 + 1
    assert store.prune(now=2e9) == 1
    assert store.count == 0


# -- the sorted index ------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    chunk=st.integers(2, 6),
    ops=st.lists(st.tuples(st.booleans(), st.text("ab/", max_size=3)), max_size=300),
    start=st.text("ab/", max_size=4),
)
def test_sorted_topics_against_a_sorted_set(chunk: int, ops: list[tuple[bool, str]], start: str) -> None:
    index = _SortedTopics(chunk)
    model: set[str] = set()
    for add, topic in ops:
        if add and topic not in model:
            index.add(topic)
            model.add(topic)
        elif not add and topic in model:
            index.remove(topic)
            model.discard(topic)
    assert list(index) == sorted(model)
    assert all(len(block) <= 2 * chunk for block in index._blocks)
    assert index._maxes == [block[-1] for block in index._blocks]
    assert list(index.since(start, inclusive=True)) == sorted(t for t in model if t >= start)
    assert list(index.since(start, inclusive=False)) == sorted(t for t in model if t > start)


def test_sorted_topics_merge_then_split() -> None:
    index = _SortedTopics(4)
    for i in range(12):
        index.add(f"k{i:02d}")
    assert [len(block) for block in index._blocks] == [4, 8]
    for i in range(3):
        index.remove(f"k{i:02d}")
    # The drained first block (1 key) merged into its 8-key neighbour, 9 > 8 split again.
    assert [len(block) for block in index._blocks] == [4, 5]
    assert list(index) == [f"k{i:02d}" for i in range(3, 12)]
    assert index._maxes == ["k06", "k11"]


def test_sorted_topics_under_churn() -> None:
    # Grow and shrink well past the block size, so blocks split, drain, and merge
    # with either neighbour (and split again when the merge is too big).
    rng = random.Random(7)
    index = _SortedTopics(4)
    model: set[str] = set()
    keys = [f"k/{i:02d}" for i in range(60)]
    for step in range(3000):
        topic = rng.choice(keys)
        grow = (step // 500) % 2 == 0  # phases of mostly adding, then mostly removing
        if topic not in model and rng.random() < (0.9 if grow else 0.1):
            index.add(topic)
            model.add(topic)
        elif topic in model and rng.random() < (0.1 if grow else 0.9):
            index.remove(topic)
            model.discard(topic)
        assert index._maxes == [block[-1] for block in index._blocks]
        assert all(0 < len(block) <= 8 for block in index._blocks)
    assert list(index) == sorted(model)


# -- memory -------------------------------------------------------------------------

ENTRIES = 10_000


def traced_per_entry(expires: bool) -> tuple[float, float]:
    """Bytes and allocations per entry for ENTRIES 60-byte topics with 200-byte
    payloads, the topic and payload objects included."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        store = RetainedStore()
        payload = bytes(range(200))
        for i in range(ENTRIES):
            topic = f"state/devices/{i:046d}"
            assert len(topic) == 60
            store.store(topic, payload[:199] + b"!", 1, now=0.0, expires_at=1e9 + i if expires else None)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    diff = after.compare_to(before, "filename")
    size = sum(stat.size_diff for stat in diff)
    blocks = sum(stat.count_diff for stat in diff)
    assert store.count == ENTRIES
    return size / ENTRIES, blocks / ENTRIES


def test_memory_per_entry() -> None:
    per_entry, blocks = traced_per_entry(expires=False)
    data = 109 + 233  # the 60-character str and the 200-byte bytes objects themselves
    # Measured on CPython 3.11: ~435 bytes (≈93 of the store's own), 3 allocations
    # (topic, payload, Retained) plus the dict's and index's amortized growth.
    assert per_entry - data < 130
    assert per_entry < 480
    assert blocks < 3.2
    with_expiry, blocks = traced_per_entry(expires=True)
    # The expiry float, its heap tuple and the heap slot: ~88 bytes more.
    assert with_expiry - per_entry < 110
    assert blocks < 5.2


# -- the store against a model ------------------------------------------------------

LEVELS = ["a", "b", "", "$SYS", "é"]
topic_names = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=3).map("/".join).filter(bool)
topic_filters = st.builds(
    lambda levels, hash_: "/".join([*levels, "#"] if hash_ else levels),
    st.lists(st.sampled_from([*LEVELS, "+"]), max_size=3),
    st.booleans(),
).filter(bool)


def size_of(entry: Retained) -> int:
    return len(entry.topic.encode()) + len(entry.payload)


class RetainedModel(RuleBasedStateMachine):
    """The store against a dict of held messages scanned with topic_matches."""

    def __init__(self) -> None:
        super().__init__()
        self.store = RetainedStore()
        self.model: dict[str, Retained] = {}
        self.refused = 0
        self.now = 0.0

    @initialize(
        max_count=st.integers(1, 30),
        max_bytes=st.integers(1, 200),
        owner_count=st.integers(1, 10),
        owner_bytes=st.integers(1, 100),
        chunk=st.sampled_from([2, 4]),
    )
    def configure(self, max_count: int, max_bytes: int, owner_count: int, owner_bytes: int, chunk: int) -> None:
        self.store = RetainedStore(
            max_count=max_count, max_bytes=max_bytes, max_owner_count=owner_count, max_owner_bytes=owner_bytes
        )
        self.store._topics = _SortedTopics(chunk)  # small blocks, so splits and merges happen

    def fits(self, topic: str, entry: Retained) -> bool:
        old = self.model.get(topic)
        total = sum(map(size_of, self.model.values()))
        if old is None:
            return len(self.model) < self.store.max_count and total + size_of(entry) <= self.store.max_bytes
        return size_of(entry) <= size_of(old) or total - size_of(old) + size_of(entry) <= self.store.max_bytes

    def owner_fits(self, topic: str, entry: Retained) -> bool:
        if not entry.owner:
            return True
        mine = [e for e in self.model.values() if e.owner == entry.owner]
        held = sum(map(size_of, mine))
        old = self.model.get(topic)
        if old is not None and old.owner == entry.owner:
            return size_of(entry) <= size_of(old) or held - size_of(old) + size_of(entry) <= self.store.max_owner_bytes
        return len(mine) < self.store.max_owner_count and held + size_of(entry) <= self.store.max_owner_bytes

    def live(self, topic_filter: str) -> list[Retained]:
        return [
            self.model[t]
            for t in sorted(self.model)
            if not self.model[t].expired(self.now) and topic_matches(topic_filter, t)
        ]

    @rule(
        topic=topic_names,
        payload=st.binary(max_size=12),
        qos=st.integers(0, 2),
        ttl=st.none() | st.integers(-1, 5),
        owner=st.sampled_from(["", "o1", "o2"]),
    )
    def publish(self, topic: str, payload: bytes, qos: int, ttl: int | None, owner: str) -> None:
        expires_at = None if ttl is None else self.now + ttl
        stored = self.store.store(topic, payload, qos, self.now, expires_at, owner)
        entry = Retained(topic, payload, qos, expires_at, owner)
        expected = True
        if not payload or entry.expired(self.now):
            self.model.pop(topic, None)
        else:
            if not self.fits(topic, entry):
                # The store frees expired messages first (here all of them: far fewer than its batch).
                self.model = {t: e for t, e in self.model.items() if not e.expired(self.now)}
            if self.fits(topic, entry) and self.owner_fits(topic, entry):
                self.model[topic] = entry
            else:
                # Refused, and the topic keeps what it had.
                self.refused += 1
                expected = False
        assert stored is expected

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(limit=st.none() | st.integers(0, 3))
    def prune(self, limit: int | None) -> None:
        expired = {t for t, e in self.model.items() if e.expired(self.now)}
        removed = self.store.prune(self.now, limit)
        assert removed == (len(expired) if limit is None else min(limit, len(expired)))
        # Which expired ones go first under a limit is the heap's business; only expired ones may go.
        gone = set(self.model) - set(self.store._entries)
        assert gone <= expired and len(gone) == removed
        self.model = {t: e for t, e in self.model.items() if t not in gone}

    @rule(topic_filter=topic_filters, after=st.none() | topic_names, limit=st.none() | st.integers(0, 4))
    def matching(self, topic_filter: str, after: str | None, limit: int | None) -> None:
        expected = [e for e in self.live(topic_filter) if after is None or e.topic > after]
        if limit is not None:
            expected = expected[:limit]
        assert self.store.matching(topic_filter, self.now, after=after, limit=limit) == expected

    @rule(topic_filter=topic_filters, budget=st.integers(1, 4))
    def pages(self, topic_filter: str, budget: int) -> None:
        found, _ = walk_pages(self.store, topic_filter, self.now, budget)
        assert found == self.live(topic_filter)

    @rule(topic=topic_names)
    def get(self, topic: str) -> None:
        entry = self.model.get(topic)
        assert self.store.get(topic, self.now) == (None if entry is None or entry.expired(self.now) else entry)

    @invariant()
    def same_messages(self) -> None:
        assert self.store._entries == self.model
        assert self.store.count == len(self.model)
        assert self.store.bytes == sum(map(size_of, self.model.values()))
        assert self.store.refused == self.refused
        assert list(self.store._topics) == sorted(self.model)
        for owner in ("o1", "o2"):
            mine = [e for e in self.model.values() if e.owner == owner]
            assert self.store.held_by(owner) == (len(mine), sum(map(size_of, mine)))


RetainedModel.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestRetainedModel = RetainedModel.TestCase
