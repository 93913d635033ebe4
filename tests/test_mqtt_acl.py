"""The Mosquitto-format ACL file: parsing, Mosquitto 2.0's rule order, reload, and cases confirmed on Mosquitto."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servers.heartbeat.security import acl as acl_module
from servers.heartbeat.security.acl import Access, AclFile, AclFileError, Rule


def rules_of(text: str) -> list[tuple[bool, str | None, Access, str]]:
    return [(r.pattern, r.username, r.access, r.topic) for r in AclFile.parse(text).rules]


# --- parsing ------------------------------------------------------------------------


def test_each_keyword_and_access_word() -> None:
    text = """
topic read r
topic write w
topic readwrite rw
topic deny d
topic plain
user alice
topic read alice/#
pattern write out/%c
user bob
topic deny bob/x
"""
    assert rules_of(text) == [
        (False, None, Access.READ, "r"),
        (False, None, Access.WRITE, "w"),
        (False, None, Access.READWRITE, "rw"),
        (False, None, Access.DENY, "d"),
        (False, None, Access.READWRITE, "plain"),
        (False, "alice", Access.READ, "alice/#"),
        # A pattern belongs to no section, wherever it stands.
        (True, None, Access.WRITE, "out/%c"),
        (False, "bob", Access.DENY, "bob/x"),
    ]
    assert [r.line for r in AclFile.parse(text).rules] == [2, 3, 4, 5, 6, 8, 9, 11]


def test_comments_blank_lines_and_whitespace() -> None:
    text = "# a comment\n\n   \n  # indented comment\n\t topic read a  \r\n#topic read b\nuser  carol  \r\ntopic c\n"
    assert rules_of(text) == [(False, None, Access.READ, "a"), (False, "carol", Access.READWRITE, "c")]


def test_topic_with_spaces_follows_the_access_word() -> None:
    assert rules_of("topic read  with space/a b \n") == [(False, None, Access.READ, "with space/a b")]
    assert rules_of("user bob smith\ntopic x\n") == [(False, "bob smith", Access.READWRITE, "x")]


def test_a_lone_access_word_is_the_topic() -> None:
    # Confirmed on Mosquitto: "topic read" grants readwrite on the topic named "read".
    assert rules_of("topic read\ntopic deny\n") == [
        (False, None, Access.READWRITE, "read"),
        (False, None, Access.READWRITE, "deny"),
    ]
    # Only a space separates fields, so this is one word: the topic "read\ta".
    assert rules_of("topic read\ta\n") == [(False, None, Access.READWRITE, "read\ta")]


def test_empty_file_denies_everything() -> None:
    rules = AclFile.parse("# nothing\n")
    assert rules.rules == ()
    assert not rules.can_publish(None, "c", "a")
    assert not rules.can_read("u", "c", "a")


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("topic read a\nfoo bar\n", 2, "unknown keyword 'foo'"),
        ("Topic read a\n", 1, "unknown keyword 'Topic'"),
        ("topic\tread a\n", 1, "unknown keyword"),
        ("\n\ntopic foo bar\n", 3, "bad access 'foo'"),
        ("topic reads a\n", 1, "bad access 'reads'"),
        ("user\n", 1, "needs a username"),
        ("user   \n", 1, "needs a username"),
        ("topic\n", 1, "needs a topic"),
        ("pattern   \n", 1, "needs a topic"),
        ("topic read a/#/b\n", 1, "invalid topic 'a/#/b'"),
        ("topic read a+/b\n", 1, "invalid topic"),
        ("pattern read a/b#\n", 1, "invalid topic"),
        ("topic read " + "/".join(["a"] * 202) + "\n", 1, "invalid topic"),
    ],
)
def test_errors_name_the_file_and_line(text: str, line: int, words: str) -> None:
    with pytest.raises(AclFileError, match=re.escape(f"acl.conf:{line}: ") + ".*" + re.escape(words)):
        AclFile.parse(text, "acl.conf")


def test_limits_match_mosquitto() -> None:
    # 200 separators (201 levels) is Mosquitto's limit; 201 is refused (above).
    assert len(AclFile.parse("topic read " + "/".join(["a"] * 201)).rules) == 1


def test_load_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text("topic read a\nuser bob\ntopic b\n")
    rules = AclFile.load(path)
    assert rules.path == str(path)
    assert rules.can_read(None, "c", "a") and rules.can_publish("bob", "c", "b")
    path.write_bytes(b"topic read a\ntopic read \xff\n")
    with pytest.raises(AclFileError, match=re.escape(f"{path}:2: not UTF-8")):
        AclFile.load(path)
    with pytest.raises(AclFileError, match="cannot read"):
        AclFile.load(tmp_path / "missing")


# --- who gets which rules -----------------------------------------------------------


def test_anonymous_section_is_for_clients_without_username() -> None:
    rules = AclFile.parse("topic anon/#\nuser alice\ntopic alice/#\n")
    assert rules.can_publish(None, "c", "anon/x")
    # A zero-length username is no username (confirmed on Mosquitto).
    assert rules.can_publish("", "c", "anon/x")
    assert not rules.can_publish(None, "c", "alice/x")
    # A named user gets its own section only, never the anonymous one.
    assert rules.can_publish("alice", "c", "alice/x")
    assert not rules.can_publish("alice", "c", "anon/x")
    assert not rules.can_publish("carol", "c", "anon/x")


def test_repeated_user_sections_merge() -> None:
    rules = AclFile.parse("user alice\ntopic read a\nuser bob\ntopic b\nuser alice\ntopic write a\n")
    assert rules.can_read("alice", "c", "a") and rules.can_publish("alice", "c", "a")
    assert not rules.can_read("alice", "c", "b")


def test_patterns_substitute_client_id_and_username() -> None:
    rules = AclFile.parse("pattern readwrite devices/%c/#\npattern read users/%u/inbox\npattern write pre%%c/%u-%c\n")
    assert rules.can_publish(None, "d1", "devices/d1/state")
    assert rules.can_publish("alice", "d1", "devices/d1")
    assert not rules.can_publish(None, "d1", "devices/d2/state")
    assert rules.can_read("alice", "d1", "users/alice/inbox")
    assert not rules.can_publish("alice", "d1", "users/alice/inbox")
    assert not rules.can_read("alice", "d1", "users/bob/inbox")
    # %u patterns do not apply to anonymous clients, not even as an empty level.
    assert not rules.can_read(None, "d1", "users//inbox")
    assert not rules.can_read("", "d1", "users//inbox")
    # Placeholders are replaced left to right: "%%c" is "%" then the client id.
    assert rules.can_publish("al", "d1", "pre%d1/al-d1")
    assert not rules.can_publish(None, "d1", "pre%d1/-d1")


def test_wildcards_in_ids_disable_patterns_but_not_sections() -> None:
    rules = AclFile.parse(
        "topic anon/#\nuser alice\ntopic alice/#\npattern readwrite devices/%c/#\npattern everyone/#\n"
    )
    for username, client_id in ((None, "x+y"), (None, "x#"), ("a+", "c"), ("a#", "c")):
        assert not rules.can_publish(username, client_id, "everyone/1")
    # The client's own section is checked before the patterns, so it still applies.
    assert rules.can_publish(None, "x+y", "anon/1")
    assert rules.can_publish("alice", "x#", "alice/1")
    # Mosquitto 2.0 refused only + and #, so a "/" in a client id spanned levels: id
    # "a/b" wrote into client "a"'s tree (issue 33). A %c rule no longer applies to it;
    # a pattern without %c still does.
    assert not rules.can_publish(None, "a/b", "devices/a/b/x")
    assert not rules.can_publish(None, "a/b", "devices/a/b")
    assert rules.can_publish(None, "a/b", "everyone/1")


def test_a_separator_or_a_control_in_an_id_or_username_takes_away_only_its_own_patterns() -> None:
    # The two attacks: "sensor1/cmd" under devices/%c/#, and alice as "sensor1/bob"
    # under devices/%c/%u/#, writing into bob's tree.
    rules = AclFile.parse(
        "pattern readwrite devices/%c/#\npattern readwrite devices/%c/%u/#\npattern readwrite users/%u/#\n"
    )
    assert not rules.can_publish(None, "sensor1/cmd", "devices/sensor1/cmd")
    assert not rules.can_read(None, "sensor1/cmd", "devices/sensor1/cmd")
    assert not rules.can_read_filter(None, "sensor1/cmd", "devices/sensor1/cmd/#")
    assert not rules.can_publish("alice", "sensor1/bob", "devices/sensor1/bob/alice/x")
    assert rules.can_publish("alice", "sensor1/bob", "users/alice/x")  # her own %u rule still holds
    for bad in ("a/b", "a\x01b", "a\x7fb", "a\x85b"):
        assert not rules.can_publish(bad, "c1", f"users/{bad}/x")  # as a username
        assert rules.can_publish(bad, "c1", "devices/c1/x")  # the %c rules do not name it
    assert rules.can_publish("bob", "sensor1", "devices/sensor1/bob/x")


def test_patterns_without_placeholders_apply_to_everyone() -> None:
    rules = AclFile.parse("user alice\ntopic alice/#\npattern read news/#\n")
    assert rules.can_read(None, "c", "news/1") and rules.can_read("alice", "c", "news/1")
    assert rules.can_read("carol", "c", "news/1") and not rules.can_publish("carol", "c", "news/1")


# --- rule order ---------------------------------------------------------------------


def test_deny_wins_within_a_section_wherever_it_stands() -> None:
    rules = AclFile.parse("topic a/#\ntopic deny a/secret\ntopic deny b/+\ntopic b/#\n")
    assert rules.can_publish(None, "c", "a/open")
    assert not rules.can_publish(None, "c", "a/secret") and not rules.can_read(None, "c", "a/secret")
    assert not rules.can_read(None, "c", "b/x")
    assert rules.can_read(None, "c", "b/x/y")
    same = AclFile.parse("topic exact\ntopic deny exact\n")
    assert not same.can_publish(None, "c", "exact") and not same.can_read(None, "c", "exact")


def test_pattern_deny_wins_over_pattern_grant() -> None:
    rules = AclFile.parse("pattern readwrite devices/%c/#\npattern deny devices/%c/locked\n")
    assert rules.can_publish(None, "d1", "devices/d1/open")
    assert not rules.can_publish(None, "d1", "devices/d1/locked")


def test_section_grant_wins_over_pattern_deny() -> None:
    # Mosquitto checks the client's section (denies, then grants) before any pattern,
    # so a pattern deny cannot take away what the section grants (confirmed).
    rules = AclFile.parse("user alice\ntopic devices/#\npattern deny devices/%c/locked\n")
    assert rules.can_publish("alice", "d1", "devices/d1/locked")
    assert not rules.can_publish("bob", "d1", "devices/d1/locked")


def test_a_grant_without_the_access_asked_for_does_not_decide() -> None:
    rules = AclFile.parse("topic read box/#\ntopic write box/in\npattern write box/%c\n")
    assert rules.can_publish(None, "c", "box/in") and rules.can_read(None, "c", "box/in")
    assert not rules.can_publish(None, "c", "box/out")
    # The section grants only read on box/c; the pattern supplies the write.
    assert rules.can_publish(None, "c", "box/c")


# --- $ topics, odd topics and subscriptions -----------------------------------------


def test_dollar_topics() -> None:
    rules = AclFile.parse(
        "user god\ntopic readwrite #\ntopic readwrite $SYS/#\ntopic readwrite $SYSTEM/#\ntopic $x/#\n"
    )
    # A filter starting with a wildcard never matches a $ topic.
    assert rules.can_publish("god", "c", "a/b") and not rules.can_publish("god", "c", "$y")
    assert rules.can_publish("god", "c", "$x/1") and rules.can_read("god", "c", "$x/1")
    # Mosquitto refuses any PUBLISH under $SYS (a plain prefix test, so $SYSTEM too),
    # whatever the file says, except a bridge's connection state; reading is the file's.
    assert not rules.can_publish("god", "c", "$SYS/foo")
    assert not rules.can_publish("god", "c", "$SYSTEM/x")
    assert rules.can_publish("god", "c", "$SYS/broker/connection/b1/state")
    assert rules.can_read("god", "c", "$SYS/foo") and rules.can_read("god", "c", "$SYSTEM/x")
    share = AclFile.parse("topic $share/#\n")
    assert not share.can_publish(None, "c", "$share/g/t") and not share.can_read(None, "c", "$share/g/t")


def test_topics_with_wildcards_or_empty_are_refused() -> None:
    rules = AclFile.parse("topic #\n")
    assert rules.can_publish(None, "c", "a") and rules.can_publish(None, "c", "/")
    for topic in ("", "a/+", "#", "a/#"):
        assert not rules.can_publish(None, "c", topic) and not rules.can_read(None, "c", topic)


@pytest.mark.parametrize("topic_filter", ["#", "alice/#", "$SYS/#", "shared/+/info", "nothing/+", "x"])
def test_subscriptions_are_never_refused(topic_filter: str) -> None:
    # Mosquitto 2.0 grants every SUBSCRIBE and filters each message at delivery
    # (every SUBACK was granted on Mosquitto 2.0.11, even for "#" with no rules).
    for text in ("", "topic read public/#\n", "topic deny #\n"):
        assert AclFile.parse(text).can_subscribe(None, "c", topic_filter)
        assert AclFile.parse(text).can_subscribe("alice", "c", topic_filter)


# --- confirmed on Mosquitto 2.0.11 --------------------------------------------------

# Each client below published on every topic (QoS 1; a client with read access to
# everything reported what got through) and subscribed to "#", "$other/#", "$SYS/#"
# and "$SYSTEM/#" while a client allowed to write everywhere published on each topic,
# once retained before the subscription and once live; both deliveries agreed.
MOSQUITTO_ACL = """# anonymous section
topic read public/#
topic write public/box
topic anon/rw
topic read
topic deny public/secret
topic readwrite with space/a b

