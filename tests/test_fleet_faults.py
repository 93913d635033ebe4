"""A fleet of two gateways on a real Redis, as their own processes, through the
faults of a fleet: a device roaming between gateways, a gateway killed with
SIGKILL, Redis restarted (empty) with devices connected. Each check counts every
device's events: exactly one offline per session, none for healthy devices."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.device_results import read_presence_log
from loadtest.history import check_history, merged_by_time
from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE

from .conftest import wait_closed
from .redis_server import RedisServer, require_binary
from .test_heartbeat_clients import raw_connect, subscriber
from .test_presence_faults import heard, until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer(binary=require_binary())
    server.start()
    yield server
    server.stop()


Gateway = tuple[subprocess.Popen[str], int, int, Path]
"""A gateway process, its MQTT port, its status port and its presence log."""


def start_gateways(url: str, tmp_path: Path, n: int = 2, *, stderr: bool = False) -> list[Gateway]:
    """``n`` gateways on the fleet at ``url`` (``gw0``...), each one worker, lease 3 s;
    with ``stderr``, each one's stderr (its log) is kept in ``gw<i>.stderr`` too."""
    gateways = []
    for i in range(n):
        port, status = free_port(), free_port()
        log = tmp_path / f"gw{i}.jsonl"
        args = ["--cluster", url, "--node", f"gw{i}", "--presence-log", str(log)]
        args += ["--tick", "0.05", "--status-port", str(status), "--lease", "3"]
        kept = tmp_path / f"gw{i}.stderr" if stderr else None
        gateways.append((start_heartbeat(port, 1, args, cwd=str(ROOT), log=kept), port, status, log))
    return gateways


def kill_gateways(gateways: list[Gateway]) -> None:
    """SIGKILL (by PID) any that still run: what a failed test leaves."""
    for proc, *_ in gateways:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_fleet_survives_a_roaming_device_a_killed_gateway_and_a_redis_restart(
    redis: RedisServer, tmp_path: Path
) -> None:
    gateways = start_gateways(redis.url, tmp_path)
    try:
        (gw0, port0, _, _), (gw1, port1, status1, log1) = gateways
        watch, got = subscriber(port1, "dashboard", f"{PRESENCE}#")
        time.sleep(0.3)
        # Every other device speaks MQTT 5.0 (issue 28).
        on0 = {f"a-{i}": raw_connect(port0, f"a-{i}", keep_alive=60, v5=i % 2 == 1) for i in range(30)}
        on1 = {f"b-{i}": raw_connect(port1, f"b-{i}", keep_alive=60, v5=i % 2 == 1) for i in range(30)}
        until(lambda: heard(got, "online") >= set(on0) | set(on1), 10, "the dashboard hears both gateways")

        # A device that moves to the other gateway: its old connection there is closed.
        roamer = raw_connect(port0, "roamer", keep_alive=60)
        until(lambda: "roamer" in heard(got, "online"), 5, "roamer online")
        moved = raw_connect(port1, "roamer", keep_alive=60, v5=True)  # 3.1.1 there, 5.0 here
        wait_closed(roamer, 5)
        status, body = get(f"http://127.0.0.1:{status1}/devices/a-3")  # held by the other gateway
        assert status == 200 and json.loads(body)["status"] == "online"

        # gw0 dies without a word: when its lease lapses, gw1 declares its devices lost, once.
        gw0.kill()  # SIGKILL, by PID
        gw0.wait()
        until(lambda: heard(got, "offline", "node-lost") >= set(on0), 15, "node-lost events")
        time.sleep(0.5)
        lost = [e for t, e in list(got) if e["reason"] == "node-lost"]
        assert sorted(str(e["client_id"]) for e in lost) == sorted(on0)  # once each, only gw0's
        status, body = get(f"http://127.0.0.1:{status1}/devices/a-7")
        assert (status, json.loads(body)["reason"]) == (200, "node-lost")

        # Redis restarts empty; gw1 keeps serving, queues what happens, and heals the registry.
        redis.stop()  # SIGTERM by PID; it comes back empty (no persistence)
        time.sleep(1.0)
        on1["b-0"].sendall(encoders.encode_pingreq())
        assert on1["b-0"].recv(2) == encoders.encode_pingresp()  # keep-alive never waits on Redis
        status, body = get(f"http://127.0.0.1:{status1}/healthz")
        assert status == 200 and body.startswith(b"degraded"), body
        on1["b-1"].sendall(encoders.encode_disconnect())
        wait_closed(on1["b-1"], 5)
        redis.start()
        until(lambda: "b-1" in heard(got, "offline"), 15, "the queued offline event after Redis returns")
        until(lambda: get(f"http://127.0.0.1:{status1}/healthz")[1] == b"ok\n", 15, "healthz ok again")
        status, body = get(f"http://127.0.0.1:{status1}/devices/b-5")  # resynchronised after the restart
        assert status == 200 and json.loads(body)["status"] == "online"

        # Redis came back without gw1's sessions: gw1 announced each again to the new
        # store, and every reader, having read the first online, passed over the second.
        _, exposition = get(f"http://127.0.0.1:{status1}/metrics")
        repeated = re.search(rb"^heartbeat_fleet_repeated_onlines_total (\S+)$", exposition, re.M)
        assert repeated is not None and float(repeated.group(1)) >= 30, exposition[-2000:]
        gw1.send_signal(signal.SIGTERM)
        assert gw1.wait(timeout=20) == 0
        until(lambda: heard(got, "offline") >= set(on1) | {"roamer"}, 5, "shutdown events")
        onlines = [(e["client_id"], e["epoch"]) for t, e in list(got) if e["status"] == "online"]
        assert len(onlines) == len(set(onlines)), "the dashboard was told a session's online twice"
        offline = [(e["client_id"], e["epoch"]) for t, e in list(got) if e["status"] == "offline"]
        assert len(offline) == len(set(offline)), "a session ended twice"
        assert {c for c, _ in offline} == set(on0) | set(on1) | {"roamer"}
        log_events = [json.loads(line) for line in log1.read_text().splitlines()]
        assert any(e["reason"] == "node-lost" for e in log_events)  # the sweeper logged what it declared
        # The whole history, both gateways' logs merged: each session started and ended
        # once, and no device online twice for longer than the lease (plus a sweep).
        merged = merged_by_time(read_presence_log(gateways[0][3]) or [], log_events)
        history = check_history(merged, lease=6)  # no online twice, not even a copy
        assert history.ok and history.sessions >= 61, history.summary()
        for sock in [*on0.values(), *on1.values(), moved, watch]:
            sock.close()
    finally:
        kill_gateways(gateways)
