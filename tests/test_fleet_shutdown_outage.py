"""SIGTERM to a gateway of a fleet while Redis is down, stalled or never reachable
(issue 61): the gateway exits 0 within a bound, with one WARNING saying what it left
undone and no traceback; the devices it could not end through Redis are ended once,
``node-lost``, by another gateway's sweeper when its lease lapses. Each gateway is a
process of its own on a real ``redis-server``, each stopped by its PID."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.coordination import LEAVE_TIMEOUT
from servers.heartbeat.coordination.fleet import RedisCoordinator
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE

from .redis_server import RedisServer, require_binary
from .test_heartbeat_clients import raw_connect, subscriber
from .test_presence_faults import heard, until

ROOT = Path(__file__).resolve().parent.parent

LEFT = "could not reach Redis at shutdown"
"""The start of the one line a gateway logs when it leaves without Redis."""

STOP_BOUND = 5.0 + 1.0 + LEAVE_TIMEOUT + 3.0
"""Seconds from SIGTERM to exit at most: the shutdown's drain waits its grace (5 s) for
Redis, its flush 1 s, its leave LEAVE_TIMEOUT; and a margin for a loaded machine."""

Gateway = tuple[subprocess.Popen[str], int, Path]
"""A gateway process, its MQTT port, and the file its stderr goes to."""


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis whose data outlives a SIGKILL (an fsynced append-only file), as a server
    with persistence comes back after a crash: what the fleet's sweeper needs to find."""
    aof = ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(tmp_path)]
    server = RedisServer(binary=require_binary(), extra=aof)
    server.start()
    yield server
    pid = server.pid
    if pid is not None:
        os.kill(pid, signal.SIGCONT)  # a test that failed while it was stopped
    server.stop()


def start_gateway(url: str, tmp_path: Path, name: str) -> Gateway:
    """One gateway of one worker on the fleet at ``url``, lease 3 s."""
    port, log = free_port(), tmp_path / f"{name}.stderr"
    args = ["--cluster", url, "--node", name, "--lease", "3", "--tick", "0.05"]
    return start_heartbeat(port, 1, args, cwd=str(ROOT), log=log), port, log


def stop_by_pid(gateways: list[Gateway]) -> None:
    """SIGKILL (by PID) whichever still runs: what a failed test leaves."""
    for proc, _, _ in gateways:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def terminate(gateway: Gateway) -> tuple[int, float, str]:
    """SIGTERM (by PID); its exit code, the seconds it took, and all its stderr."""
    proc, _, log = gateway
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=STOP_BOUND + 5)
    except subprocess.TimeoutExpired:
        code = -1
    took = time.monotonic() - started
    time.sleep(0.2)  # the thread copying its stderr has the last lines written
    return code, took, log.read_text()


def assert_left_without_redis(code: int, took: float, stderr: str) -> None:
    """Exit 0, within the bound, one line saying so, no traceback."""
    assert code == 0, stderr
    assert took < STOP_BOUND, (took, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if LEFT in line]
    assert len(lines) == 1 and " WARNING " in lines[0], stderr
    assert "left to the fleet's sweeper" in lines[0] and "node-lost" in lines[0]


def offline_once(got: list[tuple[str, dict[str, object]]], devices: set[str]) -> dict[str, str]:
    """Each of ``devices``' offline events, checked to be one per device: its reason."""
    ends = [e for t, e in list(got) if t.startswith(PRESENCE) and e["status"] == "offline"]
    mine = [e for e in ends if e["client_id"] in devices]
    assert sorted(str(e["client_id"]) for e in mine) == sorted(devices), mine  # once each
    return {str(e["client_id"]): str(e["reason"]) for e in mine}


def devices_on(port: int, prefix: str, n: int) -> dict[str, socket.socket]:
    """``n`` devices on the gateway at ``port`` (``<prefix>-<i>``), each past its CONNACK."""
    return {f"{prefix}-{i}": raw_connect(port, f"{prefix}-{i}", keep_alive=60) for i in range(n)}


