"""Topic aliases towards MQTT 5 subscribers: bytes on the wire, with and without, in one run.

    python -m benchmarks.aliases [--messages 20000] [--topics 50] [--aliases 10] [--payload 8]

Our server (one worker) and Mosquitto 2.0.11 each get two MQTT 5 subscribers to
``sensors/#``: one whose CONNECT allows ``--aliases`` topic aliases, one that allows
none. A publisher sends ``--messages`` QoS 0 messages of ``--payload`` bytes over
``--topics`` topics shaped like a building's sensors
(``sensors/building-7/floor-3/room-12/temperature``), chosen with a Zipf-like skew (a
few topics are busy, most are quiet), from a fixed seed. Each subscriber counts the
bytes its socket received and resolves the aliases as a client does; the report gives
bytes per message and the ratio, and whether every topic was read right. Mosquitto
assigns no aliases: its two rows are the reference. A second table times the
rewrite itself (:class:`~servers.heartbeat.mqtt.v5.aliases.OutboundAliases.apply`) beside
the encoding of the PUBLISH it rewrites, in this process. Loopback only; each server
is stopped by its PID; each target is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import threading
import time
import timeit
from dataclasses import dataclass

from benchmarks.shared import read_forever
from loadtest.mqtt_targets import PeerUnavailable, start_mosquitto
from loadtest.processes import free_port, start_heartbeat, stop
from servers.heartbeat.mqtt.v5.aliases import OutboundAliases
from servers.heartbeat.mqtt.v5.codec import pack
from servers.heartbeat.mqtt.v5.outbound import publish
from servers.heartbeat.mqtt.v5.packets import Connect, Packet, Publish, Subscribe, Subscription
from servers.heartbeat.mqtt.v5.properties import Properties


def sensor_topics(count: int) -> list[str]:
    """``count`` topics shaped like a building's sensors."""
    kinds = ("temperature", "humidity", "co2", "occupancy", "lux")
    return [f"sensors/building-{i % 7}/floor-{i % 11}/room-{i}/{kinds[i % len(kinds)]}" for i in range(count)]


def skewed(topics: list[str], messages: int, seed: int = 7) -> list[str]:
    """``messages`` picks from ``topics``, the i-th weighted 1/(i+1) (Zipf, s=1)."""
    rng = random.Random(seed)
    return rng.choices(topics, weights=[1 / (i + 1) for i in range(len(topics))], k=messages)


class Subscriber:
    """A raw MQTT 5 subscriber: counts the bytes it receives and resolves topic aliases."""

    def __init__(self, port: int, client_id: str, aliases: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        props = Properties(topic_alias_maximum=aliases or None)
        self.sock.sendall(pack(Connect(client_id, 60, properties=props)))
        self.received = 0
        self.bytes = 0
        self.topics: list[str] = []
        self.aliased = 0
        self.ready = threading.Event()
        self._known: dict[int, str] = {}
        threading.Thread(target=self._read, daemon=True).start()
        self.sock.sendall(pack(Subscribe(1, (Subscription("sensors/#", 0),))))

    def _read(self) -> None:
        read_forever(self.sock, self._handle)

    def _handle(self, packets: list[tuple[Packet, int]]) -> None:
        for packet, size in packets:
            if isinstance(packet, Publish):
                self.bytes += size
                self.received += 1
                self.topics.append(self._resolve(packet))
            elif type(packet).__name__ == "Suback":
                self.ready.set()

    def _resolve(self, packet: Publish) -> str:
        alias = packet.properties.topic_alias
        if alias is None:
            return packet.topic
        self.aliased += 1
        if packet.topic:
            self._known[alias] = packet.topic
            return packet.topic
        return self._known.get(alias, "?")

    def close(self) -> None:
        self.sock.close()


@dataclass
class Row:
    target: str
    aliases: int
    per_message: float
    aliased: int
    right: bool


def measure(name: str, port: int, sent: list[str], aliases: int, payload: int, timeout: float) -> list[Row]:
    subs = [Subscriber(port, f"{name}-with", aliases), Subscriber(port, f"{name}-without", 0)]
    for sub in subs:
        if not sub.ready.wait(10):
            raise RuntimeError(f"{name}: no SUBACK")
    pub = socket.create_connection(("127.0.0.1", port))
    pub.sendall(pack(Connect(f"{name}-publisher", 60)))
    time.sleep(0.3)
    body = b"x" * payload
    deadline = time.monotonic() + timeout
    for i in range(0, len(sent), 100):  # in batches: the publisher is not what is measured
        pub.sendall(b"".join(pack(Publish(t, body)) for t in sent[i : i + 100]))
        while min(s.received for s in subs) < i - 2000 and time.monotonic() < deadline:
            time.sleep(0.001)  # QoS 0: keep the subscribers within reach, nothing dropped
    while min(s.received for s in subs) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.01)
    rows = [
        Row(name, aliases if i == 0 else 0, s.bytes / max(1, s.received), s.aliased, s.topics == sent)
        for i, s in enumerate(subs)
    ]
    for s in subs:
        s.close()
    pub.close()
    return rows


def rewrite_cost(sent: list[str], aliases: int, payload: int) -> tuple[float, float]:
    """Nanoseconds per message: encoding a PUBLISH, and the alias rewrite of it."""
    packets = [publish(t, b"x" * payload) for t in sent[:5000]]
    encode = min(timeit.repeat(lambda: [publish(t, b"x" * payload) for t in sent[:5000]], number=3, repeat=5))

    def rewrite() -> None:
        box = OutboundAliases(aliases)
        for data in packets:
            box.apply(data)

    apply = min(timeit.repeat(rewrite, number=3, repeat=5))
    n = 3 * len(packets)
    return encode / n * 1e9, apply / n * 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.aliases", description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--topics", type=int, default=50)
    p.add_argument("--aliases", type=int, default=10, help="the Topic Alias Maximum the first subscriber allows")
    p.add_argument("--payload", type=int, default=8, help="bytes of payload per message")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    sent = skewed(sensor_topics(args.topics), args.messages)
    rows: list[Row] = []
    port = free_port()
    proc = start_heartbeat(port, 1, ["--tick", "0.05"])
    try:
        rows += measure("idlekeeper", port, sent, args.aliases, args.payload, args.timeout)
    finally:
        stop(proc)
    try:
        mosquitto = start_mosquitto("mosquitto", free_port())
    except PeerUnavailable as exc:
        print(f"mosquitto: skipped ({exc})", file=sys.stderr)
    else:
        try:
            rows += measure("mosquitto", mosquitto.port, sent, args.aliases, args.payload, args.timeout)
        finally:
            stop(mosquitto.proc)
    base = rows[1].per_message  # ours, without aliases
    print(f"{args.messages} messages, {args.topics} topics (Zipf), {args.payload}-byte payloads")
    print("| target | client allows | bytes per message | ratio | with an alias property | every topic read right |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r.target} | {r.aliases or 'none'} | {r.per_message:.1f} | {r.per_message / base:.2f}× "
            f"| {r.aliased} | {'yes' if r.right else 'NO'} |"
        )
    encode, apply = rewrite_cost(sent, args.aliases, args.payload)
    print()
    print("| step, per message | ns | ratio |")
    print("|---|---:|---:|")
    print(f"| encode the PUBLISH | {encode:.0f} | 1.00× |")
    print(f"| alias rewrite of it | {apply:.0f} | {apply / encode:.2f}× |")
    return 0 if all(r.right for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
