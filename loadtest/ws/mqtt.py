"""MQTT devices over WebSockets, ours beside Mosquitto's WebSocket listener: keep-alive
close lateness and memory per idle device.

Devices open a WebSocket at ``/mqtt`` with the ``mqtt`` subprotocol (as MQTT.js and
Paho JavaScript do), send CONNECT with keep-alive K in a binary frame, and ping K after
their last packet, less up to a share ``jitter`` of it (as ``loadtest devices``' devices
do, so that their phases spread over the server's ticks and scans). Once all are online, the silent ones each
stop at a random moment within the next K (their deadlines are spread over the server's
scan, not bunched), with the socket left open. Each device is a
:class:`~loadtest.generator.records.Device` record, judged by
:func:`~loadtest.generator.results.judge_devices` as ``loadtest devices`` judges devices
over TCP: lateness is the close seen by the device minus (its last packet + 1.5 K), and a
healthy device closed is a false expiry. The figures have the shape of a device run's, so
``compare``'s device columns show them.

Targets: ``idlekeeper`` is ``servers.heartbeat --ws-port`` (one worker); ``mosquitto`` is
the Debian broker with a second listener carrying ``protocol websockets``.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import random
import select
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..generator.records import CONNACK_OK, PINGREQ, Device, encode_connect
from ..generator.results import judge_devices
from ..mqtt_targets import MqttTarget, PeerUnavailable, start_mosquitto
from ..processes import CpuSplit, free_port, pin, start_heartbeat, wait_listening
from ..sampler import processes, rss_bytes
from ..stats import summary_ms
from ..workload import DeviceLoad
from .connect import WsPeer, close_all, open_websockets, receive
from .frames import BINARY, CLOSE, PING, PONG, FrameReader, client_frame
from .idle import WARM_UP

__all__ = ["MQTT_WS_TARGETS", "MqttWsLoad", "MqttWsServer", "run_mqtt_devices", "start_mqtt_ws_target"]

MQTT_WS_TARGETS = ("idlekeeper", "mosquitto")
PATH = "/mqtt"
SUBPROTOCOL = "mqtt"
_PINGREQ_FRAME = client_frame(BINARY, PINGREQ)


@dataclass(frozen=True)
class MqttWsLoad:
    """The device fleet: how many, how many go silent, and their keep-alive."""

    devices: int = 1000
    silent: int = 100
    keepalive: int = 2
    jitter: float = DeviceLoad.jitter
    """The share of K a ping may come early by, at random."""
    grace: float = 10.0
    """Seconds past every silent device's deadline a server has to close it (Mosquitto
    scans keep-alives every 5-6 s)."""
    seed: int = 29


@dataclass
class MqttWsServer:
    """A running MQTT server with a WebSocket listener on ``ws_port``."""

    target: MqttTarget
    ws_port: int

    @property
    def name(self) -> str:
        """The target's name."""
        return self.target.name

    def pids(self) -> list[int]:
        """Every process of the server."""
        return self.target.pids()

    def stop(self) -> None:
        """Stop it by its PID."""
        self.target.stop()


def start_mqtt_ws_target(name: str, tick: float, split: CpuSplit | None = None) -> MqttWsServer:
    """Start ``name`` with an MQTT-over-WebSocket listener on a free port (pinned to
    ``split``'s server CPUs when given); return once that listener accepts connections."""
    port, ws_port = free_port(), free_port()
    if name == "mosquitto":
        # The broker's Debian build has libwebsockets: a second listener speaks MQTT over it.
        target = start_mosquitto("mosquitto-ws", port, f"listener {ws_port} 127.0.0.1\nprotocol websockets\n")
        target.name = name
    elif name == "idlekeeper":
        extra = ["--ws-port", str(ws_port), "--ws-path", PATH, "--tick", str(tick)]
        target = MqttTarget(name, start_heartbeat(port, 1, extra), port)
    else:
        raise PeerUnavailable(f"unknown MQTT-over-WebSocket target {name!r}")
    try:
        wait_listening(ws_port, target.proc)
    except RuntimeError:
        target.stop()
        raise
    if split is not None:
        pin(target.pids(), split.server)
    return MqttWsServer(target, ws_port)


