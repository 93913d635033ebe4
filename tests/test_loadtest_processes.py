"""loadtest.processes.start_server: a server's stderr kept in a file as it comes."""

from __future__ import annotations

import signal
from pathlib import Path

from loadtest.processes import free_port, start_heartbeat


def test_a_servers_stderr_is_written_to_its_log_as_it_comes(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = start_heartbeat(free_port(), 1, ["--log-level", "info"], log=log)
    try:
        # Read by the start-up (it waits for this line) and still written to the log.
        assert "listening on 127.0.0.1:" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        assert proc.wait(timeout=20) == 0
