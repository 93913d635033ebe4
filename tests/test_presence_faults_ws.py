"""The fault drill with devices over WebSockets (issue 29), on the dense engine that
now serves them without a task each: a worker killed, the supervisor killed, with
TCP subscribers watching and half the devices on MQTT 5.0. Every device's events are
checked: exactly one offline per session, none for a healthy device."""

from __future__ import annotations

import base64
import os
import signal
import socket

import psutil

from loadtest.history import check_history
from loadtest.processes import free_port
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.v5 import codec as v5_codec
from servers.heartbeat.mqtt.v5 import packets as v5_packets

from .test_heartbeat_clients import Server, start_server
from .test_presence_faults import heard, is_v5, sessions, spread_subscribers, until, where, worker_pids

__all__ = ["start_server"]

PRESENCE = "$SYS/presence/"


def masked(payload: bytes) -> bytes:
    """A client's binary frame (masked, with a zero key)."""
    size = len(payload)
    head = bytes([0x82, 0x80 | size]) if size < 126 else bytes([0x82, 0x80 | 126]) + size.to_bytes(2, "big")
    return head + b"\x00" * 4 + payload


def ws_device(port: int, client_id: str, keep_alive: int, *, v5: bool = False) -> socket.socket:
    """A device over a WebSocket on a raw socket, past its CONNACK."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(5)
    key = base64.b64encode(os.urandom(16))
    sock.sendall(
        b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Protocol: mqtt\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key + b"\r\n\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101 "), head
    connect = (
        v5_codec.pack(v5_packets.Connect(client_id, keep_alive))
        if v5
        else encoders.encode_connect(client_id, keep_alive=keep_alive)
    )
    sock.sendall(masked(connect))
    frame = sock.recv(2)
    assert frame[0] == 0x82 and frame[1] < 126, frame  # one binary frame: the CONNACK
    body = b""
    while len(body) < frame[1]:
        body += sock.recv(frame[1] - len(body))
    assert body[:1] == b"\x20", body
    return sock


def ws_server(start: object, workers: int) -> tuple[Server, int]:
    ws_port = free_port()
    return start("--ws-port", str(ws_port), workers=workers), ws_port  # type: ignore[operator]


def test_a_killed_worker_s_websocket_devices_go_offline_once(start_server: object) -> None:
    server, ws_port = ws_server(start_server, 2)
    subs = spread_subscribers(server, 2, f"{PRESENCE}#", at_least=4)
    names = {f"ws-{i}" for i in range(60)}
    devices = {name: ws_device(ws_port, name, 60, v5=is_v5(name)) for name in sorted(names)}
    until(lambda: set(where(server, names)) == names, 10, "every device online")
    pids = worker_pids(server, 2)
    placed = where(server, names | set(subs))
    victim = placed["ws-0"]
    lost = {n for n in names if placed[n] == victim}
    listeners = {s: got for s, (_, got) in subs.items() if placed[s] != victim}
    assert lost and listeners
    until(lambda: all(heard(got, "online") >= names for got in listeners.values()), 10, "subscribers hear every device")
    os.kill(pids[victim], signal.SIGKILL)  # by PID
    until(lambda: all(heard(got, "offline", "worker-lost") >= lost for got in listeners.values()), 5, "worker-lost")
    for got in listeners.values():
        assert not heard(got, "offline") & (names - lost), "a healthy WebSocket device was declared offline"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=20) == 0
    history = check_history(server.events())
    assert history.ok and history.sessions >= len(names), history.summary()
    for epoch, events in sessions(server).items():
        offs = [e for e in events if e["status"] == "offline"]
        assert len(offs) == 1, (epoch, events)
        if offs[0]["client_id"] in names:
            assert offs[0]["reason"] == ("worker-lost" if offs[0]["client_id"] in lost else "shutdown"), offs
    for sock in devices.values():
        sock.close()


def test_a_killed_supervisor_s_workers_end_their_websocket_devices(start_server: object) -> None:
    server, ws_port = ws_server(start_server, 2)
    workers = psutil.Process(server.proc.pid).children()
    devices = [ws_device(ws_port, f"orphan-{i}", 60, v5=i % 2 == 1) for i in range(6)]
    server.wait_for(lambda e: e.get("status") == "online" and e.get("client_id") == "orphan-5")
    server.proc.kill()  # SIGKILL, by PID
    server.proc.wait()
    _gone, alive = psutil.wait_procs(workers, timeout=5)
    for orphan in alive:
        orphan.kill()
    assert not alive, f"workers outlived their supervisor: {alive}"
    for i, sock in enumerate(devices):
        got = b""
        while chunk := sock.recv(64):
            got += chunk
        # A 5.0 device is told why (DISCONNECT 0x8B, Server Shutting Down) in a binary frame.
        assert got.startswith(b"\x82\x04\xe0\x02\x8b\x00") if i % 2 else got in (b"", b"\x88\x02\x03\xe8"), got
        sock.close()
    ended = [str(e["client_id"]) for e in server.events() if e.get("status") == "offline" and e["reason"] == "shutdown"]
    assert sorted(ended) == sorted(f"orphan-{i}" for i in range(6))
