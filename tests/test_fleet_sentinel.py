"""A fleet on Redis Sentinel (issue 32): two gateways find the primary through three
Sentinels (real ``redis-server --sentinel`` processes) and follow it when it is
SIGKILLed, or SIGSTOPped past its failover and then let run again, with devices
connected, connecting, leaving and roaming meanwhile. Presence stays exactly once per
session: checked per device over both gateways' logs (:mod:`loadtest.history`), and
the new primary's registry re-asserted."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.device_results import read_presence_log
from loadtest.history import check_history, merged_by_time
from loadtest.redis_sentinel import SentinelSet
from servers.heartbeat.coordination.fleet.target import parse_target
from servers.heartbeat.mqtt import encoders

from .conftest import wait_closed
from .redis_server import require_binary
from .test_fleet_faults import get, kill_gateways, start_gateways
from .test_heartbeat_clients import raw_connect, subscriber
from .test_presence_faults import heard, until


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    require_binary()
    group = SentinelSet(replicas=2, sentinels=3, quorum=2, down_after=1000)
    group.start()
    yield group
    group.stop()


def metric(status_port: int, name: str, host: str = "127.0.0.1") -> float:
    _, body = get(f"http://{host}:{status_port}/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_fleet_follows_a_sentinel_failover_and_presence_stays_exactly_once(
    sentinels: SentinelSet, tmp_path: Path, fault: str
) -> None:
    # Killed: the machine is gone (SIGKILL). Stalled: it hangs (SIGSTOP) long enough to be
    # failed over, then runs again and is made a replica of the new primary.
    gateways = start_gateways(sentinels.url, tmp_path)
    try:
        (_, port0, status0, log0), (_, port1, status1, log1) = gateways
        watch, got = subscriber(port1, "dashboard", "$SYS/presence/#")
        time.sleep(0.3)
        on0 = {f"a-{i}": raw_connect(port0, f"a-{i}", keep_alive=60, v5=i % 2 == 1) for i in range(20)}
        on1 = {f"b-{i}": raw_connect(port1, f"b-{i}", keep_alive=60) for i in range(20)}
        until(lambda: heard(got, "online") >= set(on0) | set(on1), 10, "the dashboard hears both gateways")

        old = sentinels.primary_port()
        assert old == sentinels.primary.port
        stalled = sentinels.stall_primary() if fault == "stalled" else None
        if stalled is None:
            sentinels.kill_primary()  # by PID
        # While the Sentinels decide: a device leaves, another arrives, a third roams.
        on0.pop("a-0").sendall(encoders.encode_disconnect())
        late = raw_connect(port1, "late", keep_alive=60)  # keep-alive never waits on Redis
        roamer = raw_connect(port1, "a-2", keep_alive=60)  # a-2 moves from gw0 to gw1
        gap = sentinels.wait_failover(old)
        assert gap < 15, gap
        if stalled is not None:
            sentinels.resume(stalled)  # back, with writes it took before the stall, and demoted

        # Both gateways find the new primary, notice it is another server, and re-assert.
        for status in (status0, status1):
            until(lambda s=status: get(f"http://127.0.0.1:{s}/healthz")[1] == b"ok\n", 20, "healthz ok")
            until(lambda s=status: metric(s, "heartbeat_fleet_redis_server_changes_total") >= 1, 30, "the change seen")
        until(lambda: "a-0" in heard(got, "offline"), 15, "the offline made during the failover")
        until(lambda: "late" in heard(got, "online"), 15, "the online made during the failover")
        wait_closed(on0.pop("a-2"), 10)  # taken over by its new connection, across gateways
        for device, where in (("a-5", status1), ("b-5", status0), ("late", status0)):
            status, body = get(f"http://127.0.0.1:{where}/devices/{device}")  # the new primary's registry
            assert status == 200 and json.loads(body)["status"] == "online", (device, body)
        assert not heard(got, "offline") & ((set(on0) | set(on1)) - {"a-0", "a-2"}), "a healthy device went offline"

        for proc, *_ in gateways:
            proc.send_signal(signal.SIGTERM)
        for proc, *_ in gateways:
            assert proc.wait(timeout=20) == 0
        merged = merged_by_time(read_presence_log(log0) or [], read_presence_log(log1) or [])
        history = check_history(merged, lease=6, reannounced_copies=True)
        assert history.ok, history.summary()
        assert history.devices >= 42, history.summary()
        for sock in [*on0.values(), *on1.values(), late, roamer, watch]:
            sock.close()
    finally:
        kill_gateways(gateways)


def test_sentinel_urls_are_read_or_refused_with_the_reason() -> None:
    target = parse_target("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2:26380/presence/2")
    assert target.sentinel and target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380))
    assert (target.service, target.db, target.password) == ("presence", 2, "s3cret")
    assert "s3cret" not in target.describe()
    plain = parse_target("redis://:pw@127.0.0.1:6379/0")
    assert not plain.sentinel and plain.describe() == "redis://127.0.0.1:6379/0"
    for bad, why in [
        ("127.0.0.1:6379", "expected redis://"),
        ("memcached://x:1", "unknown scheme"),
        ("redis+sentinel://10.0.0.1/presence", "host:port"),
        ("redis+sentinel://10.0.0.1:99999/presence", "out of range"),
        ("redis+sentinel://10.0.0.1:26379", "service name"),
        ("redis+sentinel://10.0.0.1:26379/presence/x", "not a number"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_target(bad)
