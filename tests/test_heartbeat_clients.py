"""The heartbeat server as its own process, against real clients: paho-mqtt, the
mosquitto command-line clients and raw sockets; a SIGSTOP stall; workers; status.

These run on the wall clock (a real server process, real client libraries), with
keep-alives of a second or two, and every process is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from loadtest.mqtt_frames import frames
from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.mqtt import encoders, packets
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE
from servers.heartbeat.mqtt.reader import PacketReader
from servers.heartbeat.mqtt.v5 import codec as v5_codec
from servers.heartbeat.mqtt.v5 import packets as v5_packets
from servers.listeners import check_port_free

from .conftest import wait_closed

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI") == "true"


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    log: Path
    status_port: int | None = None

    def events(self) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def wait_for(self, predicate: object, timeout: float = 10.0) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events() if predicate(e)]  # type: ignore[operator]
            if found:
                return found
            time.sleep(0.02)
        raise AssertionError(f"no matching presence event; got {self.events()}")


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[object]:
    started: list[Server] = []

    def start(*args: str, workers: int = 1, status: bool = False) -> Server:
        log = tmp_path / f"presence-{len(started)}.jsonl"
        port = free_port()
        extra = ["--tick", "0.05", "--presence-log", str(log), *args]
        status_port = None
        if status:
            status_port = free_port(run=workers)  # worker i serves status on port + i
            extra += ["--status-port", str(status_port)]
        server = Server(start_heartbeat(port, workers, extra, cwd=str(ROOT)), port, log, status_port)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)  # by PID
            try:
                server.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()


def raw_connect(port: int, client_id: str, keep_alive: int, *, v5: bool = False, **kw: object) -> socket.socket:
    """A device on a raw socket, past its CONNACK: MQTT 3.1.1, or 5.0 with ``v5``."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(5)
    if v5:
        sock.sendall(v5_codec.pack(v5_packets.Connect(client_id, keep_alive, **kw)))  # type: ignore[arg-type]
        head = sock.recv(2)
        assert head[:1] == b"\x20" and head[1] < 0x80, head  # a CONNACK, its properties under 128 bytes
        body = b""
        while len(body) < head[1]:
            body += sock.recv(head[1] - len(body))
        assert body[:2] == b"\x00\x00", body  # accepted
        return sock
    sock.sendall(encoders.encode_connect(client_id, keep_alive=keep_alive, **kw))  # type: ignore[arg-type]
    assert sock.recv(4) == encoders.encode_connack(False, 0)
    return sock


def metric(server: Server, name: str) -> float:
    """``name``'s value on the server's ``/metrics``, summed over its label sets."""
    assert server.status_port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{server.status_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def paho_client(client_id: str) -> mqtt.Client:
    return mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)


@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_paho_connect_ping_publish_subscribe_and_will(start_server: object, engine: str) -> None:
    server: Server = start_server("--engine", engine)  # type: ignore[operator]
    got: list[tuple[str, bytes]] = []
    subscribed = threading.Event()
    watcher = paho_client("paho-watcher")
    watcher.on_message = lambda c, u, msg: got.append((msg.topic, bytes(msg.payload)))
    watcher.on_subscribe = lambda *a: subscribed.set()
    watcher.connect("127.0.0.1", server.port, keepalive=2)
    watcher.loop_start()
    try:
        watcher.subscribe([(f"{PRESENCE}#", 0), ("wills/#", 1), ("data/#", 1)])
        assert subscribed.wait(5)
        device = paho_client("paho-device")
        device.connect("127.0.0.1", server.port, keepalive=2)
        device.loop_start()
        device.publish("data/t", b"q0", qos=0)
        device.publish("data/t", b"q1", qos=1).wait_for_publish(5)
        time.sleep(5)  # paho pings by itself every 2 s: it must stay online
        dead = raw_connect(server.port, "paho-dead", keep_alive=1, will_topic="wills/paho-dead", will_message=b"bye")
        wait_closed(dead, 5)
        deadline = time.monotonic() + 5
        while ("wills/paho-dead", b"bye") not in got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ("data/t", b"q0") in got and ("data/t", b"q1") in got
        assert ("wills/paho-dead", b"bye") in got
        presence = [json.loads(p) for t, p in got if t == f"{PRESENCE}paho-device"]
        assert [p["status"] for p in presence] == ["online"]  # pings kept it alive
        device.disconnect()
        device.loop_stop()
    finally:
        watcher.disconnect()
        watcher.loop_stop()
    offline = server.wait_for(lambda e: e["client_id"] == "paho-dead" and e["status"] == "offline")
    assert offline[0]["reason"] == "keepalive-timeout"


