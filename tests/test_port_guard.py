"""A server refuses a port that another server still listens on, with a clear error.

Workers share their port through SO_REUSEPORT, and the kernel lets any process that
sets it join: without this check a second server (or the orphans of a killed
supervisor) would silently split the connections with the first.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from loadtest.processes import free_port, start_heartbeat, start_http, stop
from servers.listeners import PortInUse, check_port_free


def test_check_port_free_sees_a_reuseport_listener() -> None:
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as the workers bind
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
    finally:
        held.close()
    check_port_free("127.0.0.1", port)  # free again once it is closed
    check_port_free("127.0.0.1", 0)


def test_a_closed_connection_in_time_wait_does_not_hold_the_port() -> None:
    """A restart right after a stop must work: only a live listener counts."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server side closes first: its end goes to TIME_WAIT
    client.close()
    listener.close()
    time.sleep(0.05)
    check_port_free("127.0.0.1", port)


@pytest.mark.parametrize(
    ("module", "workers"), [("servers.heartbeat", 1), ("servers.heartbeat", 2), ("servers.http", 2)]
)
def test_a_second_server_on_a_held_port_refuses_to_start(module: str, workers: int) -> None:
    port = free_port()
    first = start_heartbeat(port, 2) if module == "servers.heartbeat" else start_http(port, 2)
    try:
        second = subprocess.run(
            [sys.executable, "-m", module, "--port", str(port), "--workers", str(workers)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 2
        assert f"port {port} on 127.0.0.1 is already in use" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the first server is untouched and still serving
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        assert stop(first) == 0