class _Fleet:
    """The devices of one run on one epoll, their pings on a heap."""

    def __init__(self, load: MqttWsLoad) -> None:
        self.load = load
        self.rng = random.Random(load.seed)
        self.ep = select.epoll()
        self.devices: list[Device] = []
        self.peers: dict[int, tuple[Device, WsPeer, FrameReader]] = {}
        self.pings: list[tuple[float, int, int]] = []  # (due, device index, fd)
        self.silence_at: dict[int, float] = {}
        self.peers_opened: list[WsPeer] = []

    def add(self, peer: WsPeer) -> None:
        """A device on ``peer``: its CONNECT goes now."""
        k = self.load.keepalive
        device = Device(len(self.devices), f"ws-dev-{len(self.devices)}", keepalive=k)
        self.devices.append(device)
        self.peers_opened.append(peer)
        fd = peer.sock.fileno()
        self.peers[fd] = (device, peer, FrameReader())
        self.ep.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
        device.connect_started = time.monotonic()
        self.send(device, peer, client_frame(BINARY, encode_connect(device.client_id, k)))
        self.feed(fd, peer.rest)

    def send(self, device: Device, peer: WsPeer, frame: bytes) -> None:
        # Stamped before send(): the bytes cannot reach the server earlier, so lateness
        # measured from it is never understated (as the TCP generator does).
        now = time.monotonic()
        try:
            peer.sock.send(frame)
        except OSError:
            self.closed(peer.sock.fileno(), time.monotonic())
            return
        if device.last_sent == device.last_sent:
            device.max_gap = max(device.max_gap, now - device.last_sent)
        device.last_sent = now

    def silence(self, count: int, start: float) -> None:
        """``count`` devices go silent, each at a random moment within a keep-alive of ``start``."""
        for index in self.rng.sample(range(len(self.devices)), min(count, len(self.devices))):
            self.devices[index].role = "silent"
            self.silence_at[index] = start + self.rng.uniform(0, self.load.keepalive)

    def serve(self, timeout: float) -> None:
        """Read what came, then send the pings that are due."""
        for fd, _events in self.ep.poll(timeout):
            if fd not in self.peers:
                continue
            _device, peer, _reader = self.peers[fd]
            data = receive(peer.sock)
            if data is None:
                continue
            if not data:
                self.closed(fd, time.monotonic())
                continue
            self.feed(fd, data)
        now = time.monotonic()
        while self.pings and self.pings[0][0] <= now:
            _due, index, fd = heapq.heappop(self.pings)
            if fd not in self.peers:
                continue
            device, peer, _reader = self.peers[fd]
            silent_from = self.silence_at.get(index)
            if silent_from is not None and now >= silent_from:
                device.acted_at = now  # skips this ping and every one after
                continue
            self.send(device, peer, _PINGREQ_FRAME)
            self.arm(index, fd)

    def arm(self, index: int, fd: int) -> None:
        """Its next ping: a keep-alive after its last packet, less the jitter."""
        device = self.devices[index]
        delay = device.keepalive * (1.0 - self.load.jitter * self.rng.random())
        heapq.heappush(self.pings, (device.last_sent + delay, index, fd))

    def feed(self, fd: int, data: bytes) -> None:
        device, peer, reader = self.peers[fd]
        for frame in reader.feed(data):
            if frame.opcode == BINARY:
                if device.connack_at != device.connack_at and frame.payload.startswith(CONNACK_OK):
                    device.connack_at = time.monotonic()
                    self.arm(device.index, fd)
            elif frame.opcode == PING:
                with contextlib.suppress(OSError):
                    peer.sock.send(client_frame(PONG, frame.payload))
            elif frame.opcode == CLOSE:
                self.closed(fd, time.monotonic())
                return

    def closed(self, fd: int, now: float) -> None:
        entry = self.peers.pop(fd, None)
        if entry is None:
            return
        entry[0].closed_at = now
        with contextlib.suppress(OSError):
            self.ep.unregister(fd)

    def online(self) -> int:
        """Devices with a CONNACK and an open connection."""
        return sum(1 for d, _, _ in self.peers.values() if d.connack_at == d.connack_at)

    def silent_open(self) -> int:
        """Silent devices the server has not closed yet."""
        return sum(1 for d, _, _ in self.peers.values() if d.role == "silent")


def run_mqtt_devices(port: int, pids: list[int], load: MqttWsLoad, open_timeout: float = 60.0) -> dict[str, Any]:
    """Run ``load`` against the WebSocket listener on ``port`` of a server (``pids``); the
    figures, shaped as a ``loadtest devices`` run's (for :func:`loadtest.compare.device_row`)."""
    warm = open_websockets(port, min(WARM_UP, load.devices), path=PATH, subprotocol=SUBPROTOCOL)
    close_all(warm.peers)
    time.sleep(1.0)
    procs = processes(pids)
    rss_before = rss_bytes(procs)
    fleet = _Fleet(load)
    k = load.keepalive
    try:
        opened = open_websockets(
            port,
            load.devices,
            path=PATH,
            subprotocol=SUBPROTOCOL,
            timeout=open_timeout,
            on_open=fleet.add,
            between=lambda: fleet.serve(0),
        )
        open_errors = opened.errors
        # Everyone's CONNACK (bounded), then a moment for the server to settle before its RSS is read.
        connacks_by = time.monotonic() + 10.0
        while fleet.online() < len(fleet.devices) and time.monotonic() < connacks_by:
            fleet.serve(0.05)
        start = time.monotonic()
        while time.monotonic() < start + 1.0:
            fleet.serve(0.05)
        rss_after = rss_bytes(procs)
        online = fleet.online()
        fleet.silence(load.silent, start)
        # Every silent device is due by start + K (its last ping) + 1.5 K; healthy devices are
        # watched for at least that long, then until the stragglers are closed or the grace ends.
        due = start + k + 1.5 * k
        end = due + load.grace
        while time.monotonic() < end:
            fleet.serve(0.05)
            if time.monotonic() > due + 1.0 and fleet.silent_open() == 0:
                break
    finally:
        fleet.ep.close()
        close_all(fleet.peers_opened)
    judged = judge_devices(fleet.devices, 1.5 * k, failover=False)
    lateness = judged["lateness"]
    acted = [d for d in fleet.devices if d.role == "silent" and d.acted_at == d.acted_at]
    return {
        "devices": load.devices,
        "connected": judged["connected"],
        "open_errors": open_errors,
        "online_at_settle": online,
        "silent": len(acted),
        "detected": len(lateness),
        "undetected": judged["undetected"],
        "lateness_ms": summary_ms(lateness),
        "false_expiries": len(judged["false_expiries"]),
        "generator_late": judged["generator_late"],
        "rss_before": rss_before,
        "rss_after": rss_after,
        "steady": {"rss_per_device_bytes": (rss_after - rss_before) / online if online else math.nan},
        "keepalive": k,
    }


def mosquitto_has_websockets(binary: str | None) -> bool:
    """Whether a Mosquitto binary was built with WebSockets (it links libwebsockets)."""
    if binary is None:
        return False
    with contextlib.suppress(OSError):
        return b"libwebsockets" in Path(binary).read_bytes()
    return False
