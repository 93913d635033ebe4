"""State that survives a restart and a crash (issue 62), on real server processes with
paho-mqtt and raw sockets: retained messages, persistent sessions' queues and every
device's presence, after SIGTERM and after ``kill -9`` of every process of the box, on
both engines and with ``--workers``; the store's refusals, and a full disk."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as _PahoProperties

from loadtest.history import check_history
from loadtest.processes import free_port, start_heartbeat
from servers.heartbeat.coordination.durable import open_database
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.v5.packets import Will as V5Will
from servers.heartbeat.mqtt.v5.properties import Properties as V5Properties

from .test_heartbeat_clients import ROOT, raw_connect
from .test_presence_faults import until

Properties: Any = _PahoProperties  # paho's is untyped

ONE_BOX = {"dense": ("--engine", "dense"), "streams": ("--engine", "streams"), "workers": ("--workers", "2")}


@dataclass
class Box:
    """One box's server, restarted on the same store and port as often as a test wants."""

    tmp: Path
    store: Path
    args: tuple[str, ...]
    port: int = field(default_factory=free_port)
    status: int = field(default_factory=lambda: free_port(run=2))
    runs: list[subprocess.Popen[str]] = field(default_factory=list)

    def start(self) -> subprocess.Popen[str]:
        n = len(self.runs)
        workers = int(self.args[self.args.index("--workers") + 1]) if "--workers" in self.args else 1
        extra = [a for i, a in enumerate(self.args) if a != "--workers" and (i == 0 or self.args[i - 1] != "--workers")]
        extra += ["--persistence", str(self.store), "--presence-log", str(self.tmp / f"presence-{n}.jsonl")]
        extra += ["--status-port", str(self.status), "--tick", "0.05"]
        proc = start_heartbeat(self.port, workers, extra, cwd=str(ROOT), log=self.tmp / f"server-{n}.log")
        self.runs.append(proc)
        return proc

    def stop(self) -> None:
        proc = self.runs[-1]
        proc.send_signal(signal.SIGTERM)  # by PID
        assert proc.wait(timeout=30) == 0

    def crash(self) -> None:
        """``kill -9`` of every process of the box at once: the supervisor and its workers."""
        proc = self.runs[-1]
        log = (self.tmp / f"server-{len(self.runs) - 1}.log").read_text()
        found = re.search(r"workers \[([\d, ]+)\]", log)
        pids = [proc.pid] + ([int(p) for p in found.group(1).split(",")] if found else [])
        for pid in pids:
            os.kill(pid, signal.SIGKILL)  # by PID
        proc.wait(timeout=10)

    def events(self) -> list[dict[str, object]]:
        out = []
        for n in range(len(self.runs)):
            log = self.tmp / f"presence-{n}.jsonl"
            if log.exists():
                out += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return out

    def device(self, client_id: str) -> dict[str, object]:
        """``/devices/<client_id>`` from the first worker that answers (one may be restarting)."""
        for worker in range(2):
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.status + worker}/devices/{client_id}", timeout=5
                ) as r:
                    body: dict[str, object] = json.loads(r.read())
                    return body
            except urllib.error.URLError:
                if worker:
                    raise
        raise AssertionError("unreachable")

    def healthz(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.status}/healthz", timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.status}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture
def boxes(tmp_path: Path) -> Iterator[list[Box]]:
    made: list[Box] = []
    yield made
    for box in made:
        for proc in box.runs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # by PID
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def new_box(boxes: list[Box], tmp_path: Path, args: tuple[str, ...], store: Path | None = None) -> Box:
    box = Box(tmp_path, store or tmp_path / "state.db", args)
    boxes.append(box)
    return box


