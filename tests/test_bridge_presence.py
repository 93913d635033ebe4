"""Presence upstream through the bridge (issue 64): this server in a subprocess with
``--bridge`` sending ``$SYS/presence/#`` out at QoS 1 to a real Mosquitto, 50 devices
with a 2 s keep-alive; the remote is stopped (SIGSTOP: it keeps its retained store), a
tenth of the devices go silent and time out on the edge, the remote resumes. Within one
keep-alive of the bridge's return the remote's *retained* view must be the edge's: those
offline with reason keepalive-timeout and the edge's times, the others online; the
edge's notification topic says 1, 0, 1. Real processes and clock; every wait bounded.

Two things make it converge: live presence goes out flagged retained (a Retain As
Published subscriber such as the bridge keeps the flag), and, as Mosquitto's bridge,
each connection to the remote is sent the local retained messages of the out topics
again (the registry's presence among them), so what happened while the link was down
reaches the remote however it went.

The remote prefix: Mosquitto denies any client's PUBLISH to ``$SYS/...`` (but
``$SYS/broker/connection/...``), so ``topic $SYS/presence/# out 1`` as such is refused
there message by message ("Denied PUBLISH" in its log); the bridge maps it to
``edge/presence/`` (:data:`benchmarks.bridge_presence.REMOTE`).
"""

from __future__ import annotations

from benchmarks.bridge_presence import bridge_url, measure
from servers.heartbeat.bridge import parse_bridge

from .mosquitto_peer import require_mosquitto


def test_the_url_sends_local_presence_out_at_qos_1_under_the_remote_prefix() -> None:
    spec = parse_bridge(bridge_url(1883))
    assert spec.text() == parse_bridge(spec.text()).text()
    (topic,) = spec.topics
    assert (topic.pattern, topic.direction, topic.qos) == ("#", "out", 1)
    assert (topic.local_prefix, topic.remote_prefix) == ("$SYS/presence/", "edge/presence/")


async def test_the_remotes_retained_presence_converges_after_the_link_returns() -> None:
    require_mosquitto()
    result = await measure(50, keep_alive=2, fraction=0.1, bridge_keepalive=5)
    assert result.broken_devices == 0
    assert result.edge_notifications[-3:] == ["1", "0", "1"]
    assert result.silent == 5
    assert result.retained_online_before == 50, "the remote retained every device online"
    assert result.converge_seconds is not None and result.within_keep_alive, result
    assert result.retained_after == 50 and result.retained_correct, result
