"""MQTT 3.1 (``MQIsdp``, protocol level 3), which old devices still send (issue 28):
paho-mqtt with ``MQTTv31``, the mosquitto clients with ``-V mqttv31`` and raw sockets,
on both engines. It was refused with CONNACK 1."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.policy import DEFAULT_PRESENCE_PREFIX as PRESENCE

from .conftest import wait_closed
from .test_heartbeat_clients import IN_CI, Server
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name

CONNACK_OK = b"\x20\x02\x00\x00"


def _connect31(port: int, client_id: str, **kw: object) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(5)
    wire = encoders.encode_connect(client_id, protocol_level=3, protocol_name="MQIsdp", **kw)  # type: ignore[arg-type]
    sock.sendall(wire)
    return sock


@pytest.mark.parametrize("engine", ["dense", "streams"])
def test_a_paho_31_device_is_served_with_presence_and_its_will(start_server: object, engine: str) -> None:
    server: Server = start_server("--engine", engine)  # type: ignore[operator]
    got: list[tuple[str, bytes]] = []
    subscribed = threading.Event()
    watcher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="old-watcher", protocol=mqtt.MQTTv31)
    watcher.on_message = lambda c, u, msg: got.append((msg.topic, bytes(msg.payload)))
    watcher.on_subscribe = lambda *a: subscribed.set()
    watcher.connect("127.0.0.1", server.port, keepalive=5)
    watcher.loop_start()
    try:
        watcher.subscribe([(f"{PRESENCE}#", 0), ("wills/#", 0), ("data/#", 1)])
        assert subscribed.wait(5)
        device = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="old-device", protocol=mqtt.MQTTv31)
        device.will_set("wills/old-device", b"gone", qos=1)
        device.connect("127.0.0.1", server.port, keepalive=1)
        device.loop_start()
        device.publish("data/t", b"from 3.1", qos=1).wait_for_publish(5)
        device.loop_stop()  # it falls silent with its socket open: a dead device
        offline = server.wait_for(lambda e: e.get("client_id") == "old-device" and e["status"] == "offline")
        deadline = time.monotonic() + 5
        while ("wills/old-device", b"gone") not in got and time.monotonic() < deadline:
            time.sleep(0.05)
        sock = device.socket()
        if sock is not None:
            sock.close()
    finally:
        watcher.disconnect()
        watcher.loop_stop()
    assert offline[0]["reason"] == "keepalive-timeout"
    assert ("data/t", b"from 3.1") in got and ("wills/old-device", b"gone") in got
    statuses = [json.loads(p)["status"] for t, p in got if t == f"{PRESENCE}old-device"]
    assert statuses == ["online", "offline"]


def test_a_31_client_must_send_an_id_and_never_hears_of_a_session_present(start_server: object) -> None:
    server: Server = start_server()  # type: ignore[operator]
    empty = _connect31(server.port, "")
    assert empty.recv(4) == b"\x20\x02\x00\x02"  # identifier rejected, as 3.1 requires an id
    assert wait_closed(empty, 5)
    # A persistent session is kept and resumed, but 3.1's CONNACK has no flag to say so.
    first = _connect31(server.port, "old-keeper", clean_session=False)
    assert first.recv(4) == CONNACK_OK
    first.sendall(encoders.encode_subscribe(1, [("cmd/old-keeper", 1)]))
    assert first.recv(5) == b"\x90\x03\x00\x01\x01"
    first.sendall(encoders.encode_disconnect())
    assert wait_closed(first, 5)
    sender = _connect31(server.port, "old-sender")
    assert sender.recv(4) == CONNACK_OK
    sender.sendall(encoders.encode_publish("cmd/old-keeper", b"wake up", qos=1, packet_id=9))
    assert sender.recv(4) == b"\x40\x02\x00\x09"
    again = _connect31(server.port, "old-keeper", clean_session=False)
    assert again.recv(4) == CONNACK_OK  # not 0x01: the byte is reserved in 3.1
    delivered = b""
    deadline = time.monotonic() + 5
    while b"wake up" not in delivered and time.monotonic() < deadline:
        delivered += again.recv(100)
    # The queued QoS 1 message, delivered on resuming: the session was kept.
    assert delivered[0] & 0xF6 == 0x32 and b"\x00\x0ecmd/old-keeper" in delivered and delivered.endswith(b"wake up")
    for sock in (sender, again):
        sock.close()


def test_a_3_1_connect_with_another_level_is_still_refused_with_the_specs_code(start_server: object) -> None:
    server: Server = start_server()  # type: ignore[operator]
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(5)
    sock.sendall(encoders.encode_connect("x", protocol_level=4, protocol_name="MQIsdp"))
    assert sock.recv(4) == b"\x20\x02\x00\x01"
    sock.close()


@pytest.mark.skipif(
    shutil.which("mosquitto_sub") is None and not IN_CI,
    reason="mosquitto-clients not installed (apt-get install mosquitto-clients; CI installs it)",
)
def test_the_mosquitto_clients_speak_31_to_it(start_server: object) -> None:
    server: Server = start_server()  # type: ignore[operator]
    at = ("-V", "mqttv31", "-h", "127.0.0.1", "-p", str(server.port))
    sub = subprocess.Popen(
        ["mosquitto_sub", *at, "-i", "old-sub", "-t", "t", "-C", "1", "-W", "15"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server.wait_for(lambda e: e.get("client_id") == "old-sub" and e["status"] == "online")
        time.sleep(0.3)
        done = subprocess.run(
            ["mosquitto_pub", *at, "-i", "old-pub", "-t", "t", "-m", "hello from 3.1"],
            capture_output=True,
            timeout=10,
        )
        assert done.returncode == 0, done.stderr
        out, _ = sub.communicate(timeout=15)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    assert out.strip() == "hello from 3.1"