user alice
topic readwrite alice/#
topic deny alice/private
topic read shared/+/info
topic readwrite devices/#

user spy
topic read #
topic read $other/#
topic read $SYS/#
topic read $SYSTEM/#

user god
topic write #
topic write $other/#
topic write $SYS/#
topic write $SYSTEM/#

user alice
topic write alice-again/x

user dave
topic readwrite #

pattern readwrite devices/%c/#
pattern deny devices/%c/locked
pattern read users/%u/inbox
pattern write out/%u/%c
pattern readwrite everyone/#
pattern readwrite pre%%c/x
"""

MOSQUITTO_TOPICS = [
    *("public/x", "public/box", "public/secret", "anon/rw", "read", "with space/a b", "alice/x", "alice/private"),
    *("alice-again/x", "shared/a/info", "shared/a/b/info", "devices/c1/x", "devices/c1/locked", "devices/anon1/x"),
    *("devices/anon1/locked", "devices/a/b/x", "users/alice/inbox", "users/carol/inbox", "users//inbox"),
    *("out/alice/c1", "out/carol/carol1", "out//anon1", "everyone/1", "$other/x", "$SYS/foo", "$SYSTEM/x"),
    *("$SYS/broker/connection/x/state", "nothing/here", "devices/carol1/x", "devices/d1/x", "devices/dave1/x"),
    *("pre%anon1/x", "devices", "devices/c1", "users/dave/inbox"),
]

_ANON = ["public/box", "anon/rw", "read", "with space/a b"]
_ALL_PLAIN = [t for t in MOSQUITTO_TOPICS if not t.startswith("$")]
_ALICE_DEVICES = ["devices/c1/x", "devices/c1/locked", "devices/anon1/x", "devices/anon1/locked", "devices/a/b/x"]
_ALICE_DEVICES += ["everyone/1", "devices/carol1/x", "devices/d1/x", "devices/dave1/x", "devices", "devices/c1"]

# (username, client id) -> (topics it could publish on, topics it received)
MOSQUITTO_OBSERVED: dict[tuple[str | None, str], tuple[list[str], list[str]]] = {
    (None, "anon1"): (
        [*_ANON, "devices/anon1/x", "everyone/1", "pre%anon1/x"],
        ["public/x", *_ANON, "devices/anon1/x", "everyone/1", "pre%anon1/x"],
    ),
    (None, "x+y"): (_ANON, ["public/x", *_ANON]),
    # Mosquitto 2.0 also gave it devices/a/b/x, a tree of client id "a"'s (issue 33: the id
    # reached past its own level); 2.1 and this server apply no %c rule to an id with "/".
    (None, "a/b"): ([*_ANON, "everyone/1"], ["public/x", *_ANON, "everyone/1"]),
    ("", "e1"): ([*_ANON, "everyone/1"], ["public/x", *_ANON, "everyone/1"]),
    ("alice", "c1"): (
        ["alice/x", "alice-again/x", "out/alice/c1", *_ALICE_DEVICES],
        ["alice/x", "shared/a/info", "users/alice/inbox", *_ALICE_DEVICES],
    ),
    ("carol", "carol1"): (
        ["out/carol/carol1", "everyone/1", "devices/carol1/x"],
        ["users/carol/inbox", "everyone/1", "devices/carol1/x"],
    ),
    ("carol", "bad#id"): ([], []),
    ("u+x", "d1"): ([], []),
    ("dave", "dave1"): (_ALL_PLAIN, _ALL_PLAIN),
    ("god", "god2"): ([*_ALL_PLAIN, "$other/x", "$SYS/broker/connection/x/state"], ["everyone/1"]),
    ("spy", "spy2"): (["everyone/1"], [*_ALL_PLAIN, "$other/x", "$SYS/broker/connection/x/state"]),
}
# What god could publish is all that the others could be seen to receive.
_DELIVERED = [t for t in MOSQUITTO_TOPICS if t in MOSQUITTO_OBSERVED["god", "god2"][0]]


@pytest.mark.parametrize(("username", "client_id"), list(MOSQUITTO_OBSERVED))
def test_answers_as_mosquitto_did(username: str | None, client_id: str) -> None:
    rules = AclFile.parse(MOSQUITTO_ACL)
    published, received = MOSQUITTO_OBSERVED[username, client_id]
    assert [t for t in MOSQUITTO_TOPICS if rules.can_publish(username, client_id, t)] == sorted(
        published, key=MOSQUITTO_TOPICS.index
    )
    assert [t for t in _DELIVERED if rules.can_read(username, client_id, t)] == sorted(
        received, key=MOSQUITTO_TOPICS.index
    )
    for topic_filter in ("#", "$other/#", "$SYS/#", "$SYSTEM/#", "alice/#", "shared/#", "nothing/+"):
        assert rules.can_subscribe(username, client_id, topic_filter)


# --- reload and the per-client cache ------------------------------------------------


def test_reload_keeps_old_rules_on_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text("topic read a\n")
    old = AclFile.load(path)
    path.write_text("topic read b\n")
    new = old.reload()
    assert new.can_read(None, "c", "b") and not new.can_read(None, "c", "a")
    assert old.can_read(None, "c", "a")
    path.write_text("topic read c\ntopic bogus c d\n")
    with pytest.raises(AclFileError, match=":2: "):
        new.reload()
    assert new.can_read(None, "c", "b") and not new.can_read(None, "c", "c")
    path.unlink()
    with pytest.raises(AclFileError):
        new.reload()
    assert new.can_read(None, "c", "b")
    with pytest.raises(ValueError):
        AclFile.parse("topic a\n").reload()


def test_pattern_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acl_module, "_CACHE_LIMIT", 8)
    rules = AclFile.parse("pattern devices/%c/#\n")
    for round_ in range(3):
        for i in range(20):
            assert rules.can_publish(None, f"d{i}", f"devices/d{i}/x")
            assert not rules.can_publish(None, f"d{i}", f"devices/d{i + 1}/x"), round_
            assert len(rules._expanded) <= 8


# --- property: the indexed rules answer as a plain scan in Mosquitto's order --------


def ref_match(topic_filter: str, topic: str) -> bool:
    """MQTT matching written out level by level, with Mosquitto's $ rule."""
    if topic.startswith("$") != topic_filter.startswith("$"):
        return False
    parts, levels = topic_filter.split("/"), topic.split("/")

    def go(i: int, j: int) -> bool:
        if i == len(parts):
            return j == len(levels)
        if parts[i] == "#":
            return True
        return j < len(levels) and parts[i] in ("+", levels[j]) and go(i + 1, j + 1)

    return go(0, 0)


