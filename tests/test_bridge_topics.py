"""A bridge's topics (issue 64): Mosquitto's ``topic`` directive read as Mosquitto 2.0
reads it, its checks (``bridge__add_topic``), and the mapping its bridge makes, held
to mosquitto.conf(5)'s own examples and to Mosquitto's code where the manual is silent."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from servers.heartbeat.bridge.topics import (
    BridgeTopic,
    local_subscriptions,
    map_incoming,
    map_outgoing,
    parse_topic,
    remote_subscriptions,
    remote_unsubscriptions,
)
from servers.heartbeat.mqtt.filters import topic_matches
from servers.settings import SettingError

# -- reading the directive --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sensors/#", BridgeTopic("sensors/#")),
        ("sensors/# in", BridgeTopic("sensors/#", "in")),
        ("sensors/# BOTH 2", BridgeTopic("sensors/#", "both", 2)),  # Mosquitto reads the direction in any case
        ("# both 2 local/topic/ remote/topic/", BridgeTopic("#", "both", 2, "local/topic/", "remote/topic/")),
        ('a/+ out 1 "" r/', BridgeTopic("a/+", "out", 1, "", "r/")),
        ('a/+ out 1 l/ ""', BridgeTopic("a/+", "out", 1, "l/", "")),
        ("a/+ out 1 l/", BridgeTopic("a/+", "out", 1, "l/", "")),  # Mosquitto takes one prefix alone
        ('"" out 0 local remote', BridgeTopic("", "out", 0, "local", "remote")),
        ("a in 1 # the rest is a comment", BridgeTopic("a", "in", 1)),
        ("a in #1", BridgeTopic("a", "in", 0)),  # Mosquitto: a comment where the QoS goes, QoS 0
        ("a in 1 l/ r/ # comment", BridgeTopic("a", "in", 1, "l/", "r/")),
        ("  a   in   1  ", BridgeTopic("a", "in", 1)),
    ],
)
def test_the_directive_reads_as_mosquitto_reads_it(text: str, expected: BridgeTopic) -> None:
    assert parse_topic(text) == expected
    assert parse_topic(expected.text()) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "needs a pattern"),
        ("a sideways", "the direction must be out, in or both, not 'sideways'"),
        ("a # comment", "the direction must be out, in or both, not '#'"),
        ("a in 3", "the QoS must be 0, 1 or 2, not '3'"),
        ("a in 1x", "the QoS must be 0, 1 or 2, not '1x'"),
        ("a in 1 l/ r/ extra", "takes at most 5 words"),
        ("a in 1 l/+/ r/", "the local prefix 'l/+/' holds a wildcard"),
        ("a in 1 l/ r/#", "the remote prefix 'r/#' holds a wildcard"),
        ("a/b# in 1", "the pattern is not a valid filter"),
        ("a/#/b", "the pattern is not a valid filter"),
        ("a+", "the pattern is not a valid filter"),
        ("# in 1 l r/", "the local prefix and the pattern, 'l#', is not a valid filter"),
        ("+ in 1 l/ r", "the remote prefix and the pattern, 'r+', is not a valid filter"),
        ("a/" * 201 + "a", "has more than 200 levels"),
    ],
)
def test_a_bad_topic_is_refused_saying_why(text: str, reason: str) -> None:
    with pytest.raises(SettingError) as caught:
        parse_topic(text)
    assert reason in str(caught.value)


# mosquitto.conf(5)'s table: pattern, local prefix, remote prefix -> full local and remote topics.
MANUAL_TABLE = [
    ("pattern", "L/", "R/", "L/pattern", "R/pattern"),
    ("pattern", "L/", '""', "L/pattern", "pattern"),
    ("pattern", '""', "R/", "pattern", "R/pattern"),
    ("pattern", '""', '""', "pattern", "pattern"),
    ('""', "local", "remote", "local", "remote"),
    ('""', "local", '""', None, None),
    ('""', '""', "remote", None, None),
    ('""', '""', '""', None, None),
]


@pytest.mark.parametrize(("pattern", "local", "remote", "full_local", "full_remote"), MANUAL_TABLE)
def test_the_manuals_table_of_prefixes(
    pattern: str, local: str, remote: str, full_local: str | None, full_remote: str | None
) -> None:
    text = f"{pattern} both 0 {local} {remote}"
    if full_local is None or full_remote is None:
        with pytest.raises(SettingError, match="an empty pattern"):
            parse_topic(text)
        return
    entry = parse_topic(text)
    assert (entry.local_filter, entry.remote_filter) == (full_local, full_remote)
    # "if you publish to L/topic on the local broker, then the remote broker will receive
    # a message on the topic R/topic", and back.
    assert map_outgoing([entry], full_local) == full_remote
    assert map_incoming([entry], full_remote) == full_local


def test_the_manuals_whole_tree_example() -> None:
    entry = parse_topic("# both 2 local/topic/ remote/topic/")
    assert local_subscriptions([entry]) == [("local/topic/#", 2)]
    assert remote_subscriptions([entry]) == [("remote/topic/#", 2)]
    assert map_outgoing([entry], "local/topic/a/b") == "remote/topic/a/b"
    assert map_incoming([entry], "remote/topic/a/b") == "local/topic/a/b"
    assert map_outgoing([entry], "elsewhere/a") is None


def test_the_manuals_test_mosquitto_org_example() -> None:
    # connection test-mosquitto-org / topic clients/total in 0 test/mosquitto/org/ $SYS/broker/
    entry = parse_topic("clients/total in 0 test/mosquitto/org/ $SYS/broker/")
    assert remote_subscriptions([entry]) == [("$SYS/broker/clients/total", 0)]
    assert local_subscriptions([entry]) == []
    assert map_incoming([entry], "$SYS/broker/clients/total") == "test/mosquitto/org/clients/total"
    assert map_outgoing([entry], "test/mosquitto/org/clients/total") is None  # in only: nothing goes out


# -- what Mosquitto's code does where the manual is silent ------------------------------


def test_subscriptions_follow_the_directions_and_out_only_entries_are_unsubscribed() -> None:
    topics = [parse_topic("a/# out 1 l/ r/"), parse_topic("b/# in 2"), parse_topic("c both")]
    assert local_subscriptions(topics) == [("l/a/#", 1), ("c", 0)]
    assert remote_subscriptions(topics) == [("b/#", 2), ("c", 0)]
    assert remote_unsubscriptions(topics) == ["r/a/#"]


def test_the_first_remapping_entry_that_matches_maps_the_topic() -> None:
    topics = [parse_topic("a/# out"), parse_topic('a/b out 0 "" first/'), parse_topic('a/+ out 0 "" second/')]
    # The plain entry matches first but maps nothing: Mosquitto looks only at entries with a prefix.
    assert map_outgoing(topics, "a/b") == "first/a/b"
    assert map_outgoing(topics, "a/c") == "second/a/c"
    assert map_outgoing(topics, "a/c/d") == "a/c/d"  # forwarded (a/#), as it is
    assert map_outgoing(topics, "z") is None


def test_an_incoming_topic_no_entry_matches_comes_in_as_it_is() -> None:
    # A remote session kept from an older configuration may still send it (mosquitto.conf(5) warns).
    topics = [parse_topic("a/# in 0 l/ r/")]
    assert map_incoming(topics, "r/a/x") == "l/a/x"
    assert map_incoming(topics, "old/topic") == "old/topic"
    assert map_incoming([parse_topic("a/# out 0 l/ r/")], "r/a/x") == "r/a/x"  # out only: no mapping in


def test_a_filters_parent_level_is_matched_but_its_prefix_not_taken_off() -> None:
    # ``l/#`` matches ``l`` itself (MQTT 4.7.1.2), which does not start with ``l/``:
    # Mosquitto leaves it whole and still puts the remote prefix on.
    entry = parse_topic("# both 0 l/ r/")
    assert map_outgoing([entry], "l") == "r/l"
    assert map_incoming([entry], "r") == "l/r"


def test_wildcards_at_the_start_of_a_filter_do_not_match_dollar_topics() -> None:
    assert map_outgoing([parse_topic("# out")], "$SYS/broker/uptime") is None
    assert map_outgoing([parse_topic('$SYS/# out 0 "" r/')], "$SYS/broker/uptime") == "r/$SYS/broker/uptime"


def test_a_prefix_without_a_slash_is_glued_to_the_pattern() -> None:
    entry = parse_topic("a/+ both 0 site a/")
    assert entry.local_filter == "sitea/+"
    assert map_outgoing([entry], "sitea/x") == "a/a/x"
    assert map_incoming([entry], "a/a/x") == "sitea/x"


def test_text_writes_the_shortest_form() -> None:
    assert BridgeTopic("a").text() == "a"
    assert BridgeTopic("a", "in").text() == "a in"
    assert BridgeTopic("a", "out", 1).text() == "a out 1"
    assert BridgeTopic("", "both", 2, "l", "r").text() == '"" both 2 l r'
    assert BridgeTopic("a", "out", 0, "", "r/").text() == 'a out 0 "" r/'


def test_the_record_itself_checks_its_values() -> None:
    with pytest.raises(SettingError, match="direction"):
        BridgeTopic("a", "sideways")
    with pytest.raises(SettingError, match="QoS"):
        BridgeTopic("a", "out", 3)


# -- the property: out then back in is the identity -------------------------------------

_LEVEL = st.text(alphabet="abcxyz09-_$ ", min_size=0, max_size=4)
_NAME = st.text(alphabet="abcxyz09-_", min_size=1, max_size=4)


@st.composite
def _prefix(draw: st.DrawFn) -> str:
    levels = draw(st.lists(_NAME, max_size=3))
    if not levels:
        return ""
    # Most prefixes end in "/"; one that does not is glued to the pattern's first level.
    return "/".join(levels) + draw(st.sampled_from(["/", "/", ""]))


@st.composite
def _pattern_and_topic(draw: st.DrawFn) -> tuple[str, str]:
    """A pattern and a topic it matches (made level by level from the pattern)."""
    pattern_levels: list[str] = []
    topic_levels: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["name", "name", "+"]))
        if kind == "+":
            pattern_levels.append("+")
            topic_levels.append(draw(_LEVEL))
        else:
            name = draw(_NAME)
            pattern_levels.append(name)
            topic_levels.append(name)
    if draw(st.booleans()):
        pattern_levels.append("#")
        topic_levels += draw(st.lists(_LEVEL, min_size=1, max_size=3))
    return "/".join(pattern_levels), "/".join(topic_levels)


@settings(max_examples=400, deadline=None)
@given(_pattern_and_topic(), _prefix(), _prefix(), st.sampled_from([0, 1, 2]))
def test_out_then_in_is_the_identity_for_every_topic_the_pattern_matches(
    pattern_topic: tuple[str, str], local: str, remote: str, qos: int
) -> None:
    pattern, rest = pattern_topic
    # A level starting with "$" made for a leading "+" or "#" is not matched (MQTT-4.7.2-1).
    assume(topic_matches(pattern, rest))
    try:
        entry = BridgeTopic(pattern, "both", qos, local, remote)
    except SettingError:
        # Only a prefix glued to a wildcard level ("l" + "#"), which Mosquitto refuses too.
        assert (local and not local.endswith("/")) or (remote and not remote.endswith("/"))
        return
    topic = local + rest
    sent = map_outgoing([entry], topic)
    assert sent == remote + rest
    assert map_incoming([entry], sent) == topic
    # And the other way round, for what the remote side publishes.
    assert map_outgoing([entry], map_incoming([entry], remote + rest)) == remote + rest