def client(
    port: int, client_id: str, *, v5: bool = False, clean: bool = True, expiry: int = 0
) -> tuple[mqtt.Client, list[mqtt.MQTTMessage]]:
    """A connected paho client, its loop running, collecting what it receives."""
    protocol = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
    c = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol, clean_session=None if v5 else clean
    )
    got: list[mqtt.MQTTMessage] = []
    c.on_message = lambda _c, _u, message: got.append(message)
    connected = threading.Event()
    c.on_connect = lambda *_a: connected.set()
    properties = None
    if v5:
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = expiry
    c.connect("127.0.0.1", port, keepalive=30, clean_start=clean if v5 else mqtt.MQTT_CLEAN_START_FIRST_ONLY,
              properties=properties)  # fmt: skip
    c.loop_start()
    assert connected.wait(10), f"{client_id} did not connect"
    return c, got


def gone(c: mqtt.Client) -> None:
    c.disconnect()
    c.loop_stop()


def away_subscribers(port: int) -> None:
    """Two persistent subscribers that subscribe and leave: 3.1.1 at QoS 1, 5.0 at QoS 2."""
    for name, v5, qos in (("sub-311", False, 1), ("sub-5", True, 2)):
        c, _ = client(port, name, v5=v5, clean=False, expiry=3600)
        c.subscribe("q/#", qos=qos)
        time.sleep(0.3)  # the SUBACK, and the subscription stored
        gone(c)


def publish_acknowledged(port: int, count: int, qos: int, topic: str = "q/x") -> list[str]:
    """Publish ``count`` messages and wait for every acknowledgement; their payloads."""
    c, _ = client(port, f"pub-q{qos}")
    payloads = [f"q{qos}-{i}" for i in range(count)]
    infos = [c.publish(topic, p, qos=qos) for p in payloads]
    for info in infos:
        info.wait_for_publish(10)
        assert info.is_published()
    gone(c)
    return payloads


def collect(port: int, name: str, v5: bool, want: int) -> list[str]:
    c, got = client(port, name, v5=v5, clean=False, expiry=3600)
    until(lambda: len(got) >= want, 15, f"{want} messages for {name}")
    time.sleep(0.3)  # and no more: a duplicate would come now
    gone(c)
    return [m.payload.decode() for m in got]


@pytest.mark.parametrize("kind", list(ONE_BOX))
def test_a_restart_keeps_retained_messages_queued_sessions_and_every_devices_presence(
    boxes: list[Box], tmp_path: Path, kind: str
) -> None:
    box = new_box(boxes, tmp_path, ONE_BOX[kind])
    box.start()
    away_subscribers(box.port)
    qos1 = publish_acknowledged(box.port, 20, 1)
    qos2 = publish_acknowledged(box.port, 20, 2)
    pub, _ = client(box.port, "retainer", v5=True)
    properties = Properties(PacketTypes.PUBLISH)
    properties.ContentType = "text/plain"
    pub.publish("state/lamp", "on", qos=1, retain=True, properties=properties).wait_for_publish(10)
    gone(pub)
    device = raw_connect(box.port, "dev-1", keep_alive=30)
    until(lambda: box.device("dev-1").get("status") == "online", 10, "dev-1 online")

    box.stop()
    device.close()
    box.start()

    record = box.device("dev-1")
    assert (record["status"], record["reason"], record["keep_alive"]) == ("offline", "server-shutdown", 30)
    assert collect(box.port, "sub-311", False, 40) == qos1 + qos2  # QoS 2 at the granted QoS 1
    assert collect(box.port, "sub-5", True, 40) == qos1 + qos2  # QoS 2 exactly once
    late, got = client(box.port, "late", v5=True)
    late.subscribe("state/#", qos=1)
    until(lambda: got, 10, "the retained message")
    assert got[0].payload == b"on" and got[0].retain
    assert got[0].properties is not None and getattr(got[0].properties, "ContentType", None) == "text/plain"
    gone(late)
    box.stop()

    events = box.events()
    ends = [e for e in events if e.get("client_id") == "dev-1" and e["status"] == "offline"]
    assert [e["reason"] for e in ends] == ["server-shutdown"]
    assert check_history(events).violations == []


