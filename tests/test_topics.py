"""The tree of topic filters (servers.heartbeat.broker.topics) against the reference rule,
``topic_matches`` scanned over every filter: the tree itself, the broker's
Subscriptions built on it, and the FilterIndex the coordinators route by."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from servers.heartbeat.broker.subscriptions import Subscriptions
from servers.heartbeat.broker.topics import FilterIndex, TopicTree
from servers.heartbeat.mqtt.filters import is_wildcard, topic_matches
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE

# Few level names, so that filters and topics share prefixes and collide; "" makes
# empty levels (a//b) and leading or trailing slashes; "$SYS" and "$x" start $-topics.
LEVELS = st.sampled_from(["", "a", "b", "ab", "$SYS", "$x", "x", "é"])
TOPICS = st.lists(LEVELS, min_size=1, max_size=5).map("/".join)
# Valid filters (as the reader lets them in): `+` levels anywhere, `#` only last.
FILTERS = st.builds(
    lambda levels, multi: "/".join(levels + ["#"] * multi),
    st.lists(st.one_of(LEVELS, st.just("+")), max_size=4),
    st.booleans(),
).filter(bool)
# What the reader refuses, to show the tree still agrees with the reference on it:
# `#` before the last level, wildcard characters inside a level.
ODD_FILTERS = st.lists(st.sampled_from(["a", "+", "#", "a+", "b#", ""]), min_size=1, max_size=4).map("/".join)


def reference(filters: set[str], topic: str) -> list[str]:
    return sorted(f for f in filters if topic_matches(f, topic))


def prefixes(filters: set[str]) -> int:
    """Distinct level prefixes of ``filters``: the nodes a tree of them needs beside its root."""
    return len({tuple(f.split("/")[: i + 1]) for f in filters for i in range(f.count("/") + 1)})


@pytest.mark.parametrize(
    ("topic_filter", "topic", "match"),
    [
        ("sport/tennis/player1/#", "sport/tennis/player1", True),
        ("sport/#", "sport", True),
        ("sport/+", "sport", False),
        ("sport/+", "sport/", True),
        ("+/+", "/finance", True),
        ("+", "/finance", False),
        ("#", "/", True),
        ("#", "$SYS/broker", False),
        ("+/broker", "$SYS/broker", False),
        ("$SYS/#", "$SYS", True),
        ("$SYS/+", "$SYS/broker", True),
        ("a/+/c", "a//c", True),
        ("#/a", "b", True),  # refused by the reader; matched as the reference does
        ("a+", "a", False),
    ],
)
def test_the_specs_examples(topic_filter: str, topic: str, match: bool) -> None:
    tree: TopicTree[str] = TopicTree()
    tree.set(topic_filter, topic_filter)
    assert tree.match(topic) == ([topic_filter] if match else [])
    assert tree.matches(topic) is match is topic_matches(topic_filter, topic)


@settings(max_examples=400)
@given(st.sets(st.one_of(FILTERS, ODD_FILTERS), max_size=12), st.lists(TOPICS, min_size=1, max_size=6))
def test_the_tree_matches_as_the_reference_does(filters: set[str], topics: list[str]) -> None:
    tree: TopicTree[str] = TopicTree()
    for topic_filter in filters:
        tree.set(topic_filter, topic_filter)
    assert len(tree) == len(filters)
    for topic in topics:
        expected = reference(filters, topic)
        assert sorted(tree.match(topic)) == expected  # each matching filter, each once
        assert tree.matches(topic) is bool(expected)
    assert sorted(tree.items()) == sorted((f, f) for f in filters)


@given(st.lists(st.tuples(st.booleans(), st.one_of(FILTERS, ODD_FILTERS)), max_size=60))
def test_random_sets_and_pops_leave_an_empty_tree(steps: list[tuple[bool, str]]) -> None:
    tree: TopicTree[str] = TopicTree()
    held: set[str] = set()
    for add, topic_filter in steps:
        if add:
            tree.set(topic_filter, topic_filter)
            held.add(topic_filter)
        else:
            assert tree.pop(topic_filter) == (topic_filter if topic_filter in held else None)
            held.discard(topic_filter)
        assert tree.nodes() == 1 + prefixes(held)  # a node per distinct prefix, no more
    for topic_filter in held:
        assert tree.pop(topic_filter) == topic_filter
    assert len(tree) == 0 and tree.nodes() == 1 and not tree.matches("a")


def test_a_none_value_is_refused() -> None:
    with pytest.raises(ValueError, match="None"):
        TopicTree[None]().set("a/+", None)


class SubscriptionsModel(RuleBasedStateMachine):
    """Subscriptions against a dict of each key's filters, routed by scanning them all."""

    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        self.subs: Subscriptions[str] = Subscriptions(max_qos=1)
        self.model: dict[str, dict[str, int]] = {}
        self.changes = self.subs.track()
        self.announced: set[str] = set()
        """The filters held, as the changes taken so far tell them."""

    @rule(target=keys, key=st.sampled_from(["k1", "k2", "k3"]))
    def new_key(self, key: str) -> str:
        return key

    @rule(key=keys, topic_filter=FILTERS, qos=st.integers(0, 2))
    def subscribe(self, key: str, topic_filter: str, qos: int) -> None:
        assert self.subs.subscribe(key, topic_filter, qos) == min(qos, 1)
        self.model.setdefault(key, {})[topic_filter] = min(qos, 1)

    @rule(key=keys, topic_filter=FILTERS)
    def unsubscribe(self, key: str, topic_filter: str) -> None:
        held = self.model.get(key, {})
        assert self.subs.unsubscribe(key, topic_filter) is (topic_filter in held)
        held.pop(topic_filter, None)
        if not held:
            self.model.pop(key, None)

    @rule(key=keys)
    def unsubscribe_one_held(self, key: str) -> None:
        held = self.model.get(key)
        if held:  # a filter the key holds, so unsubscribing finds it more often than by chance
            topic_filter = sorted(held)[0]
            assert self.subs.unsubscribe(key, topic_filter)
            del held[topic_filter]
            if not held:
                del self.model[key]

    @rule(key=keys)
    def drop(self, key: str) -> None:
        self.subs.drop(key)
        self.model.pop(key, None)

    @rule(topic=TOPICS)
    def route(self, topic: str) -> None:
        expected: dict[str, int] = {}
        for key, filters in self.model.items():
            for topic_filter, qos in filters.items():
                if topic_matches(topic_filter, topic):
                    expected[key] = max(qos, expected.get(key, -1))
        assert self.subs.route(topic) == expected

    @invariant()
    def same_subscriptions(self) -> None:
        held = {f for filters in self.model.values() for f in filters}
        assert self.subs.filters() == held
        added, removed = self.changes.take()
        assert not added & self.announced and removed <= self.announced
        self.announced = (self.announced | added) - removed
        assert self.announced == held
        assert len(self.subs) == sum(len(filters) for filters in self.model.values())
        assert all(self.subs.has(key) is (key in self.model) for key in ("k1", "k2", "k3"))
        for key in ("k1", "k2", "k3"):  # kept as filters come and go, for the per-client bound
            assert self.subs.held_bytes(key) == sum(len(f.encode()) for f in self.model.get(key, {}))
        # Wildcard filters no one holds any more leave no node behind.
        assert self.subs._tree.nodes() == 1 + prefixes({f for f in held if is_wildcard(f)})


