"""``$SYS/broker/...`` side by side with a real Mosquitto: the same topics, payload
shapes and retain flags, and values that are right (the box's totals with --workers 2).

Both run as processes on loopback ports, each with a 1-second interval (Mosquitto's
runs every 2 s: it waits for more than the interval); paho-mqtt clients connect,
publish and subscribe to both in the same way.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from loadtest.mqtt_targets import PeerUnavailable, mosquitto_binary, start_mosquitto
from loadtest.processes import free_port, start_heartbeat, stop

IN_CI = os.environ.get("CI") == "true"
pytestmark = pytest.mark.skipif(
    mosquitto_binary() is None and not IN_CI, reason="the mosquitto broker is not installed: apt-get install mosquitto"
)

INTEGER = re.compile(rb"\d+")


def shape(topic: str) -> re.Pattern[bytes]:
    """Each topic's payload format as Mosquitto 2.0 writes it."""
    if topic == "$SYS/broker/version":
        return re.compile(rb"(mosquitto|idlekeeper) version \S+")
    if topic == "$SYS/broker/uptime":
        return re.compile(rb"\d+ seconds")
    if topic.startswith("$SYS/broker/load/"):
        return re.compile(rb"\d+\.\d\d")
    return INTEGER


@dataclass
class Seen:
    """What a $SYS/broker subscriber received: each topic's flags and last payload."""

    retained: dict[str, bytes] = field(default_factory=dict)
    live: dict[str, bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _client(port: int, name: str) -> paho.Client:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=name)
    client.connect("127.0.0.1", port, keepalive=60)
    client.loop_start()
    return client


def observe(port: int, seconds: float) -> Seen:
    """Connect three devices (one publishes twice, one retained), then watch $SYS/broker/#."""
    devices = [_client(port, f"dev-{i}") for i in range(3)]
    try:
        devices[0].publish("sensors/a", b"12345", qos=1).wait_for_publish(5)
        devices[0].publish("sensors/b", b"kept", qos=0, retain=True).wait_for_publish(5)
        seen = Seen()

        def on_message(_client: object, _userdata: object, message: paho.MQTTMessage) -> None:
            with seen.lock:
                (seen.retained if message.retain else seen.live)[message.topic] = bytes(message.payload)

        watcher = paho.Client(CallbackAPIVersion.VERSION2, client_id="watcher")
        watcher.on_message = on_message
        watcher.connect("127.0.0.1", port, keepalive=60)
        watcher.subscribe("$SYS/broker/#", qos=0)
        watcher.loop_start()
        time.sleep(seconds)
        watcher.loop_stop()
        watcher.disconnect()
        return seen
    finally:
        for device in devices:
            device.loop_stop()
            device.disconnect()


@pytest.fixture(scope="module")
def mosquitto_seen() -> Iterator[Seen]:
    port = free_port()
    try:
        target = start_mosquitto("mosquitto-sys", port, "sys_interval 1\n")
    except PeerUnavailable as exc:
        pytest.skip(str(exc))
    try:
        time.sleep(1.0)
        yield observe(port, 4.5)
    finally:
        target.stop()


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["--engine", "dense"], id="dense"),
        pytest.param(["--engine", "streams"], id="streams"),
        pytest.param(["--engine", "dense", "--workers", "2"], id="workers-2"),
    ],
)
def test_the_same_topics_shapes_and_flags_as_mosquitto(mosquitto_seen: Seen, extra: list[str]) -> None:
    workers = 2 if "--workers" in extra else 1
    args = [a for a in extra if a not in ("--workers", "2")]
    port = free_port()
    proc = start_heartbeat(port, workers, ["--sys-interval", "1", *args], timeout=60)
    try:
        time.sleep(1.0)
        # With two workers, each client may land on either: the box's totals count them all.
        ours = observe(port, 4.5)
    finally:
        stop(proc)
    theirs = mosquitto_seen
    missing_retained = sorted(set(theirs.retained) - set(ours.retained))
    # Live, each sends what changed: whether a peak moved in the window is the processes' own
    # business, and so is whether the heap did: Mosquitto counts every byte it allocates, this
    # server its resident pages, which a quiet process may hold for seconds on end (it is still
    # sent retained, checked above).
    own = {"$SYS/broker/clients/maximum", "$SYS/broker/heap/maximum", "$SYS/broker/heap/current"}
    missing_live = sorted(set(theirs.live) - set(ours.live) - own)
    assert missing_retained == [], f"Mosquitto sends these retained, we do not: {missing_retained}"
    assert missing_live == [], f"Mosquitto sends these live, we do not: {missing_live}"
    for seen in (ours, theirs):
        for topic, payload in {**seen.retained, **seen.live}.items():
            assert shape(topic).fullmatch(payload), (topic, payload)
    assert ours.retained["$SYS/broker/version"].startswith(b"idlekeeper version ")
    assert "$SYS/broker/version" not in ours.live and "$SYS/broker/version" not in theirs.live
    # The latest value of each count: four clients (the watcher among them) on both.
    for seen in (ours, theirs):
        latest = {**seen.retained, **seen.live}
        assert latest["$SYS/broker/clients/connected"] == b"4", latest
        assert latest["$SYS/broker/clients/active"] == b"4"
        assert latest["$SYS/broker/clients/total"] == b"4"
        assert int(latest["$SYS/broker/clients/maximum"]) >= 4
        assert int(latest["$SYS/broker/publish/messages/received"]) >= 1
        assert int(latest["$SYS/broker/messages/received"]) >= 4 + 1 + 1  # CONNECTs, a PUBLISH, the SUBSCRIBE
        assert int(latest["$SYS/broker/retained messages/count"]) >= 1
        assert int(latest["$SYS/broker/subscriptions/count"]) == 1
        assert float(latest["$SYS/broker/load/connections/1min"]) >= 0
    # Ours, exactly. Mosquitto 2.0.11 was seen to say 1 here for the two PUBLISHes (a QoS 1
    # and a retained QoS 0): its counts are the reference for shapes, not for values.
    latest = {**ours.retained, **ours.live}
    assert latest["$SYS/broker/publish/messages/received"] == b"2"
    assert latest["$SYS/broker/publish/bytes/received"] == b"9"
    assert int(latest["$SYS/broker/messages/received"]) >= 4 + 2 + 1  # CONNECTs, PUBLISHes, the SUBSCRIBE
