"""The MQTT servers ``python -m loadtest compare`` measures, each as its own process
against raw-socket clients: the trio-native baseline's keep-alive and takeover, and
that each peer starts, speaks MQTT 3.1.1 and stops by its PID."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from loadtest.mqtt_targets import AMQTT_VENV, MqttTarget, ensure_amqtt_venv, mosquitto_binary, start_mqtt_target
from loadtest.processes import free_port
from servers.heartbeat.mqtt import encoders

from .conftest import wait_closed

IN_CI = os.environ.get("CI") == "true"


def connect(port: int, client_id: str, keep_alive: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(encoders.encode_connect(client_id, keep_alive=keep_alive))
    assert sock.recv(4) == encoders.encode_connack(False, 0)
    return sock


def closed_after(sock: socket.socket, timeout: float) -> float:
    """Seconds until the server closes ``sock``."""
    start = time.monotonic()
    return wait_closed(sock, timeout) - start


@pytest.fixture
def target(request: pytest.FixtureRequest) -> Iterator[MqttTarget]:
    started = start_mqtt_target(request.param, free_port())
    yield started
    started.stop()
    assert started.proc.poll() is not None  # stopped by its PID


@pytest.mark.parametrize("target", ["baseline"], indirect=True)
def test_baseline_pings_times_out_and_takes_over(target: MqttTarget) -> None:
    sock = connect(target.port, "dev-1", keep_alive=1)
    sock.sendall(encoders.encode_pingreq())
    assert sock.recv(2) == encoders.encode_pingresp()
    silent = closed_after(sock, 5)
    # The server's 1.5 K starts at its read after sending PINGRESP, a little before our
    # clock starts here; 50 ms covers this process being descheduled in between.
    assert 1.5 - 0.05 <= silent <= 1.5 + 0.5  # move_on_after(1.5 K) around the read
    old = connect(target.port, "dev-2", keep_alive=30)
    new = connect(target.port, "dev-2", keep_alive=30)
    assert closed_after(old, 2) < 1.0  # the takeover closed it at once
    new.sendall(encoders.encode_pingreq())
    assert new.recv(2) == encoders.encode_pingresp()
    new.close()


def _peer(name: str) -> str:
    if name == "mosquitto" and mosquitto_binary() is None and not IN_CI:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run does it in CI)")
    if name == "amqtt" and not AMQTT_VENV.exists():
        if not IN_CI:
            pytest.skip("amqtt's own venv is absent: python -m loadtest compare creates .venv-amqtt on first use")
        ensure_amqtt_venv()
    return name


@pytest.mark.parametrize("name", ["mosquitto", "amqtt"])
def test_peer_starts_speaks_mqtt_and_stops(name: str) -> None:
    started = start_mqtt_target(_peer(name), free_port())
    try:
        sock = connect(started.port, f"probe-{name}", keep_alive=30)
        sock.sendall(encoders.encode_pingreq())
        assert sock.recv(2) == encoders.encode_pingresp()
        assert started.pids() and started.proc.pid in started.pids()
        sock.close()
    finally:
        started.stop()
    assert started.proc.poll() is not None
