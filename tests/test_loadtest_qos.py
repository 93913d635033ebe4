"""``python -m loadtest qos``, small: QoS 1 throughput delivered exactly once, and a persistent
session's queued messages delivered on return, all of them, in order; against our server,
and against Mosquitto when it is installed. On the wall clock, a few seconds per target.

Mosquitto's throughput is checked as ``mosquitto-inflight0``: with its default in-flight
window, 2.0.11 reorders and strands messages that queue behind it (see loadtest.qos.cli),
which the measurement reports and a test here would only restate."""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from loadtest import mqtt_frames, qos
from loadtest.__main__ import main
from loadtest.mqtt_targets import mosquitto_binary
from loadtest.qos import client as qos_client
from loadtest.qos import load as qos_load
from loadtest.qos import report as qos_report
from servers.heartbeat.mqtt.encoders import encode_puback, encode_publish

from .redis_server import require_binary

SMALL = qos_load.QosLoad(publishers=2, duration=1.0, warmup=0.2, queued=2000)

needs_mosquitto = pytest.mark.skipif(
    mosquitto_binary() is None,
    reason="mosquitto is not installed (apt-get install mosquitto): only our server is measured",
)
BOTH = ("throughput", "queued")
TARGETS = [
    pytest.param("idlekeeper", BOTH, id="idlekeeper"),
    pytest.param("mosquitto-inflight0", ("throughput",), id="mosquitto-inflight0", marks=needs_mosquitto),
    pytest.param("mosquitto", ("queued",), id="mosquitto", marks=needs_mosquitto),
]
# The table's figures each kind of run fills in.
FIGURES = {
    BOTH: [key for key, _, _, _ in qos_report.QOS_COLUMNS],
    ("throughput",): ["msgs_per_s", "latency_p50_ms", "latency_p99_ms", "lost", "duplicates", "out_of_order"],
    ("queued",): ["bytes_per_queued", "queued_lost", "queued_out_of_order", "drain_msgs_per_s", "drain_cpu_us_per_msg"],
}


def test_publish_prefix_is_the_encoders_framing() -> None:
    payload = qos_load.PAYLOAD_HEADER.pack(3, 7, 123) + bytes(48)
    built = qos_client.publish_prefix("bench/3", len(payload)) + (8).to_bytes(2, "big") + payload
    assert built == encode_publish("bench/3", payload, qos=1, packet_id=8)


def test_frames_take_whole_packets_only() -> None:
    big = encode_publish("q/m", bytes(300), qos=1, packet_id=2)  # a two-byte remaining length
    packets = [encode_publish("bench/0", b"x" * 20, qos=1, packet_id=1), encode_puback(5), big]
    wire = b"".join(packets)
    ends = [sum(len(p) for p in packets[: k + 1]) for k in range(len(packets))]
    for cut in range(len(wire) + 1):
        found, used = mqtt_frames.frames(wire[:cut])
        whole = [end for end in ends if end <= cut]
        assert used == (whole[-1] if whole else 0)
        assert [first for first, _, _ in found] == [p[0] for p in packets[: len(whole)]]
    found, _ = mqtt_frames.frames(wire)
    _, start, end = found[2]
    assert wire[start:end] == big[3:]


def test_the_ratio_row_is_ours_over_mosquitto() -> None:
    rows = {
        "idlekeeper": {key: 1000.0 for key, _, _, _ in qos_report.QOS_COLUMNS},
        "mosquitto": {key: 4000.0 for key, _, _, _ in qos_report.QOS_COLUMNS},
    }
    rows["mosquitto"]["lost"] = 0.0
    last = qos_report.qos_table(rows, {}).splitlines()[-1]
    assert last.startswith("| idlekeeper / mosquitto | 0.25× |")
    assert "—" in last  # lost: no ratio to a zero


@pytest.mark.parametrize(("name", "parts"), TARGETS)
def test_qos_delivers_exactly_once_and_queues_in_order(name: str, parts: tuple[str, ...]) -> None:
    out = qos.run_qos(SMALL, [name], parts, quiet=True)
    assert out["missing"] == {}
    run = out["runs"][name]
    assert set(run) == {"target", *parts}
    if "throughput" in parts:
        check_throughput(run["throughput"])
    if "queued" in parts:
        check_queued(run["queued"])
    row = out["rows"][name]
    for key in FIGURES[parts]:
        assert not math.isnan(row[key]), key
    assert f"| {name} |" in out["table"]