def test_silent_device_closed_between_1_5_keepalive_and_one_tick_later(start_server: object) -> None:
    server: Server = start_server()  # type: ignore[operator]
    socks = []
    for i in range(5):
        sock = raw_connect(server.port, f"silent-{i}", keep_alive=1)
        sock.sendall(encoders.encode_pingreq())
        assert sock.recv(2) == encoders.encode_pingresp()
        socks.append((sock, time.monotonic()))
    for sock, last in socks:
        closed = wait_closed(sock, 5)
        assert closed - last >= 1.5
    events = server.wait_for(lambda e: str(e["client_id"]).startswith("silent-") and e["status"] == "offline")
    deadline = time.monotonic() + 5
    while len(events) < 5 and time.monotonic() < deadline:
        events = [e for e in server.events() if str(e["client_id"]).startswith("silent-") and e["status"] == "offline"]
        time.sleep(0.05)
    assert len(events) == 5
    for event in events:
        assert event["reason"] == "keepalive-timeout"
        # The server's own view: silent at least 1.5 s, and cut within one 50 ms tick
        # (plus a scheduling allowance: this runs on the wall clock of a shared machine;
        # the exact one-tick bound is checked under MockClock in test_heartbeat.py).
        assert 1.5 <= float(str(event["silent_for"])) < 1.5 + 0.05 + 0.05


@pytest.mark.skipif(
    shutil.which("mosquitto_sub") is None and not IN_CI,
    reason="mosquitto-clients not installed (apt-get install mosquitto-clients; CI installs it)",
)
def test_mosquitto_clients(start_server: object) -> None:
    server: Server = start_server()  # type: ignore[operator]
    sub = subprocess.Popen(
        [
            *("mosquitto_sub", "-h", "127.0.0.1", "-p", str(server.port), "-t", f"{PRESENCE}#", "-v"),
            "-R",
            "-C",
            "2",
            "-W",
            "15",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server.wait_for(lambda e: e["status"] == "online")  # the subscriber is in
        time.sleep(0.3)
        done = subprocess.run(
            ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(server.port), "-i", "mosq-dev", "-t", "t", "-m", "hi"],
            capture_output=True,
            timeout=10,
        )
        assert done.returncode == 0, done.stderr
        out, _ = sub.communicate(timeout=15)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"{PRESENCE}mosq-dev ") and '"status":"online"' in lines[0]
    assert '"reason":"disconnect"' in lines[1]