TestSubscriptionsModel = SubscriptionsModel.TestCase
TestSubscriptionsModel.settings = settings(max_examples=150, stateful_step_count=40)


class FilterIndexModel(RuleBasedStateMachine):
    """A FilterIndex, replaced whole or changed a filter at a time, against a plain set."""

    def __init__(self) -> None:
        super().__init__()
        self.index = FilterIndex()
        self.model: set[str] = set()

    @rule(filters=st.sets(st.one_of(FILTERS, TOPICS), max_size=8), whole=st.booleans())
    def replace(self, filters: set[str], whole: bool) -> None:
        self.index.replace(frozenset(filters) if whole else filters)
        self.model = set(filters)

    @rule(topic_filter=st.one_of(FILTERS, TOPICS))
    def add(self, topic_filter: str) -> None:
        self.index.add(topic_filter)
        self.model.add(topic_filter)

    @rule(added=st.sets(st.one_of(FILTERS, TOPICS), max_size=3), removed=st.sets(FILTERS, max_size=3))
    def update(self, added: set[str], removed: set[str]) -> None:
        removed -= added  # a change names each filter once
        self.index.update(added, removed)
        self.model = (self.model - removed) | added

    @rule(topic_filter=st.one_of(FILTERS, TOPICS))
    def discard(self, topic_filter: str) -> None:
        self.index.discard(topic_filter)
        self.model.discard(topic_filter)

    @rule(topic=TOPICS)
    def matches(self, topic: str) -> None:
        expected = reference(self.model, topic)
        assert sorted(self.index.matching(topic)) == expected
        assert self.index.matches(topic) is bool(expected)

    @invariant()
    def same_filters(self) -> None:
        assert set(self.index) == self.model and len(self.index) == len(self.model)
        assert self.index.exact == {f for f in self.model if not is_wildcard(f)}
        assert self.index.wild.nodes() == 1 + prefixes({f for f in self.model if is_wildcard(f)})