def test_redis_killed_then_sigterm_exits_0_and_the_sweeper_ends_its_devices_once(
    redis: RedisServer, tmp_path: Path
) -> None:
    gateways = [start_gateway(redis.url, tmp_path, "gw0"), start_gateway(redis.url, tmp_path, "gw1")]
    sockets: list[socket.socket] = []
    try:
        leaving, staying = gateways
        watch, got = subscriber(staying[1], "dashboard", f"{PRESENCE}#")
        lost = devices_on(leaving[1], "a", 5)
        kept = devices_on(staying[1], "b", 2)
        sockets += [watch, *lost.values(), *kept.values()]
        until(lambda: heard(got, "online") >= set(lost) | set(kept), 10, "the dashboard hears every device")

        redis.kill()  # SIGKILL by PID: what was written is in its append-only file
        assert_left_without_redis(*terminate(leaving))
        assert all(_closed(s) for s in lost.values())  # the devices got their TCP close all the same

        # Redis back with its data: the other gateway finds the lease lapsed and sweeps.
        redis.start()
        until(lambda: heard(got, "offline", "node-lost") >= set(lost), 15, "node-lost for the gateway that left")
        time.sleep(0.5)  # a second event would come with the first
        assert set(offline_once(got, set(lost)).values()) == {"node-lost"}

        # With Redis answering, a stop is as before: shutdown events, no such line.
        code, _, stderr = terminate(staying)
        assert code == 0 and "Traceback" not in stderr and LEFT not in stderr, stderr
        assert heard(got, "offline", "shutdown") >= set(kept)
    finally:
        for sock in sockets:
            sock.close()
        stop_by_pid(gateways)


def test_redis_stalled_at_sigterm_exits_0_and_every_device_ends_once(redis: RedisServer, tmp_path: Path) -> None:
    gateways = [start_gateway(redis.url, tmp_path, "gw0"), start_gateway(redis.url, tmp_path, "gw1")]
    sockets: list[socket.socket] = []
    pid = redis.pid
    assert pid is not None
    try:
        leaving, staying = gateways
        watch, got = subscriber(staying[1], "dashboard", f"{PRESENCE}#")
        lost = devices_on(leaving[1], "a", 5)
        sockets += [watch, *lost.values()]
        until(lambda: heard(got, "online") >= set(lost), 10, "the dashboard hears every device")

        os.kill(pid, signal.SIGSTOP)  # Redis hangs: calls are neither answered nor refused
        try:
            assert_left_without_redis(*terminate(leaving))
        finally:
            os.kill(pid, signal.SIGCONT)
        # What the stopped gateway had sent may yet apply (`shutdown`); the sweeper ends
        # the rest (`node-lost`): either way, one offline event for each session.
        until(lambda: heard(got, "offline") >= set(lost), 15, "an offline event for every device")
        time.sleep(0.5)
        assert set(offline_once(got, set(lost)).values()) <= {"shutdown", "node-lost"}
        # The gateway that stayed rode out the stall without a traceback (coredis logs
        # one for every connection whose handshake our timeout cut).
        code, _, stderr = terminate(staying)
        assert code == 0 and "Traceback" not in stderr, stderr
    finally:
        for sock in sockets:
            sock.close()
        stop_by_pid(gateways)


def test_a_gateway_that_never_reaches_redis_serves_and_stops_with_exit_0(tmp_path: Path) -> None:
    nobody = free_port()  # nothing listens there
    gateway = start_gateway(f"redis://127.0.0.1:{nobody}/0", tmp_path, "gw0")
    try:
        _, port, log = gateway
        device = raw_connect(port, "lonely", keep_alive=60)  # served: its report waits in the queue
        started = log.read_text()
        assert len([line for line in started.splitlines() if "serving before the fleet counts it" in line]) == 1
        code, took, stderr = terminate(gateway)
        assert_left_without_redis(code, took, stderr)
        unsent = re.search(r"leaving without it, (\d+) reports unsent;", stderr)
        assert unsent is not None and int(unsent[1]) >= 2, stderr  # the device's online claim and its offline
        assert _closed(device)
        device.close()
    finally:
        stop_by_pid([gateway])


async def test_leave_without_redis_gives_up_within_its_bound_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    coordinator = RedisCoordinator(f"redis://127.0.0.1:{free_port()}/0", "gone", lease=3.0, renew=1.0)
    async with coordinator.link.connect():
        started = trio.current_time()
        await coordinator.leave()  # tries again while the bound lasts: Redis may be back any moment
        took = trio.current_time() - started
        coordinator.link.down_since = time.monotonic() - 2 * LEAVE_TIMEOUT  # the drain waited meanwhile
        started = trio.current_time()
        await coordinator.leave()
        once = trio.current_time() - started
    assert LEAVE_TIMEOUT - 0.5 < took < LEAVE_TIMEOUT + 0.5
    assert once < 0.5  # silent that long already: one try, not the bound again
    lines = [r for r in caplog.records if LEFT in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.WARNING and r.exc_info is None for r in lines)
    assert "silent for" in lines[0].getMessage() and "ConnectionError" in lines[0].getMessage()


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (it reads EOF, or a reset, within a second)."""
    sock.settimeout(1.0)
    try:
        while sock.recv(4096):  # nothing more for a 3.1.1 device, then the close
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True