@contextlib.contextmanager
def stalled_while_pinging(proc: subprocess.Popen[str], ping: Callable[[], None]) -> Iterator[None]:
    """``ping`` every 0.5 s from a thread while ``proc`` is SIGSTOPped for 3 s (twice a
    1 s keep-alive's window: the pings pile up in the kernel), then SIGCONTed; the
    block runs after, still pinging. Every stop is undone, whatever happens."""
    stop = threading.Event()

    def pinger() -> None:
        while not stop.is_set():
            ping()
            time.sleep(0.5)

    thread = threading.Thread(target=pinger, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(proc.pid, signal.SIGCONT)
        yield
    finally:
        stop.set()
        os.kill(proc.pid, signal.SIGCONT)
        thread.join()


@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_sigstop_stall_keeps_pinging_clients(start_server: object, engine: str) -> None:
    """The server is stopped for longer than 1.5 x keep-alive; a client that kept
    pinging must survive, while one that went silent is still cut (either engine)."""
    server: Server = start_server("--engine", engine)  # type: ignore[operator]
    alive = raw_connect(server.port, "stall-alive", keep_alive=1)  # deadline 1.5 s
    silent = raw_connect(server.port, "stall-silent", keep_alive=1, v5=True)
    with stalled_while_pinging(server.proc, lambda: alive.sendall(encoders.encode_pingreq())):
        wait_closed(silent, 5)
        time.sleep(2.0)
    alive.setblocking(False)
    try:
        data = alive.recv(65536)
    except BlockingIOError:
        data = b"x"
    assert data != b"", "the pinging client was dropped"
    offline = {e["client_id"]: e["reason"] for e in server.events() if e["status"] == "offline"}
    assert offline.get("stall-silent") == "keepalive-timeout"
    assert "stall-alive" not in offline


def subscriber(
    port: int, name: str, topic_filter: str | Sequence[str]
) -> tuple[socket.socket, list[tuple[str, dict[str, object]]]]:
    """A raw MQTT subscriber (to one filter or several) whose received PUBLISHes are collected by a thread."""
    sock = raw_connect(port, name, keep_alive=0)
    filters = [topic_filter] if isinstance(topic_filter, str) else list(topic_filter)
    sock.sendall(encoders.encode_subscribe(1, [(f, 0) for f in filters]))
    got: list[tuple[str, dict[str, object]]] = []
    # PUBLISH has the same layout both ways, so the server's parser reads them.
    reader = PacketReader(max_packet_size=1 << 20)
    pending = bytearray()

    def take(data: bytes) -> bool:
        """Collect the PUBLISHes in ``data``; whether a SUBACK was among the packets."""
        subacked = False
        pending.extend(data)
        found, used = frames(pending)
        start = 0
        for first, _body, end in found:
            # MQTT-3.8.4: matching messages may come before the SUBACK (it waits for the
            # other workers to route by the new filter; their messages need not).
            subacked |= first == 0x90
            for parsed in reader.feed(bytes(pending[start:end])) if first >> 4 == 3 else []:
                if isinstance(parsed, packets.Publish):
                    got.append((parsed.topic, json.loads(parsed.payload)))
            start = end
        del pending[:used]
        return subacked

    while not take(sock.recv(65536)):
        pass

    # Here, not in the thread: a test may close the socket before the thread first runs.
    sock.settimeout(None)

    def collect() -> None:
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            take(data)

    threading.Thread(target=collect, daemon=True).start()
    return sock, got


def test_workers_share_the_port_presence_and_takeovers(start_server: object) -> None:
    import psutil

    server: Server = start_server(workers=2, status=True)  # type: ignore[operator]
    watchers = [subscriber(server.port, f"watcher-{i}", f"{PRESENCE}#") for i in range(4)]
    time.sleep(0.5)  # let every worker learn the others' subscriptions
    socks = [raw_connect(server.port, f"w-{i}", keep_alive=30) for i in range(40)]
    events = server.wait_for(lambda e: e["status"] == "online" and str(e["client_id"]).startswith("w-"))
    deadline = time.monotonic() + 5
    while len(events) < 40 and time.monotonic() < deadline:
        events = [e for e in server.events() if e["status"] == "online" and str(e["client_id"]).startswith("w-")]
        time.sleep(0.05)
    assert {e["worker"] for e in events} == {0, 1}  # the kernel spread them
    wanted = {f"{PRESENCE}w-{i}" for i in range(40)}

    def heard(got: list[tuple[str, dict[str, object]]]) -> set[str]:
        # Watchers also hear each other come online, so count the devices' topics, not messages.
        return {t for t, p in list(got) if p["status"] == "online"} & wanted

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(heard(got) != wanted for _, got in watchers):
        time.sleep(0.05)
    for _, got in watchers:  # every subscriber heard of every device, whichever worker held it
        assert heard(got) == wanted

    # The same client id again and again: wherever it lands, the previous one is closed.
    previous = raw_connect(server.port, "roamer", keep_alive=30)
    for _ in range(6):
        current = raw_connect(server.port, "roamer", keep_alive=30)
        wait_closed(previous, 5)
        previous = current
    previous.sendall(encoders.encode_pingreq())
    assert previous.recv(2) == encoders.encode_pingresp()

    assert server.status_port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{server.status_port}/healthz", timeout=5) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{server.status_port}/metrics", timeout=5) as resp:
        assert b"heartbeat_devices_online" in resp.read()
    # Any worker's endpoint answers for a device held by any worker.
    for port in (server.status_port, server.status_port + 1):
        for i in (0, 1, 2, 3):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/devices/w-{i}", timeout=5) as resp:
                record = json.loads(resp.read())
            assert record["client_id"] == f"w-{i}" and record["status"] == "online"

    # A worker that dies is replaced, and the port keeps serving.
    workers = psutil.Process(server.proc.pid).children()
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in psutil.Process(server.proc.pid).children() if p.status() != psutil.STATUS_ZOMBIE]
        if len(alive) == 2 and workers[0].pid not in {p.pid for p in alive}:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the dead worker was not replaced")
    time.sleep(1.0)
    late = [raw_connect(server.port, f"late-{i}", keep_alive=30) for i in range(10)]

    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=20) == 0
    for sock in [*socks, *late]:
        wait_closed(sock, 5)  # every client got its TCP close
    shutdown = {str(e["client_id"]) for e in server.events() if e["status"] == "offline" and e["reason"] == "shutdown"}
    survivors = {f"w-{i}" for i in range(40)} - {
        str(e["client_id"]) for e in server.events() if e["status"] == "offline" and e["reason"] != "shutdown"
    }
    assert shutdown >= {f"late-{i}" for i in range(10)}
    # Devices on the killed worker lost their connection with it (no event could be written);
    # every device on a live worker got a clean "shutdown".
    assert shutdown & survivors


