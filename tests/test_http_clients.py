"""The HTTP server as its own process, with real clients: curl and httpx; workers; SIGTERM."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.processes import free_port, start_http

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def http_server() -> Iterator[int]:
    port = free_port()
    proc = start_http(port, workers=2, extra=["--keep-alive-timeout", "5"], cwd=str(ROOT))
    try:
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        try:
            assert proc.wait(timeout=20) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise


def test_httpx_requests(http_server: int) -> None:
    base = f"http://127.0.0.1:{http_server}"
    with httpx.Client(base_url=base, timeout=5) as client:
        assert client.get("/").text == "hello from idlekeeper\n"
        assert client.get("/healthz").status_code == 200
        assert client.post("/echo", content=b"x" * 100_000).content == b"x" * 100_000
        assert len(client.get("/download?size=3000000").content) == 3_000_000
        assert client.get("/nope").status_code == 404
        # HEAD: the GET's headers, no body, and the connection stays usable.
        head = client.head("/")
        assert head.status_code == 200 and head.headers["content-length"] == "22" and head.content == b""
        assert client.head("/download?size=3000000").content == b""
        assert client.get("/").text == "hello from idlekeeper\n"
        metrics = client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "http_requests_total" in metrics.text and "idlekeeper_reaper_lag_seconds_bucket" in metrics.text
        assert client.post("/echo", content=b"y" * (17 * 1024 * 1024)).status_code == 413


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_reuses_the_connection(http_server: int) -> None:
    base = f"http://127.0.0.1:{http_server}"
    done = subprocess.run(
        ["curl", "-sv", f"{base}/", f"{base}/healthz", f"{base}/"], capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello from idlekeeper\nok\nhello from idlekeeper\n"
    assert done.stderr.count("Re-using existing connection") == 2  # keep-alive across requests
