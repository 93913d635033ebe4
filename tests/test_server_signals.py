"""The servers' signals beside SIGTERM: SIGUSR1 logs a worker's trio tasks and where
each waits (servers.taskdump), SIGHUP reloads files; the supervisor passes both on to
every worker, and the server goes on serving."""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path

import httpx
import trio

from loadtest.processes import free_port, start_heartbeat, start_http
from servers.heartbeat.mqtt import encoders
from servers.taskdump import task_tree

HEADER = "tasks, each with where it waits (SIGUSR1)"


async def test_the_tree_names_each_task_and_where_it_waits() -> None:
    async def parked(event: trio.Event) -> None:
        await event.wait()

    event = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(parked, event, name="the-parked-one")
        nursery.start_soon(trio.sleep_forever, name="the-sleeper")
        await trio.testing.wait_all_tasks_blocked()
        root = trio.lowlevel.current_root_task()
        assert root is not None
        tree = task_tree(root)
        (parked_line,) = [line for line in tree if "the-parked-one" in line]
        (sleeper_line,) = [line for line in tree if "the-sleeper" in line]
        # Innermost first: the Event's wait, then the function that called it; not
        # trio's run loop's own frames.
        where = parked_line.split(": ", 1)[1]
        assert where.startswith("_sync.py:") and " wait <- test_server_signals.py:" in where, where
        assert where.endswith(" parked") and "_traps.py" not in where, where
        assert "sleep_forever" in sleeper_line
        # Children are indented under their parent, deeper than the root's line.
        assert not tree[0].startswith(" ") and parked_line.startswith("  ")
        event.set()
        nursery.cancel_scope.cancel()


def dumps_in(log: Path, count: int, limit: float = 10.0) -> str:
    """The log's text once it holds ``count`` dumps (fails after ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        text = log.read_text()
        if text.count(HEADER) >= count:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{count} task dumps not logged within {limit} s:\n{log.read_text()[-2000:]}")


def connack(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(encoders.encode_connect("after-the-dump", keep_alive=30))
        return sock.recv(4)


def test_sigusr1_logs_a_workers_tasks_and_it_goes_on_serving(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    port = free_port()
    proc = start_heartbeat(port, 1, log=log)
    try:
        proc.send_signal(signal.SIGUSR1)  # by PID
        text = dumps_in(log, 1)
        assert "WARNING" in text
        # The keeper's reaper and the worker's wait for its stop signal, each where it waits.
        assert "Keeper._reap: " in text and "serve_until_signal" in text
        assert connack(port) == encoders.encode_connack(False, 0)
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        assert proc.wait(timeout=20) == 0


def test_the_supervisor_passes_sigusr1_on_to_every_worker(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    port = free_port()
    proc = start_heartbeat(port, 2, log=log)
    try:
        proc.send_signal(signal.SIGUSR1)  # the supervisor's PID
        text = dumps_in(log, 2)
        assert text.count(HEADER) == 2
        assert proc.poll() is None
        assert connack(port) == encoders.encode_connack(False, 0)
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        assert proc.wait(timeout=20) == 0


def test_the_http_server_outlives_sighup_and_logs_its_tasks_on_sigusr1(tmp_path: Path) -> None:
    """SIGHUP's default action ends a process: the HTTP server, with no files to reload,
    ended on it (every worker at once, as the supervisor passes it on)."""
    log = tmp_path / "server.log"
    port = free_port()
    proc = start_http(port, 2, ["--log-level", "info"], log=log)
    try:
        proc.send_signal(signal.SIGHUP)  # the supervisor's PID
        proc.send_signal(signal.SIGUSR1)
        text = dumps_in(log, 2)
        assert "serve_asgi" in text
        # Each worker said so, in the servers' log format (the time, the logger, the level).
        hangups = re.findall(
            r"^\d{4}-\d\d-\d\d [\d:,]{12} servers.http INFO SIGHUP: the HTTP server has no files", text, re.M
        )
        assert len(hangups) == 2, text
        assert proc.poll() is None
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        assert proc.wait(timeout=20) == 0