def ref_allowed(rules: list[Rule], username: str | None, client_id: str, topic: str, want: Access) -> bool:
    """Mosquitto's order as a linear scan: the section's denies, its grants, then the patterns likewise."""
    username = username or None

    def scan(candidates: list[tuple[str, Access]]) -> bool | None:
        for topic_filter, access in [c for c in candidates if not c[1]] + [c for c in candidates if c[1]]:
            if ref_match(topic_filter, topic):
                if not access:
                    return False
                if want & access:
                    return True
        return None

    own = scan([(r.topic, r.access) for r in rules if not r.pattern and r.username == username])
    if own is not None:
        return own
    patterns = [r for r in rules if r.pattern]
    if not patterns or any(c in s for s in (client_id, username or "") for c in "+#"):
        return False
    subs = {"%c": client_id, "%u": username or ""}

    def unsafe(value: str | None) -> bool:  # a level separator, NUL or a control character
        return value is not None and any(c == "/" or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in value)

    def applies(placeholders: list[str]) -> bool:
        if "%u" in placeholders and (username is None or unsafe(username)):
            return False
        return not ("%c" in placeholders and unsafe(client_id))

    expanded = [
        (re.sub("%[cu]", lambda m: subs[m.group()], r.topic), r.access)
        for r in patterns
        if applies(re.findall("%[cu]", r.topic))
    ]
    return scan(expanded) is True


