"""A device's keep-alive stays on its record after it goes offline (issue 61, item 6).

``/devices/<id>`` shows the keep-alive the device asked for. With one worker the
registry holds the events themselves; with ``--workers N`` it gets them over the
bus, and in a fleet from Redis, both as :meth:`PresenceEvent.to_dict` made them, so
an offline event that left the keep-alive out read back as 0. Checked here on the
event, on a bus frame, and on real servers: a box of two workers and a fleet of two
gateways, with paho and raw-socket devices, every process stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from servers.heartbeat.coordination import frames
from servers.heartbeat.mqtt import encoders
from servers.heartbeat.mqtt.endings import Offline
from servers.heartbeat.presence.event import OFFLINE, ONLINE, PresenceEvent

from .redis_server import RedisServer
from .test_fleet_faults import kill_gateways, start_gateways
from .test_fleet_faults import redis as redis  # the fixture, used by name
from .test_heartbeat_clients import Server, paho_client, raw_connect
from .test_heartbeat_clients import start_server as start_server  # the fixture, used by name
from .test_presence_faults import until


def session(status: str, reason: Offline | None = None, keep_alive: int = 2) -> PresenceEvent:
    return PresenceEvent(
        status, "meter-1", "127.0.0.1:5000", reason, silent_for=3.05 if reason else 0.0, time=1795789199.25,
        worker=1, epoch="1.4242.7", keep_alive=keep_alive, protocol_level=4,
    )  # fmt: skip


# -- the event -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reason", [Offline.KEEPALIVE_TIMEOUT, Offline.WORKER_LOST, Offline.NODE_LOST, Offline.SHUTDOWN]
)
def test_an_offline_event_read_back_has_the_keep_alive_its_device_asked(reason: Offline) -> None:
    event = session(OFFLINE, reason)
    assert event.to_dict()["keep_alive"] == 2
    assert PresenceEvent.from_dict(event.to_dict()) == event
    assert PresenceEvent.from_dict(json.loads(event.payload())) == event


def test_an_online_event_still_reads_back_whole() -> None:
    event = session(ONLINE)
    assert PresenceEvent.from_dict(event.to_dict()) == event


def test_a_worker_reporting_a_silent_device_to_the_supervisor_keeps_its_keep_alive() -> None:
    ended = frames.Ended(3, session(OFFLINE, Offline.KEEPALIVE_TIMEOUT, keep_alive=45))
    back = frames.decode(frames.encode(ended))
    assert isinstance(back, frames.Ended) and back.event.keep_alive == 45 and back == ended


# -- real servers ----------------------------------------------------------------------------


def device(status_port: int, client_id: str) -> dict[str, Any] | None:
    """``/devices/<client_id>`` on ``status_port``, or None if it is not known (yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/devices/{client_id}", timeout=5) as r:
            found: dict[str, Any] = json.loads(r.read())
            return found
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def wait_offline(status_port: int, client_id: str, reason: str, timeout: float = 15.0) -> dict[str, Any]:
    """The device's record once it says offline with ``reason``."""
    seen: list[dict[str, Any] | None] = []

    def ended() -> bool:
        seen.append(device(status_port, client_id))
        last = seen[-1]
        return last is not None and last["status"] == "offline" and last["reason"] == reason

    until(ended, timeout, f"{client_id} offline ({reason}); last seen {seen[-1:]}")
    record = seen[-1]
    assert record is not None
    return record


def paho_device(port: int, client_id: str, keep_alive: int) -> Any:
    """A paho device connected with ``keep_alive``, its network loop running."""
    client = paho_client(client_id)
    connected = threading.Event()
    client.on_connect = lambda *a: connected.set()
    client.connect("127.0.0.1", port, keepalive=keep_alive)
    client.loop_start()
    assert connected.wait(5)
    return client


def test_devices_page_of_two_workers_shows_the_keep_alive_after_a_device_went_silent_left_or_lost_its_worker(
    start_server: Any,
) -> None:
    server: Server = start_server(workers=2, status=True)
    assert server.status_port is not None
    status = server.status_port

    silent = paho_device(server.port, "ka-silent", keep_alive=2)
    leaving = paho_device(server.port, "ka-leaving", keep_alive=7)
    until(lambda: (device(status, "ka-silent") or {}).get("status") == "online", 10, "ka-silent online")
    assert device(status, "ka-silent")["keep_alive"] == 2  # type: ignore[index]
    silent.loop_stop()  # no more PINGREQs: the server ends it after 1.5 x 2 s
    leaving.disconnect()
    leaving.loop_stop()

    gone = wait_offline(status, "ka-silent", "keepalive-timeout")
    assert gone["keep_alive"] == 2, gone
    left = wait_offline(status, "ka-leaving", "disconnect")
    assert left["keep_alive"] == 7, left
    silent.socket().close()

    # A worker killed: the supervisor's authority ends its sessions (worker-lost).
    held = raw_connect(server.port, "ka-held", keep_alive=9)
    until(lambda: (device(status, "ka-held") or {}).get("status") == "online", 10, "ka-held online")
    record = device(status, "ka-held")
    assert record is not None
    worker, pid = int(record["worker"]), int(str(record["epoch"]).split(".")[1])
    other_status = status + (1 - worker)  # worker i serves status on port + i
    os.kill(pid, signal.SIGKILL)  # the worker we started (a child of our server), by its PID
    lost = wait_offline(other_status, "ka-held", "worker-lost")
    assert lost["keep_alive"] == 9, lost
    held.close()


def test_devices_page_of_a_fleet_shows_the_keep_alive_after_a_device_went_silent_moved_or_lost_its_gateway(
    redis: RedisServer, tmp_path: Path
) -> None:
    gateways = start_gateways(redis.url, tmp_path)
    try:
        (_, port0, status0, log0), (gw1, port1, _, _) = gateways
        silent = paho_device(port1, "fk-silent", keep_alive=2)
        until(lambda: (device(status0, "fk-silent") or {}).get("status") == "online", 10, "fk-silent online")
        silent.loop_stop()
        gone = wait_offline(status0, "fk-silent", "keepalive-timeout")
        assert gone["keep_alive"] == 2, gone
        silent.socket().close()

        # A device that moves to the other gateway: Redis writes its old session's end.
        roamer = raw_connect(port1, "fk-roamer", keep_alive=20)
        until(lambda: (device(status0, "fk-roamer") or {}).get("status") == "online", 10, "fk-roamer online")
        moved = raw_connect(port0, "fk-roamer", keep_alive=5)
        roamer.settimeout(5)
        assert roamer.recv(1) == b""  # closed: taken over

        def takeover() -> list[dict[str, Any]]:
            lines = log0.read_text().splitlines() if log0.exists() else []
            events = [json.loads(line) for line in lines]
            return [e for e in events if e.get("client_id") == "fk-roamer" and e["reason"] == "takeover"]

        until(takeover, 10, "the roamer's takeover in the presence log")
        assert [e["keep_alive"] for e in takeover()] == [20]

        # A gateway killed: when its lease lapses, the other declares its devices lost.
        held = raw_connect(port1, "fk-held", keep_alive=30)
        until(lambda: (device(status0, "fk-held") or {}).get("status") == "online", 10, "fk-held online")
        gw1.kill()  # SIGKILL, by PID
        gw1.wait()
        lost = wait_offline(status0, "fk-held", "node-lost", timeout=20)
        assert lost["keep_alive"] == 30, lost
        moved.sendall(encoders.encode_disconnect())
        for sock in (moved, held):
            sock.close()
    finally:
        kill_gateways(gateways)
