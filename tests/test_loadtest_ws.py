"""``python -m loadtest ws``, small: the WebSocket wire its clients speak, its bounds, and
a quick run against our server that must find what the server does: dead peers closed
after interval + timeout, healthy ones never, echoes counted, memory measured, slow
readers cut at the send timeout, silent MQTT-over-WebSocket devices closed after 1.5 x
keep-alive. And a server that sends no pings must be seen to close no dead peer. Wall
clock, about 20 s in all."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest.__main__ import main
from loadtest.processes import stop
from loadtest.ws.dead import dead_peers
from loadtest.ws.frames import BINARY, PING, FrameReader, accepted, client_frame, server_frame, upgrade_request
from loadtest.ws.report import ws_table
from loadtest.ws.targets import Pings, ping_flags, start_ws_target
from loadtest.ws.workload import QUICK, WsLoad

# A pong timeout with room for a busy shared machine: a healthy peer closed is a failure.
INTERVAL, TIMEOUT = 0.5, 1.0
TICK = 0.1


def test_a_client_frame_is_masked_and_server_frames_are_read_however_split() -> None:
    frame = client_frame(BINARY, b"hello")
    assert frame[0] == 0x82 and frame[1] == 0x80 | 5 and frame[6:] != b"hello"
    assert bytes(b ^ frame[2 + i % 4] for i, b in enumerate(frame[6:])) == b"hello"
    big = server_frame(BINARY, b"x" * 70_000)  # the 8-byte length
    wire = server_frame(PING, b"p") + big + server_frame(BINARY, b"y" * 300)
    reader = FrameReader()
    got = [f for i in range(0, len(wire), 7) for f in reader.feed(wire[i : i + 7])]
    assert [(f.opcode, len(f.payload)) for f in got] == [(PING, 1), (BINARY, 70_000), (BINARY, 300)]
    assert reader.pending() == 0


def test_only_a_101_that_answers_the_key_is_accepted() -> None:
    assert b"Sec-WebSocket-Protocol: mqtt" in upgrade_request(80, "/mqtt", "mqtt")
    good = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nSec-WebSocket-Accept: "
    key_line = next(line for line in upgrade_request(80).split(b"\r\n") if line.startswith(b"Sec-WebSocket-Key"))
    assert key_line  # the key is fixed, so is its answer:
    import base64
    import hashlib

    key = key_line.split(b": ")[1]
    answer = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    assert accepted(good + answer)
    assert not accepted(good + b"AAAA")
    assert not accepted(b"HTTP/1.1 404 Not Found\r\n")


def test_the_load_is_bounded() -> None:
    with pytest.raises(ValueError):
        WsLoad(connections=100_000)  # one client process holds at most 15,000 sockets
    with pytest.raises(ValueError):
        WsLoad(slow_window=3600)
    with pytest.raises(ValueError):
        WsLoad(mqtt_devices=10, mqtt_silent=11)
    assert QUICK.connections < WsLoad().connections


def test_each_server_is_told_its_pings_in_its_own_words() -> None:
    pings = Pings(1, 2)
    assert ping_flags("uvicorn-standard", pings) == ["--ws-ping-interval", "1", "--ws-ping-timeout", "2"]
    assert ping_flags("idlekeeper", pings) == ping_flags("uvicorn-standard", pings)
    assert ping_flags("hypercorn", pings) == ["--websocket-ping-interval", "1"]  # it has no pong timeout
    assert ping_flags("idlekeeper", Pings()) == []


def test_the_table_gives_ratios_to_ours() -> None:
    ours = {"idle": {"per_connection": 2000.0}, "dead": {"dead_closed": 100, "close_after_s": [2.0, 2.1]}}
    theirs = {"idle": {"per_connection": 20000.0}, "dead": {"dead_closed": 0, "close_after_s": []}}
    text = ws_table({"idlekeeper": ours, "hypercorn": theirs}, {"uvicorn-standard": "not installed"})
    row = next(line for line in text.splitlines() if line.startswith("| hypercorn |"))
    assert "20,000 B (10×)" in row and "| 0 (0.00×) |" in row
    assert "| uvicorn-standard | not run: not installed |" in text


def test_a_server_that_sends_no_pings_is_seen_to_close_no_dead_peer() -> None:
    server = start_ws_target("idlekeeper", Pings(interval=0), timeout=5.0)
    try:
        figures = dead_peers(server.port, dead=5, healthy=5, window=INTERVAL + TIMEOUT + 1)
    finally:
        stop(server.proc)
    assert figures.dead == 5 and figures.dead_closed == 0 and figures.healthy_closed == 0


@pytest.mark.bench
def test_quick_run_against_ours(tmp_path: Path) -> None:
    out = tmp_path / "ws.json"
    argv = ["ws", "--quick", "--targets", "idlekeeper", "--mqtt-targets", "idlekeeper", "--quiet", "--json", str(out)]
    argv += ["--connections", "100", "--ping-interval", str(INTERVAL), "--ping-timeout", str(TIMEOUT)]
    argv += ["--dead", "20", "--dead-window", "3", "--tick", str(TICK)]
    argv += ["--slow-readers", "3", "--timeout", "1", "--slow-window", "4"]
    argv += ["--mqtt-devices", "20", "--mqtt-silent", "5", "--mqtt-keepalive", "1", "--mqtt-grace", "3"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    run = data["ws"]["runs"]["idlekeeper"]
    assert run["idle"]["connections"] == 100 and run["idle"]["per_connection"] > 0
    assert run["echo"]["requests"] > 0 and run["echo"]["errors"] == 0
    dead = run["dead"]
    assert dead["dead"] == dead["healthy"] == 20 and dead["open_errors"] == 0, dead
    assert dead["dead_closed"] == 20 and dead["healthy_closed"] == 0, dead
    # Never before interval + timeout after the 101, and within a tick and some slack for
    # a shared machine after the last byte.
    assert min(dead["close_after_s"]) >= INTERVAL + TIMEOUT - 0.05
    assert max(dead["close_after_s"]) <= INTERVAL + TIMEOUT + TICK + 1.0
    slow = run["slow"]
    assert slow["cut"] == slow["readers"] == 3 and max(slow["cut_after_s"]) < 4
    assert slow["per_reader"] > 0
    mqtt = data["mqtt"]["runs"]["idlekeeper"]
    assert mqtt["connected"] == 20 and mqtt["silent"] == mqtt["detected"] == 5
    assert mqtt["false_expiries"] == 0 and mqtt["lateness_ms"]["min"] >= 0
    assert math.isfinite(mqtt["steady"]["rss_per_device_bytes"])
    assert "| idlekeeper |" in out.with_suffix(".md").read_text()