def test_workers_end_their_devices_and_exit_when_the_supervisor_is_killed(start_server: object) -> None:
    """kill -9 of the supervisor: each worker gets the kernel's parent-death signal, ends
    its devices with a ``shutdown`` event (their sockets closed, not left hanging) and
    exits; the port is free again for a new server."""
    server = start_server(workers=2)  # type: ignore[operator]
    workers = psutil.Process(server.proc.pid).children()
    assert len(workers) == 2
    devices = [raw_connect(server.port, f"orphan-{i}", keep_alive=60, v5=i % 2 == 1) for i in range(6)]
    server.wait_for(lambda e: e.get("status") == "online" and e.get("client_id") == "orphan-5")
    server.proc.kill()  # SIGKILL, by PID: the supervisor cannot stop anything itself
    server.proc.wait()
    _gone, alive = psutil.wait_procs(workers, timeout=5)
    for orphan in alive:
        orphan.kill()  # by PID, so that a failure here leaves nothing running
    assert not alive, f"workers outlived their supervisor: {alive}"
    for i, sock in enumerate(devices):
        # closed by the server, as a shutdown closes them; a 5.0 device told why first
        assert sock.recv(16) == (b"\xe0\x02\x8b\x00" if i % 2 else b"")
        if i % 2:
            assert sock.recv(1) == b""
        sock.close()
    ended = [e["client_id"] for e in server.events() if e.get("status") == "offline" and e["reason"] == "shutdown"]
    assert sorted(ended) == sorted(f"orphan-{i}" for i in range(6))  # each exactly once
    check_port_free("127.0.0.1", server.port)


def test_sigterm_tells_subscribers_every_device_went_offline_before_closing_them(start_server: object) -> None:
    """The CLI's SIGTERM path, with real sockets: a subscriber hears all 300 devices end
    (reason shutdown) before its own connection is closed, and the server exits 0."""
    server = start_server()  # type: ignore[operator]
    sock, got = subscriber(server.port, "dashboard", f"{PRESENCE}+")
    devices = [raw_connect(server.port, f"sig-{i}", keep_alive=60) for i in range(300)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (f"{PRESENCE}sig-299", "online") not in {(t, e["status"]) for t, e in got}:
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)  # by PID
    assert server.proc.wait(timeout=15) == 0
    expected = {f"sig-{i}" for i in range(300)}

    def offline() -> set[str]:
        return {t.removeprefix(PRESENCE) for t, e in list(got) if e["reason"] == "shutdown"}

    deadline = time.monotonic() + 5  # the server has exited: the collector is reading its last bytes
    while time.monotonic() < deadline and not offline() >= expected:
        time.sleep(0.02)
    assert offline() >= expected
    for device in devices:
        device.close()
    sock.close()


@pytest.mark.parametrize("trio_waits", [False, True])
def test_spread_out_heartbeats_are_served_from_the_engines_own_wait(start_server: object, trio_waits: bool) -> None:
    """Heartbeats that each wake the server alone are answered by passes the dense engine
    starts from its own epoll wait (none with ``--trio-waits``); every one is answered."""
    server: Server = start_server(*(["--trio-waits"] if trio_waits else []), status=True)  # type: ignore[operator]
    socks = [raw_connect(server.port, f"spread-{i}", keep_alive=30) for i in range(4)]
    for round_ in range(10):
        for sock in socks:
            sock.sendall(encoders.encode_pingreq())
            assert sock.recv(2) == encoders.encode_pingresp(), round_
            time.sleep(0.01)
    direct = metric(server, "heartbeat_engine_direct_passes_total")
    for sock in socks:
        sock.close()
    if trio_waits:
        assert direct == 0
    else:
        assert direct >= 20, direct  # 40 lone heartbeats; the reaper's ticks take a few through trio