@pytest.mark.parametrize("kind", ["dense", "workers"])
def test_a_crash_of_every_process_loses_nothing_acknowledged(boxes: list[Box], tmp_path: Path, kind: str) -> None:
    box = new_box(boxes, tmp_path, ONE_BOX[kind])
    box.start()
    away_subscribers(box.port)
    devices = [raw_connect(box.port, f"dev-{i}", keep_alive=30) for i in range(20)]
    qos1 = publish_acknowledged(box.port, 200, 1)
    qos2 = publish_acknowledged(box.port, 100, 2)
    pub, _ = client(box.port, "retainer")
    pub.publish("state/last", "acknowledged", qos=1, retain=True).wait_for_publish(10)
    # Killed the moment the last PUBACK is read: nothing acknowledged may be missing.
    box.crash()
    pub.loop_stop()
    for sock in devices:
        sock.close()
    box.start()

    assert collect(box.port, "sub-5", True, 300) == qos1 + qos2
    assert sorted(collect(box.port, "sub-311", False, 300)) == sorted(qos1 + qos2)
    late, got = client(box.port, "late")
    late.subscribe("state/#", qos=1)
    until(lambda: got, 10, "the retained message")
    assert got[0].payload == b"acknowledged"
    gone(late)
    record = box.device("dev-7")
    assert (record["status"], record["reason"]) == ("offline", "server-lost")
    box.stop()
    events = box.events()
    for i in range(20):
        ends = [e for e in events if e.get("client_id") == f"dev-{i}" and e["status"] == "offline"]
        assert [e["reason"] for e in ends] == ["server-lost"], f"dev-{i}: {ends}"
    assert check_history(events).violations == []


