"""servers.http serving a Starlette WebSocket app as a process of its own, to real
clients: the ``websockets`` library (with compression, as browsers offer it), over
TLS, and a raw socket through a SIGSTOP stall. The same app under uvicorn is the
reference the figures compare with (``python -m loadtest ws``)."""

from __future__ import annotations

import base64
import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from loadtest.processes import free_port, start_http, stop

from .conftest import wait_closed
from .test_heartbeat_clients import stalled_while_pinging

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.asgi_apps:starlette_app"


@pytest.fixture(params=["dense", "streams"])
def ws_server(request: pytest.FixtureRequest) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    port = free_port()
    extra = [APP, "--engine", request.param, "--tick", "0.05", "--ws-ping-interval", "1", "--ws-ping-timeout", "0.5"]
    proc = start_http(port, extra=extra, cwd=str(ROOT))
    try:
        yield port, proc
    finally:
        stop(proc)


def test_starlette_websocket_endpoints_with_the_websockets_client(ws_server: tuple[int, subprocess.Popen[str]]) -> None:
    port, _ = ws_server
    with connect(f"ws://127.0.0.1:{port}/ws/echo", subprotocols=["v0", "chat"], open_timeout=5) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "chat"
        assert ws.response is not None
        assert "permessage-deflate" in (ws.response.headers.get("Sec-WebSocket-Extensions") or "")
        ws.send("hello")
        assert ws.recv(timeout=5) == "hello"
        ws.send(b"\x01" * 300_000)
        assert ws.recv(timeout=5) == b"\x01" * 300_000
        ws.send("greeting")  # the lifespan state reaches WebSocket scopes too
        assert ws.recv(timeout=5) == "hello from starlette"
    with pytest.raises(InvalidStatus) as denied:
        connect(f"ws://127.0.0.1:{port}/ws/private", open_timeout=5)
    assert denied.value.response.status_code == 401 and denied.value.response.body == b"a token, please"
    with connect(f"ws://127.0.0.1:{port}/ws/private?token=let-me-in", open_timeout=5) as ws:
        assert ws.recv(timeout=5) == "welcome"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        said = closed.value.rcvd
        assert said is not None and (said.code, said.reason) == (4000, "that is all")


def _raw_websocket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16))
    sock.sendall(
        b"GET /ws/echo HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key + b"\r\n\r\n"
    )
    sock.settimeout(5)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 101 ")
    return sock


PONG = bytes([0x8A, 0x80]) + b"\x00" * 4  # an unsolicited pong, masked: a heartbeat (RFC 6455 §5.5.3)


def test_sigstop_spares_a_peer_whose_pongs_wait_in_the_kernel(ws_server: tuple[int, subprocess.Popen[str]]) -> None:
    """Stopped for 3 s, twice the 1.5 s ping deadline: the peer that kept sending is
    spared (its bytes were waiting), the silent one is cut."""
    port, proc = ws_server
    alive = _raw_websocket(port)
    silent = _raw_websocket(port)
    with stalled_while_pinging(proc, lambda: alive.sendall(PONG)):
        wait_closed(silent, 5)
        alive.settimeout(0.1)
        got = b""
        try:
            while chunk := alive.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        else:
            pytest.fail("the peer that kept answering was closed")
    assert got.count(b"\x89\x00") >= 1  # the server's pings, unmasked, empty


def test_wss_with_the_websockets_client(tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(cert_file)
    cert.private_key_pem.write_to_path(key_file)
    port = free_port()
    proc = start_http(port, extra=[APP, "--tls-cert", str(cert_file), "--tls-key", str(key_file)], cwd=str(ROOT))
    try:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        with connect(f"wss://127.0.0.1:{port}/ws/echo", ssl=context, open_timeout=5) as ws:
            ws.send("over tls")
            assert ws.recv(timeout=5) == "over tls"
    finally:
        stop(proc)
