"""The heartbeat worker's status port as a process of its own, on the wall clock: it
stays answerable under a crowd of idle connections, and its bearer tokens (curl, httpx,
a SIGHUP reload).

Every process is stopped by its PID; every loop is bounded in count and time.
"""

from __future__ import annotations

import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.processes import free_port, start_heartbeat
from servers.status import STATUS_CONFIG

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def heartbeat() -> Iterator[object]:
    started: list[subprocess.Popen[str]] = []

    def start(*extra: str, workers: int = 1) -> tuple[subprocess.Popen[str], int]:
        status_port = free_port(run=workers)  # worker i serves status on port + i
        proc = start_heartbeat(free_port(), workers, ["--status-port", str(status_port), *extra], cwd=str(ROOT))
        started.append(proc)
        return proc, status_port

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # by PID
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Crowd:
    """``count`` idle connections to ``port``, each renewed (closed and opened again)
    after ``renew`` seconds, and opened again at once when the server closes it: the
    most slots an idle client can hold, and churn on top."""

    def __init__(self, port: int, count: int, renew: float) -> None:
        self.port = port
        self.count = count
        self.renew = renew
        self.opened = 0
        self.cut = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Crowd:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _open(self, sel: selectors.DefaultSelector) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, time.monotonic())
        self.opened += 1

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            for _ in range(self.count):
                self._open(sel)
            while not self._stop.is_set():
                now = time.monotonic()
                for key, _ in sel.select(timeout=0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    sel.unregister(sock)
                    sock.close()  # the server closed it (a 503, a cut): hold another
                    self.cut += 1
                    self._open(sel)
                for key in list(sel.get_map().values()):
                    if now - key.data >= self.renew:
                        sock = key.fileobj
                        assert isinstance(sock, socket.socket)
                        sel.unregister(sock)
                        sock.close()
                        self._open(sel)
            for key in list(sel.get_map().values()):
                sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]


def healthz(port: int, timeout: float) -> tuple[int, float]:
    """One liveness probe as a kubelet makes it: a new connection, GET /healthz."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    return int(answer.split(b" ", 2)[1]), time.monotonic() - start


def test_healthz_answers_while_the_connection_cap_is_held_idle(heartbeat: object) -> None:
    _, port = heartbeat()  # type: ignore[operator]
    cap = STATUS_CONFIG.max_connections
    # Renewed before the keep-alive timeout cuts them (before this change: 8 s of 10).
    renew = 0.8 * STATUS_CONFIG.keep_alive_timeout
    probes: list[tuple[int, float]] = []
    with Crowd(port, cap, renew) as crowd:
        time.sleep(0.5)  # every slot held
        deadline = time.monotonic() + STATUS_CONFIG.keep_alive_timeout + 2  # past a renewal of them all
        while time.monotonic() < deadline and len(probes) < 200:
            probes.append(healthz(port, timeout=5))
            time.sleep(0.1)
        assert crowd.opened >= cap
    statuses = [status for status, _ in probes]
    assert len(probes) >= 20 and statuses == [200] * len(probes), statuses
    slowest = max(seconds for _, seconds in probes)
    assert slowest < 2.0, slowest


def curl(url: str, *args: str) -> tuple[int, str]:
    """curl's status code and response head (lower case) for ``url``."""
    out = subprocess.run(
        ["curl", "-s", "-D", "-", "-o", "/dev/null", "--max-time", "5", *args, url],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    return int(out.split(" ", 2)[1]), out.lower()


FIRST = "first-token-0123456789"
SECOND = "second-token-0123456789"


def test_bearer_tokens_on_every_worker_and_reloaded_on_sighup(heartbeat: object, tmp_path: Path) -> None:
    tokens = tmp_path / "status-tokens"
    tokens.write_text(f"# the scraper\n{FIRST}\n")
    proc, port = heartbeat("--status-token-file", str(tokens), workers=2)  # type: ignore[operator]
    for worker in (0, 1):
        base = f"http://127.0.0.1:{port + worker}"
        assert curl(f"{base}/healthz")[0] == 200  # liveness probes need no token
        status, head = curl(f"{base}/metrics")
        assert status == 401 and 'www-authenticate: bearer realm="status"\n' in head
        status, head = curl(f"{base}/devices/nobody", "-H", "Authorization: Bearer wrong-token")
        assert status == 401 and 'error="invalid_token"' in head
        assert curl(f"{base}/metrics", "-H", f"Authorization: Bearer {FIRST}")[0] == 200
        with httpx.Client(base_url=base, timeout=5) as client:
            assert client.get("/metrics").status_code == 401
            found = client.get("/metrics", headers={"Authorization": f"Bearer {FIRST}"})
            assert found.status_code == 200 and "heartbeat_devices_online" in found.text
            assert client.get("/devices/nobody", headers={"Authorization": f"Bearer {FIRST}"}).status_code == 404

    tokens.write_text(f"{SECOND}\n")
    proc.send_signal(signal.SIGHUP)  # by PID; the supervisor passes it on to each worker
    for worker in (0, 1):
        with httpx.Client(base_url=f"http://127.0.0.1:{port + worker}", timeout=5) as client:
            new = {"Authorization": f"Bearer {SECOND}"}
            deadline = time.monotonic() + 10
            while client.get("/metrics", headers=new).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.get("/metrics", headers=new).status_code == 200
            assert client.get("/metrics", headers={"Authorization": f"Bearer {FIRST}"}).status_code == 401
            assert client.get("/healthz").status_code == 200
    assert proc.poll() is None