def check_throughput(t: dict[str, Any]) -> None:
    assert t["errors"] == []
    assert t["exactly_once"]
    assert t["published"] == t["publish_acked"] == t["received"] == t["unique"] > 0
    assert (t["lost"], t["duplicates"], t["out_of_order"], t["dup_flagged"], t["foreign"]) == (0, 0, 0, 0, 0)
    assert t["msgs_per_s"] > 0
    assert t["latency_ms"]["n"] > 0 and t["latency_ms"]["p50"] > 0
    assert t["latency_ms"]["p99"] >= t["latency_ms"]["p50"]
    assert t["client_cpu_pct"] > 0 and t["server_cpu_pct"] > 0 and t["machine_cpu_pct"] > 0


def check_queued(q: dict[str, Any]) -> None:
    assert q["granted_qos"] == 1
    assert q["session_present"]
    assert q["received"] == q["unique"] == SMALL.queued
    assert (q["lost"], q["duplicates"], q["out_of_order"]) == (0, 0, 0)
    assert q["in_order"] and q["ok"]
    assert q["bytes_per_queued"] > 0
    assert q["drain_msgs_per_s"] > 0
    assert q["drain_cpu_us_per_msg"] >= 0  # a number (not NaN); 2,000 messages may take under a clock tick


def test_the_command_writes_json_and_a_table(tmp_path: Path) -> None:
    path = tmp_path / "qos.json"
    argv = ["qos", "--targets", "idlekeeper", "--parts", "throughput", "--publishers", "1"]
    argv += ["--duration", "0.5", "--warmup", "0", "--json", str(path), "--quiet"]
    assert main(argv) == 0
    data = json.loads(path.read_text())
    assert data["runs"]["idlekeeper"]["throughput"]["exactly_once"]
    assert "queued" not in data["runs"]["idlekeeper"]
    assert "| idlekeeper |" in path.with_suffix(".md").read_text()


def test_a_client_comes_back_while_the_server_is_unavailable() -> None:
    """CONNACK 3 ("server unavailable", a fleet gateway behind on its reports) is tried
    again, as a device would; any other refusal is not."""
    answers = [b"\x20\x02\x00\x03", b"\x20\x02\x00\x03", b"\x20\x02\x01\x00", b"\x20\x02\x00\x05"]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for answer in answers:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(answer)
                conn.recv(1024)  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        sock, present, refused, _began = qos_client.open_when_available(port, "back", clean=False, timeout=5)
        sock.close()
        assert (present, refused) == (True, 2)
        with pytest.raises(RuntimeError, match="0005") as refusal:
            qos_client.open_when_available(port, "bad", timeout=5)
        assert not isinstance(refusal.value, qos_client.Unavailable)
    finally:
        thread.join(timeout=5)
        listener.close()


def test_the_queued_part_through_a_fleet_drains_from_redis() -> None:
    """``idlekeeper-fleet``: the persistent session and its queue live in a real
    redis-server the target starts (and stops); the queue still arrives whole, in order,
    exactly once, each read's acknowledgements taken in one call of the session script."""
    require_binary()
    out = qos.run_qos(SMALL, ["idlekeeper-fleet"], ("queued",), quiet=True)
    assert out["missing"] == {}
    check_queued(out["runs"]["idlekeeper-fleet"]["queued"])
    assert "| idlekeeper-fleet |" in out["table"]


def test_the_queued_part_with_workers_drains_through_the_supervisor() -> None:
    """``--workers 2``: the persistent session lives in the supervisor, and its queue
    still arrives whole, in order, exactly once (each read's acknowledgements go to
    the supervisor as one report)."""
    load = dataclasses.replace(SMALL, workers=2)
    assert "--workers 2" in qos_report.headline(load)
    out = qos.run_qos(load, ["idlekeeper"], ("queued",), quiet=True)
    assert out["missing"] == {}
    check_queued(out["runs"]["idlekeeper"]["queued"])
    with pytest.raises(ValueError, match="workers"):
        qos_load.QosLoad(workers=0)
