"""The readiness line: one writer, one reader, and the servers really speak it."""

from __future__ import annotations

import socket

import pytest

from loadtest.processes import free_port, start_server, stop
from servers.readiness import Ready, find_ready


@pytest.mark.parametrize(
    "ready",
    [
        Ready("heartbeat", 0, "127.0.0.1", 1883),
        Ready("heartbeat", 12, "127.0.0.1", 40001, "127.0.0.1", 9100),
        Ready("http", 3, "::1", 8080),
        Ready("baseline", 0, "0.0.0.0", 65535, "::1", 9000),
    ],
)
def test_every_announcement_reads_back_as_written(ready: Ready) -> None:
    assert find_ready(ready.line()) == [ready]
    assert find_ready(ready.line() + "\n", ready.server) == [ready]
    assert find_ready(ready.line(), "some-other-server") == []


def test_lines_that_ran_together_are_all_found() -> None:
    a = Ready("heartbeat", 0, "127.0.0.1", 1883, "127.0.0.1", 9100)
    b = Ready("heartbeat", 1, "127.0.0.1", 1883, "127.0.0.1", 9101)
    c = Ready("http", 0, "127.0.0.1", 8080)
    text = f"noise {a.line()}{b.line()} more noise\n{c.line()}\nWARNING something else"
    assert find_ready(text, "heartbeat") == [a, b]
    assert find_ready(text) == [a, b, c]


def test_other_stderr_is_not_readiness() -> None:
    assert find_ready("heartbeat: supervisor pid 10, workers [11, 12], port 1883") == []
    assert find_ready("Traceback (most recent call last):\n  listening on nothing") == []
    assert find_ready("Heartbeat worker x: listening on 127.0.0.1:1") == []


@pytest.mark.parametrize(
    ("name", "module", "workers"),
    [("heartbeat", None, 2), ("http", None, 1), ("baseline", "loadtest.baseline", 1)],
)
def test_each_server_announces_through_the_contract(name: str, module: str | None, workers: int) -> None:
    """start_server returns only once every worker has announced, on the port asked for."""
    port = free_port()
    proc = start_server(name, port, workers, module=module, timeout=30)
    try:
        assert proc.poll() is None
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        assert stop(proc) == 0


def test_a_server_that_never_announces_is_reported() -> None:
    with pytest.raises(RuntimeError, match="did not start"):
        start_server("heartbeat", free_port(), 1, module="this_module_does_not_exist", timeout=10)