TestFilterIndexModel = FilterIndexModel.TestCase
TestFilterIndexModel.settings = settings(max_examples=100, stateful_step_count=30)


def test_a_replace_keeps_the_set_it_was_given() -> None:
    filters = frozenset({"a/+", "b"})
    index = FilterIndex()
    index.replace(filters)
    index.replace(filters)  # the same set again: nothing to do
    assert index.matches("a/x") and index.matches("b") and not index.matches("c")
    index.add("c/#")
    assert index.matches("c") and "c/#" in index and "c/#" not in filters


def test_many_filters_of_one_client_share_their_prefix_nodes() -> None:
    subs: Subscriptions[str] = Subscriptions(max_qos=0)
    for i in range(20_000):
        subs.subscribe("greedy", f"zz/+/{i}", 0)
    subs.subscribe("device", f"{PRESENCE}#", 0)
    # root, zz, zz/+, one node per filter; the presence prefix's levels ($SYS, presence) and its # child
    assert subs._tree.nodes() == 1 + 2 + 20_000 + PRESENCE.count("/") + 1
    assert subs.route("zz/m/none") == {}
    assert subs.route("zz/m/7") == {"greedy": 0}
    assert subs.route(f"{PRESENCE}dev-1") == {"device": 0}
    subs.drop("greedy")
    assert subs._tree.nodes() == 1 + PRESENCE.count("/") + 1 and subs.route("zz/m/7") == {}


def test_a_publish_does_not_look_at_every_wildcard_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 33: 20,000 filters `zz/+/N` of one client were each matched against every
    # publish, and other clients' round trips went from 0.3 ms to 780 ms.
    from servers.heartbeat.broker import subscriptions
    from servers.heartbeat.mqtt.filters import topic_matches as reference_match

    looked = 0

    def counted(topic_filter: str, topic: str) -> bool:
        nonlocal looked
        looked += 1
        return reference_match(topic_filter, topic)

    monkeypatch.setattr(subscriptions, "topic_matches", counted)
    subs: Subscriptions[str] = Subscriptions(max_qos=0)
    for i in range(20_000):
        subs.subscribe("greedy", f"zz/+/{i}", 0)
    assert subs.route("zz/m/none") == {} and subs.route("zz/m/19999") == {"greedy": 0}
    assert FilterIndex(f"zz/+/{i}" for i in range(20_000)).matches("zz/m/none") is False
    assert looked == 0
