"""What an MQTT 5 session's CONNECT costs, by how it asks for its session (issue 58).

MQTT 5 clients reconnect in three ways, and since issue 58 the server treats them as
the specification says, so two of them now ask the session store before CONNACK:

- ``clean``: Clean Start 1, Session Expiry 0 (a fresh, connection-long session; no store);
- ``reconnect``: Clean Start 0, Session Expiry 0, nothing stored (paho-mqtt's default
  reconnect: the store is asked, answers "none", and makes none);
- ``resume``: Clean Start 0 resuming a stored session that queued ``--queued`` QoS 1
  messages while its client was away (CONNACK, then every queued message read).

Each is timed from CONNECT sent to CONNACK read (and, for ``resume``, to the last queued
message read), ``--devices`` times in turn, on our server with one worker, with
``--workers 2`` (the store is the supervisor's, one round trip away), and on Mosquitto
2.0.11, all in the same run, rounds interleaved; printed as medians and p99s, and as
ratios to the ``clean`` connect of the same server.

    python -m benchmarks.session_resume --devices 400 --queued 10 --rounds 3
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from loadtest.mqtt_targets import mosquitto_binary, start_mosquitto
from loadtest.processes import free_port, start_heartbeat, stop
from servers.heartbeat.mqtt.v5.codec import pack, read_packet
from servers.heartbeat.mqtt.v5.packets import (
    PUBACK,
    Ack,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Publish,
    Subscribe,
    Subscription,
)
from servers.heartbeat.mqtt.v5.properties import Properties

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("clean", "reconnect", "resume")


class _Client:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(10)
        self.buf = b""

    def send(self, packet: Packet) -> None:
        self.sock.sendall(pack(packet))

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read(self) -> Packet:
        first = self._take(1)[0]
        length, shift = 0, 0
        while True:
            byte = self._take(1)[0]
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return read_packet(first, self._take(length))

    def leave(self) -> None:
        self.send(Disconnect())
        try:
            while self.sock.recv(65536):  # to the server's close: no reset
                pass
        except OSError:
            pass
        self.sock.close()


def _connect(port: int, client_id: str, clean: bool, expiry: int) -> tuple[_Client, Connack]:
    client = _Client(port)
    client.send(Connect(client_id, 60, clean, Properties(session_expiry_interval=expiry or None)))
    connack = client.read()
    assert isinstance(connack, Connack) and connack.reason_code == 0, connack
    return client, connack


def _prepare(port: int, client_id: str, queued: int) -> None:
    """A stored session that queued ``queued`` QoS 1 messages while away."""
    client, _ = _connect(port, client_id, True, 3600)
    client.send(Subscribe(1, (Subscription(f"bench/{client_id}", 1),)))
    client.read()
    client.leave()
    pub, _ = _connect(port, f"pub-{client_id}", True, 0)
    for i in range(1, queued + 1):
        pub.send(Publish(f"bench/{client_id}", b"x" * 32, 1, packet_id=i))
        ack = pub.read()
        assert isinstance(ack, Ack), ack
    pub.leave()


def _time_one(port: int, way: str, client_id: str, queued: int) -> float:
    if way == "resume":
        _prepare(port, client_id, queued)
    started = time.perf_counter()
    client, connack = _connect(port, client_id, way == "clean", 0)
    if way == "resume":
        assert connack.session_present
        for _ in range(queued):
            packet = client.read()
            while not isinstance(packet, Publish):
                packet = client.read()
            client.send(Ack(PUBACK, packet.packet_id or 0))
    took = time.perf_counter() - started
    client.leave()
    return took


def _run_round(servers: dict[str, int], devices: int, queued: int, round_: int) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = {}
    for name, port in servers.items():
        for way in WAYS:
            out[(name, way)] = [_time_one(port, way, f"r{round_}-{way}-{i}", queued) for i in range(devices)]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--devices", type=int, default=400, help="connects per way, server and round (default: 400)")
    parser.add_argument("--queued", type=int, default=10, help="messages a resumed session queued (default: 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the servers in turn (default: 3)")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.devices > 5000:
        parser.error(f"--devices {args.devices}: 1 to 5,000")
    if args.queued < 0 or args.queued > 1000:
        parser.error(f"--queued {args.queued}: 0 to 1,000")
    if args.rounds < 1 or args.rounds > 20:
        parser.error(f"--rounds {args.rounds}: 1 to 20")
    stops: list[Callable[[], object]] = []
    servers: dict[str, int] = {}
    try:
        for name, workers in (("idlekeeper", 1), ("idlekeeper --workers 2", 2)):
            port = free_port()
            proc = start_heartbeat(port, workers, ["--tick", "0.05"], cwd=str(ROOT))
            stops.append(partial(stop, proc))
            servers[name] = port
        if mosquitto_binary() is not None:
            mosquitto = start_mosquitto("mosquitto", free_port())
            stops.append(mosquitto.stop)
            servers["mosquitto"] = mosquitto.port
        else:
            print("mosquitto is not installed (apt-get install mosquitto): measured without it")
        samples: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for key, values in _run_round(servers, args.devices, args.queued, round_).items():
                samples.setdefault(key, []).extend(values)
    finally:
        for stop_one in stops:
            stop_one()
    print(f"{args.devices} connects per way, server and round, {args.rounds} rounds; resume reads {args.queued} queued")
    print(f"{'server':<24}{'way':<11}{'p50 ms':>8}{'p99 ms':>8}{'p50 / clean':>13}")
    for name in servers:
        base = statistics.median(samples[(name, "clean")])
        for way in WAYS:
            values = sorted(samples[(name, way)])
            p50 = statistics.median(values)
            p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
            print(f"{name:<24}{way:<11}{p50 * 1000:>8.2f}{p99 * 1000:>8.2f}{p50 / base:>12.2f}x")


if __name__ == "__main__":
    main()
