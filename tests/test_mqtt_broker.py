"""The broker: MQTT topic matching, and subscriptions routed exactly or by wildcard."""

from __future__ import annotations

import pytest

from servers.heartbeat.broker import subscriptions
from servers.heartbeat.broker.subscriptions import Subscriptions
from servers.heartbeat.mqtt.filters import topic_matches
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE


@pytest.mark.parametrize(
    ("topic_filter", "topic", "match"),
    [
        # The spec's examples (4.7.1).
        ("sport/tennis/player1/#", "sport/tennis/player1", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
        ("sport/tennis/player1/#", "sport/tennis/player2", False),
        ("sport/#", "sport", True),
        ("sport/tennis/+", "sport/tennis/player1", True),
        ("sport/tennis/+", "sport/tennis/player2", True),
        ("sport/tennis/+", "sport/tennis/player1/ranking", False),
        ("sport/+", "sport", False),
        ("sport/+", "sport/", True),
        ("+/tennis/#", "sport/tennis/player1", True),
        ("+/+", "/finance", True),
        ("/+", "/finance", True),
        ("+", "/finance", False),
        ("+", "finance", True),
        ("#", "finance", True),
        ("#", "a/b/c", True),
        ("#", "/", True),
        # $-topics are not for wildcard-first filters (4.7.2).
        ("#", "$SYS/broker/clients", False),
        ("+/monitor/Clients", "$SYS/monitor/Clients", False),
        ("$SYS/#", "$SYS/broker/clients", True),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
        ("$SYS/+/Clients", "$SYS/monitor/Clients", True),
        # Plain filters, and case and level-count sensitivity.
        (f"{PRESENCE}#", f"{PRESENCE}dev-1", True),
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/b", "A/b", False),
        ("a/b", "a/b/c", False),
        ("a/b/c", "a/b", False),
        ("a/+/c", "a/b/c", True),
        ("a/+/c", "a//c", True),
        ("a/+/c", "a/b/d", False),
    ],
)
def test_topic_matches(topic_filter: str, topic: str, match: bool) -> None:
    assert topic_matches(topic_filter, topic) is match


def test_subscriptions_route_exact_and_wildcards() -> None:
    subs: Subscriptions[str] = Subscriptions(max_qos=1)
    assert subs.subscribe("a", f"{PRESENCE}#", 2) == 1
    subs.subscribe("b", f"{PRESENCE}dev-1", 0)
    subs.subscribe("c", "other/+", 0)
    assert subs.route(f"{PRESENCE}dev-1") == {"a": 1, "b": 0}
    assert subs.route("other/x") == {"c": 0}
    assert subs.route("other/x/y") == {}
    subs.drop("a")
    assert subs.route(f"{PRESENCE}dev-1") == {"b": 0}
    assert subs.unsubscribe("b", f"{PRESENCE}dev-1")
    assert not subs.unsubscribe("b", f"{PRESENCE}dev-1")
    assert len(subs) == 1 and not subs.has("b")


def test_granted_qos_is_capped_at_max_qos() -> None:
    subs: Subscriptions[str] = Subscriptions(max_qos=0)
    assert subs.subscribe("k", "a/+", 1) == 0
    assert subs.route("a/b") == {"k": 0}


def test_routes_are_remembered_within_a_bound_and_forgotten_on_any_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscriptions, "_ROUTE_MEMO", 50)
    subs: Subscriptions[str] = Subscriptions(max_qos=2)
    subs.subscribe("a", "t/+", 1)
    first = subs.route("t/x")
    assert first == {"a": 1} and subs.route("t/x") is first  # remembered
    for i in range(200):
        subs.route(f"t/{i}")
        assert subs._routed <= 50 and len(subs._routes) <= 50
    subs.subscribe("b", "t/x", 2)  # a change: found afresh
    assert subs.route("t/x") == {"a": 1, "b": 2}
    subs.subscribe("a", "t/+", 0)  # a new QoS for a held filter is a change too
    assert subs.route("t/x") == {"a": 0, "b": 2}
    subs.drop("b")
    assert subs.route("t/x") == {"a": 0}
    # A topic nobody wants is not remembered: a device's own topics would fill the memo.
    before = dict(subs._routes)
    assert subs.route("nobody/dev-1") == {} and subs._routes == before