# Small alphabets, so that rules overlap and clients and topics hit them often.
_LEVEL = st.sampled_from(["a", "", "+", "%c", "%u", "x%c"])
_ACCESS = st.sampled_from(["read", "write", "readwrite", "deny", "deny", ""])


@st.composite
def acl_rules(draw: st.DrawFn) -> tuple[str, list[tuple[bool, str | None, Access, str]]]:
    """Random rules and the file text that says them."""
    lines: list[str] = []
    expected: list[tuple[bool, str | None, Access, str]] = []
    for section in (None, "u1", "u2", "patterns"):
        if section not in (None, "patterns"):
            lines.append(f"user {section}")
        for _ in range(draw(st.integers(0, 4))):
            levels = draw(st.lists(_LEVEL, min_size=1, max_size=3))
            if draw(st.booleans()):
                levels.append("#")
            if draw(st.booleans()):
                levels[0] = "$s"
            topic = "/".join(levels)
            if topic in ("", "read", "write", "readwrite", "deny"):
                topic = "z"
            word = draw(_ACCESS)
            keyword = "pattern" if section == "patterns" else "topic"
            lines.append(f"{keyword} {word} {topic}" if word else f"{keyword} {topic}")
            access = {"read": Access.READ, "write": Access.WRITE, "deny": Access.DENY}.get(word, Access.READWRITE)
            expected.append((section == "patterns", None if section == "patterns" else section, access, topic))
    return "\n".join(lines) + "\n", expected


