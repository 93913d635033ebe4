"""The ASGI request cycle beside uvicorn and hypercorn (issue 59): one FastAPI app
(``tests/asgi_lifecycle_apps.py``) served by servers.http on both engines, by uvicorn
(``--http h11``) and by hypercorn (``--worker-class trio``), each as its own process,
the same requests on each at once. Ours must behave as the HTTP reference's ASGI
table says; the peers' figures are printed beside (``pytest -s``), for that table,
and not asserted: they are other projects' to change."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from loadtest.processes import free_port, stop, wait_listening

from .asgi_lifecycle_apps import facts

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.asgi_lifecycle_apps:app"
OURS = ("dense", "streams")


def command(name: str, port: int) -> list[str]:
    if name in OURS:
        return [sys.executable, "-m", "servers.http", APP, "--port", str(port), "--engine", name, "--tick", "0.05"]
    if name == "uvicorn":
        return [sys.executable, "-m", "uvicorn", APP, "--port", str(port), "--http", "h11", "--loop", "asyncio"]
    return [sys.executable, "-m", "hypercorn", "--worker-class", "trio", "--bind", f"127.0.0.1:{port}", APP]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[int, Path, Path]]]:
    """name -> (port, the app's facts folder, the server's log) for each server installed."""
    names = [*OURS] + [peer for peer in ("uvicorn", "hypercorn") if importlib.util.find_spec(peer) is not None]
    started: list[subprocess.Popen[str]] = []
    out: dict[str, tuple[int, Path, Path]] = {}
    try:
        for name in names:
            folder = tmp_path_factory.mktemp(name)
            (folder / "facts").mkdir()
            port = free_port()
            log = folder / "server.log"
            env = {**os.environ, "LIFECYCLE_DIR": str(folder / "facts")}
            with log.open("w") as sink:
                proc = subprocess.Popen(command(name, port), cwd=ROOT, env=env, stdout=sink, stderr=sink, text=True)
            started.append(proc)
            wait_listening(port, proc)
            out[name] = (port, folder / "facts", log)
        yield out
    finally:
        for proc in started:
            stop(proc)  # by its PID


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    return sock


def read_response(sock: socket.socket, buf: bytearray) -> bytes:
    """One whole response with a Content-Length (head and body) from ``sock``."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"closed with {bytes(buf)!r}"
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    del buf[:]
    buf += rest[length:]
    return head + b"\r\n\r\n" + rest[:length]


def until_eof(sock: socket.socket) -> bytes:
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def wait_for(check: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``check()`` held, or None after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def measure(name: str, port: int, folder: Path, log: Path) -> dict[str, Any]:
    """The table's rows, on one server."""
    row: dict[str, Any] = {}
    # The next request on a keep-alive connection, behind a 1 s background task.
    sock, buf = connect(port), bytearray()
    sock.sendall(b"GET /bg?s=1&n=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    read_response(sock, buf)
    start = time.monotonic()
    sock.sendall(b"GET /spec HTTP/1.1\r\nHost: x\r\n\r\n")
    spec = read_response(sock, buf)
    row["next request behind a background task (s)"] = round(time.monotonic() - start, 2)
    row["spec_version"] = spec.rpartition(b"\r\n\r\n")[2].decode()
    sock.close()
    # Connection: close: the end comes with the response; the background work finishes anyway.
    sock = connect(port)
    start = time.monotonic()
    sock.sendall(b"GET /bg?s=1&n=2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    until_eof(sock)
    row["Connection: close, the end after the response (s)"] = round(time.monotonic() - start, 2)
    sock.close()
    done = wait_for(lambda: "background-done 2" in facts(folder), 5.0)
    row["background task done after its client left"] = done is not None
    # Two pipelined requests to an app that waits for http.disconnect in a task group.
    sock = connect(port)
    sock.sendall(b"GET /watch HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
    sock.settimeout(2)
    got = b""
    with contextlib.suppress(TimeoutError):
        while got.count(b"watched\n") < 2:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    row["pipelined requests answered (of 2)"] = got.count(b"watched\n")
    sock.close()
    # An idle event stream whose client leaves: how long its generator runs on.
    sock = connect(port)
    sock.sendall(b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\n")
    while b"data: first" not in (chunk := sock.recv(65536)):
        assert chunk
    sock.close()
    ended = wait_for(lambda: "sse-ended" in facts(folder), 12.0)
    row["idle event stream ends after its client left (s)"] = None if ended is None else round(ended, 2)
    # An app that returns mid-response.
    sock = connect(port)
    sock.sendall(b"GET /partial HTTP/1.1\r\nHost: x\r\n\r\n")
    until_eof(sock)
    sock.close()
    time.sleep(0.3)
    text = log.read_text()
    row["returned mid-response: logged"] = "returned without completing response" in text
    faults = [
        line
        for line in text.splitlines()
        if ("ERROR" in line or "Traceback" in line) and "without completing response" not in line
    ]
    row["the stream's client leaving: an ERROR or traceback logged"] = bool(faults)
    # The server's own answer to a malformed request.
    sock = connect(port)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
    head = until_eof(sock).split(b"\r\n\r\n")[0].lower()
    row["its own 400 carries Date"] = b"\r\ndate: " in head
    sock.close()
    return row


def test_the_asgi_cycle_beside_uvicorn_and_hypercorn(servers: dict[str, tuple[int, Path, Path]]) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = {name: pool.submit(measure, name, *where) for name, where in servers.items()}
    rows = {name: future.result() for name, future in futures.items()}
    names = list(rows)
    print("\n| | " + " | ".join(names) + " |")
    for key in rows[names[0]]:
        print(f"| {key} | " + " | ".join(str(rows[n][key]) for n in names) + " |")
    for engine in OURS:
        ours = rows[engine]
        assert ours["next request behind a background task (s)"] < 0.3, (engine, ours)
        assert ours["spec_version"] == "2.3"
        assert ours["Connection: close, the end after the response (s)"] < 0.3, (engine, ours)
        assert ours["background task done after its client left"], (engine, ours)
        assert ours["pipelined requests answered (of 2)"] == 2, (engine, ours)
        ended = ours["idle event stream ends after its client left (s)"]
        assert ended is not None and ended < 1.0, (engine, ours)
        assert ours["returned mid-response: logged"], (engine, ours)
        assert not ours["the stream's client leaving: an ERROR or traceback logged"], (engine, ours)
        assert ours["its own 400 carries Date"], (engine, ours)
