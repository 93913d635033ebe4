"""Shared-subscription throughput, ours beside Mosquitto, in one run.

    python -m benchmarks.shared [--messages 20000] [--members 4] [--qos 1]

For each target (ours with one worker, ours with ``--workers 2``, Mosquitto 2.0.11),
``--members`` MQTT 5 clients subscribe to ``$share/bench/load/#`` and one more to
``load/#`` (a plain subscriber, the reference: it must get every message); a
publisher sends ``--messages`` PUBLISHes as fast as the server takes them (QoS 1:
it keeps a window of 100 unacknowledged). It reports the messages per second the
group received (from the first PUBLISH to the last message at a member), how they
were spread over the members, and whether every message reached the group exactly
once. Raw sockets and the v5 codec: the clients cost little next to the servers.
Loopback only; every server is stopped by its PID; the run is bounded by
``--timeout`` per target.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtest.mqtt_targets import MqttTarget, PeerUnavailable, start_mosquitto
from loadtest.processes import free_port, start_heartbeat, stop
from servers.heartbeat.mqtt.v5.codec import pack, read_whole
from servers.heartbeat.mqtt.v5.packets import PUBACK, Ack, Connect, Packet, Publish, Subscribe, Subscription

GROUP = "$share/bench/load/#"


def read_forever(sock: socket.socket, handle: Callable[[list[tuple[Packet, int]]], None]) -> None:
    """Read ``sock`` until it closes, handing each batch of whole packets (with their
    sizes on the wire) to ``handle``; for a client's reader thread."""
    buf = b""
    while True:
        try:
            data = sock.recv(1 << 20)
        except OSError:
            return
        if not data:
            return
        buf += data
        packets, used = read_whole(buf)
        handle(packets)
        buf = buf[used:]


class Reader:
    """A raw MQTT 5 client: a thread reads its packets and counts the PUBLISHes."""

    def __init__(self, port: int, client_id: str, topic_filter: str | None, qos: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(pack(Connect(client_id, 60)))
        self.count = 0
        self.last = 0.0
        self.bodies: list[bytes] = []
        self.acked = 0
        self.suback = threading.Event()
        self.connack = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.connack.wait(10):
            raise RuntimeError(f"{client_id}: no CONNACK")
        if topic_filter is not None:
            self.sock.sendall(pack(Subscribe(1, (Subscription(topic_filter, qos),))))
            if not self.suback.wait(10):
                raise RuntimeError(f"{client_id}: no SUBACK")

    def _read(self) -> None:
        read_forever(self.sock, self._handle)

    def _handle(self, packets: list[tuple[Packet, int]]) -> None:
        acks = []
        for packet, _ in packets:
            if isinstance(packet, Publish):
                self.count += 1
                self.bodies.append(packet.payload)
                self.last = time.perf_counter()
                if packet.qos == 1 and packet.packet_id:
                    acks.append(pack(Ack(PUBACK, packet.packet_id)))
            elif isinstance(packet, Ack):
                with self._lock:
                    self.acked += 1
            elif type(packet).__name__ == "Connack":
                self.connack.set()
            elif type(packet).__name__ == "Suback":
                self.suback.set()
        if acks:
            self.sock.sendall(b"".join(acks))

    def close(self) -> None:
        self.sock.close()


@dataclass
class Result:
    target: str
    rate: float = 0.0
    spread: list[int] = field(default_factory=list)
    exactly_once: bool = False
    plain_all: bool = False
    plain_count: int = 0
    note: str = ""


def measure(name: str, port: int, messages: int, members: int, qos: int, timeout: float) -> Result:
    group = [Reader(port, f"member-{i}", GROUP, qos) for i in range(members)]
    plain = Reader(port, "plain", "load/#", qos)
    time.sleep(1.0)  # every worker knows every filter
    publisher = Reader(port, "publisher", None, qos)
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    for i in range(messages):
        body = b"%08d" % i
        publisher.sock.sendall(pack(Publish("load/x", body, qos, packet_id=(i % 65535) + 1 if qos else None)))
        if qos:
            while i + 1 - publisher.acked > 100 and time.monotonic() < deadline:  # a window of 100
                time.sleep(0.0005)
    while sum(m.count for m in group) < messages and time.monotonic() < deadline:
        time.sleep(0.01)
    last = max((m.last for m in group), default=start)  # the group's rate stops here
    while plain.count < messages and time.monotonic() < deadline:  # the reference may lag behind
        time.sleep(0.01)
    time.sleep(0.3)  # any duplicate would have come by now
    got = [b for m in group for b in m.bodies]
    result = Result(
        name,
        rate=len(got) / (last - start) if last > start else 0.0,
        spread=[m.count for m in group],
        exactly_once=sorted(got) == [b"%08d" % i for i in range(messages)],
        plain_all=plain.count == messages,
        plain_count=plain.count,
    )
    for reader in [*group, plain, publisher]:
        reader.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shared", description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--qos", type=int, choices=(0, 1), default=1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per target at most")
    p.add_argument("--targets", default="idlekeeper,idlekeeper-2w,mosquitto")
    p.add_argument("--server-args", default="", help="more arguments for ours, e.g. '--max-queued 100000'")
    args = p.parse_args(argv)
    results: list[Result] = []
    for name in args.targets.split(","):
        port = free_port()
        target: MqttTarget | None = None
        proc = None
        try:
            if name == "mosquitto":
                target = start_mosquitto(name, port)
            elif name in ("idlekeeper", "idlekeeper-2w"):
                workers = 2 if name.endswith("2w") else 1
                proc = start_heartbeat(port, workers, ["--max-inflight", "100", *args.server_args.split()])
            else:
                raise PeerUnavailable(f"unknown target {name!r}")
            results.append(measure(name, port, args.messages, args.members, args.qos, args.timeout))
        except PeerUnavailable as exc:
            results.append(Result(name, note=str(exc)))
        finally:
            if target is not None:
                target.stop()
            if proc is not None:
                stop(proc)  # by PID
    base = results[0].rate or 1.0
    print(f"{args.messages} messages at QoS {args.qos} to a group of {args.members} members (and one plain subscriber)")
    print("| target | group msgs/s | ratio | per member | exactly once | plain subscriber got all |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r.note:
            print(f"| {r.target} | — | — | — | — | {r.note} |")
            continue
        spread = "/".join(str(c) for c in r.spread)
        print(
            f"| {r.target} | {r.rate:,.0f} | {r.rate / base:.2f}× | {spread} | "
            f"{'yes' if r.exactly_once else 'NO'} | {'yes' if r.plain_all else f'NO ({r.plain_count:,})'} |"
        )
    return 0 if all(r.note or (r.exactly_once and r.plain_all) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