_TOPICS = st.lists(st.sampled_from(["a", "", "c", "$s", "xc", "u1"]), min_size=1, max_size=4).map("/".join)
_CLIENTS = st.tuples(st.sampled_from([None, "", "u1", "u2", "u3", "x+"]), st.sampled_from(["a", "c", "c/a", "e#"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(acl_rules(), st.lists(st.tuples(_CLIENTS, _TOPICS), min_size=1, max_size=20))
def test_indexed_rules_agree_with_a_plain_scan(
    generated: tuple[str, list[tuple[bool, str | None, Access, str]]],
    queries: list[tuple[tuple[str | None, str], str]],
) -> None:
    text, expected = generated
    parsed = AclFile.parse(text)
    assert [(r.pattern, r.username, r.access, r.topic) for r in parsed.rules] == expected
    for (username, client_id), topic in queries:
        if not topic:
            continue
        for want, check in ((Access.READ, parsed.can_read), (Access.WRITE, parsed.can_publish)):
            assert check(username, client_id, topic) == ref_allowed(
                list(parsed.rules), username, client_id, topic, want
            )


# -- subscriptions: a filter is granted only if a read rule covers all of it -----------

_COVER_ACL = AclFile.parse(
    "topic read public/#\nuser alice\ntopic readwrite alice/#\npattern read devices/%c/#\npattern deny devices/%c/fw\n"
)


@pytest.mark.parametrize(
    ("username", "client_id", "topic_filter", "granted"),
    [
        ("alice", "c1", "alice/#", True),
        ("alice", "c1", "alice/+/x", True),
        ("alice", "c1", "alice", True),  # "alice/#" matches its parent too
        ("alice", "c1", "#", False),
        ("alice", "c1", "+/status", False),
        ("alice", "c1", "devices/c1/#", True),  # the deny inside it is applied per message
        ("alice", "c1", "devices/c2/#", False),
        ("alice", "c1", "public/#", False),  # the anonymous section is not alice's
        (None, "x", "public/#", True),
        (None, "x", "#", False),
        (None, "a+b", "devices/a+b/#", False),  # a wildcard in the id: no patterns for it
    ],
)
def test_a_subscription_needs_a_read_rule_covering_the_whole_filter(
    username: str | None, client_id: str, topic_filter: str, granted: bool
) -> None:
    assert _COVER_ACL.can_read_filter(username, client_id, topic_filter) is granted


_level = st.sampled_from(["a", "b", "+"])


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_level, min_size=1, max_size=3),
    st.booleans(),
    st.lists(_level, min_size=1, max_size=3),
    st.booleans(),
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=4),
)
def test_a_covered_filter_matches_nothing_its_grant_does_not(
    grant: list[str], grant_hash: bool, wanted: list[str], wanted_hash: bool, topic: list[str]
) -> None:
    from servers.heartbeat.mqtt.filters import topic_matches

    g = "/".join(grant + (["#"] if grant_hash else []))
    f = "/".join(wanted + (["#"] if wanted_hash else []))
    t = "/".join(topic)
    if acl_module._covers(g, f) and topic_matches(f, t):
        assert topic_matches(g, t), (g, f, t)