def heartbeat(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "servers.heartbeat", "--port", str(free_port()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=str(ROOT))


def test_a_store_that_cannot_be_trusted_is_refused_in_one_line_and_left_as_it_was(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("a list of devices, not a database\n")
    done = heartbeat("--persistence", str(text))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.endswith(f": error: --persistence: {text}: is not an SQLite database (refused rather than overwritten)")
    assert text.read_text() == "a list of devices, not a database\n"
    done = heartbeat("--persistence", str(tmp_path / "state.db"), "--cluster", "redis://127.0.0.1:1/0")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "--persistence: a fleet keeps its state in Redis" in done.stderr


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for the test (root only: CI runs as root)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte; the file to remove to give the space back."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (65536, 1):
            try:
                while f.write(b"\0" * size):
                    pass
            except OSError:
                pass
    return filler


def test_a_full_disk_refuses_what_cannot_be_kept_serves_presence_and_recovers(
    boxes: list[Box], tmp_path: Path, small_disk: Path
) -> None:
    box = new_box(boxes, tmp_path, ONE_BOX["dense"], store=small_disk / "state.db")
    box.start()
    away_subscribers(box.port)
    assert box.healthz().startswith("ok")
    filler = fill(small_disk)

    v5, _ = client(box.port, "pub-5", v5=True)
    codes: list[int] = []
    v5.on_publish = lambda _c, _u, _mid, code, _p: codes.append(code.value)
    v5.publish("q/x", "refused", qos=1).wait_for_publish(10)
    until(lambda: codes, 10, "the PUBACK")
    assert codes == [0x97]  # Quota Exceeded: the store could not keep it
    until(lambda: box.healthz().startswith("degraded: the durable store cannot write"), 10, "/healthz degraded")
    assert box.metric("heartbeat_durable_writable") == 0
    # Keep-alive and presence go on: a device comes and is answered.
    device = raw_connect(box.port, "dev-during", keep_alive=30)
    until(lambda: box.device("dev-during").get("status") == "online", 10, "a device online meanwhile")
    v311, _ = client(box.port, "pub-311")
    v311.publish("q/x", "counted", qos=1).wait_for_publish(10)
    assert box.metric("heartbeat_durable_unconfirmed_total") >= 1
    assert box.metric("heartbeat_durable_refused_total") >= 1

    filler.unlink()
    until(lambda: box.healthz().startswith("ok"), 15, "/healthz ok again")
    codes.clear()
    v5.publish("q/x", "kept", qos=1).wait_for_publish(10)
    until(lambda: codes, 10, "the PUBACK")
    assert codes == [0]
    gone(v5)
    gone(v311)
    device.close()
    box.stop()
    box.start()
    assert collect(box.port, "sub-5", True, 1)[-1] == "kept"
    box.stop()


def will_device(port: int, name: str, delay: int) -> socket.socket:
    """An MQTT 5 device whose Will (to ``wills/<name>``) waits ``delay`` seconds."""
    will = V5Will(f"wills/{name}", b"gone", 1, False, V5Properties(will_delay_interval=delay))
    return raw_connect(
        port, name, keep_alive=30, v5=True, properties=V5Properties(session_expiry_interval=600), will=will
    )


@pytest.mark.parametrize(("kind", "stop"), [("dense", "sigterm"), ("workers", "crash")])
def test_a_delayed_will_waits_out_the_rest_of_its_delay_after_a_restart(
    boxes: list[Box], tmp_path: Path, kind: str, stop: str
) -> None:
    box = new_box(boxes, tmp_path, ONE_BOX[kind])
    box.start()
    device = will_device(box.port, "dev-w", delay=4)
    device.close()  # no DISCONNECT: its Will waits 4 s
    until(lambda: box.device("dev-w").get("status") == "offline", 10, "dev-w offline")
    held_at = time.monotonic()
    box.stop() if stop == "sigterm" else box.crash()
    box.start()
    listener, got = client(box.port, "listener")
    listener.subscribe("wills/#", qos=1)
    until(lambda: got, 15, "the Will")
    assert time.monotonic() - held_at >= 3.5  # not at the restart: after what was left of the delay
    assert [(m.topic, m.payload) for m in got] == [("wills/dev-w", b"gone")]
    time.sleep(0.5)
    assert len(got) == 1
    gone(listener)


def test_a_store_on_a_read_only_filesystem_is_refused_in_one_line(small_disk: Path) -> None:
    store = small_disk / "state.db"
    open_database(str(store)).close()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    done = heartbeat("--persistence", str(store))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert f"error: --persistence: {store}: cannot be written" in line, line


def test_a_worker_killed_right_after_its_pubacks_loses_none_of_them(boxes: list[Box], tmp_path: Path) -> None:
    """With ``--workers``, a PUBACK waits for the supervisor's commit, not only for the
    worker: the worker that read the PUBLISHes may die the moment it answered."""
    box = new_box(boxes, tmp_path, ONE_BOX["workers"])
    box.start()
    away_subscribers(box.port)
    pub, _ = client(box.port, "pub-dies")
    until(lambda: box.device("pub-dies").get("status") == "online", 10, "the publisher online")
    worker_pid = int(str(box.device("pub-dies")["epoch"]).split(".")[1])
    infos = [pub.publish("q/x", f"m{i}", qos=1) for i in range(300)]
    for info in infos:
        info.wait_for_publish(10)
    os.kill(worker_pid, signal.SIGKILL)  # by PID: the supervisor lives, and restarts it
    pub.loop_stop()
    assert collect(box.port, "sub-5", True, 300) == [f"m{i}" for i in range(300)]
    until(lambda: box.device("pub-dies").get("reason") == "worker-lost", 10, "the publisher worker-lost")


def read_packet(sock: socket.socket) -> tuple[int, bytes]:
    """One packet: its first byte and its body."""
    first = sock.recv(1)[0]
    length, shift = 0, 0
    while True:
        byte = sock.recv(1)[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return first, body


def persistent(port: int, client_id: str) -> socket.socket:
    """A 3.1.1 client with CleanSession=0, past its CONNACK (a session present or not)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(5)
    sock.sendall(encoders.encode_connect(client_id, keep_alive=60, clean_session=False))
    first, body = read_packet(sock)
    assert first == 0x20 and body[1] == 0, body
    return sock


def test_a_qos2_message_released_on_the_wire_is_never_sent_again_after_a_crash(
    boxes: list[Box], tmp_path: Path
) -> None:
    """MQTT-4.3.3: once PUBREL went out, the PUBLISH is never sent again; so the stage
    and packet id are on disk before the PUBLISH and the PUBREL leave."""
    box = new_box(boxes, tmp_path, ONE_BOX["dense"])
    box.start()
    sub = persistent(box.port, "S")
    sub.sendall(encoders.encode_subscribe(1, [("t", 2)]))
    assert read_packet(sub)[0] == 0x90
    sub.sendall(encoders.encode_disconnect())
    sub.close()
    pub = raw_connect(box.port, "P", keep_alive=60)
    pub.sendall(encoders.encode_publish("t", b"A", 2, False, 1))
    assert read_packet(pub)[0] >> 4 == 5  # PUBREC: on disk, queued for S
    pub.sendall(encoders.encode_pubrel(1))
    assert read_packet(pub)[0] >> 4 == 7
    pub.close()
    sub = persistent(box.port, "S")
    first, body = read_packet(sub)
    assert first >> 4 == 3 and body.endswith(b"A")
    packet_id = int.from_bytes(body[3:5], "big")  # after the topic "t"
    sub.sendall(encoders.encode_pubrec(packet_id))
    assert read_packet(sub) == (0x62, packet_id.to_bytes(2, "big"))  # PUBREL: S delivers A now
    box.crash()
    sub.close()
    box.start()
    sub = persistent(box.port, "S")
    assert read_packet(sub) == (0x62, packet_id.to_bytes(2, "big"))  # the PUBREL again, not the PUBLISH
    sub.sendall(encoders.encode_pubcomp(packet_id))
    sub.settimeout(0.5)
    with pytest.raises(TimeoutError):
        read_packet(sub)  # and nothing else
    sub.close()


@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_replies_held_for_a_commit_keep_their_order_before_a_suback_that_settles(
    boxes: list[Box], tmp_path: Path, engine: str
) -> None:
    """PUBLISHes and a SUBSCRIBE of a persistent session in one read, under a supervisor:
    the PUBACKs wait for their commit, the SUBACK for its commit and for the other
    workers; they go in the order the packets came."""
    box = new_box(boxes, tmp_path, ("--workers", "2", "--engine", engine))
    box.start()
    away_subscribers(box.port)  # the PUBLISHes below are queued for them: a commit each read
    sock = persistent(box.port, "mixed")
    burst = b"".join(encoders.encode_publish("q/x", f"m{i}".encode(), 1, False, i + 1) for i in range(5))
    sock.sendall(burst + encoders.encode_subscribe(9, [("late/#", 1)]) + encoders.encode_pingreq())
    got = [read_packet(sock) for _ in range(7)]
    assert [first for first, _ in got] == [0x40] * 5 + [0x90, 0xD0]
    assert [body for _, body in got[:5]] == [(i + 1).to_bytes(2, "big") for i in range(5)]
    sock.close()


@pytest.mark.parametrize("kind", ["dense", "workers"])
def test_a_second_server_on_a_store_in_use_is_refused_in_one_line(boxes: list[Box], tmp_path: Path, kind: str) -> None:
    box = new_box(boxes, tmp_path, ONE_BOX[kind])
    box.start()
    done = heartbeat("--persistence", str(box.store))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    holder = box.runs[-1].pid
    assert line.endswith(f": error: --persistence: {box.store}: is in use by another server (pid {holder})"
                         ": a store has one server"), line  # fmt: skip
    raw_connect(box.port, "still-served", keep_alive=30).close()  # the first goes on
    box.stop()
    box.start()  # and, stopped, lets go of it
    raw_connect(box.port, "after", keep_alive=30).close()
