"""What a SUBACK costs now that it waits for every worker, and what it buys.

    python -m benchmarks.suback [--count 200]

For one worker, two workers, and a fleet of one and of two gateways on Redis (a
``redis-server`` started on a free loopback port): ``--count`` clients each
subscribe at QoS 1 to a filter of their own (clean and persistent sessions in
turn), time the SUBACK, and at once have another client publish one QoS 1 message
on it (through the other gateway in a fleet; anywhere ``SO_REUSEPORT`` puts it
with workers). A reply that has not come within a second is counted missed.
Every server is stopped by its PID.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from loadtest.mqtt_frames import frames
from loadtest.processes import free_port, start_heartbeat, stop
from loadtest.redis_server import RedisServer, redis_server_binary
from servers.heartbeat.mqtt import encoders

ROOT = Path(__file__).resolve().parent.parent


class _Client:
    """A raw MQTT client: exact bytes out, packets back."""

    def __init__(self, port: int, client_id: str, clean: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.settimeout(5)
        self.sock.sendall(encoders.encode_connect(client_id, keep_alive=30, clean_session=clean))
        self.pending = b""
        if self.packet()[:1] != b"\x20":
            raise RuntimeError("no CONNACK")

    def packet(self) -> bytes:
        while True:
            found, _ = frames(self.pending)
            if found:
                end = found[0][2]
                out, self.pending = self.pending[:end], self.pending[end:]
                return out
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the server")
            self.pending += chunk

    def close(self) -> None:
        self.sock.sendall(encoders.encode_disconnect())
        self.sock.close()


def measure(sub_port: int, pub_port: int, count: int) -> dict[str, float]:
    """SUBACK times (ms) and replies missed, over ``count`` subscribers."""
    times: list[float] = []
    missed = 0
    for i in range(count):
        sub = _Client(sub_port, f"suback-{i}", clean=i % 2 == 0)
        started = time.perf_counter()
        sub.sock.sendall(encoders.encode_subscribe(1, [(f"reply/{i}", 1)]))
        while sub.packet()[:1] != b"\x90":  # matching PUBLISHes may come first (MQTT-3.8.4)
            pass
        times.append(1000 * (time.perf_counter() - started))
        pub = _Client(pub_port, "suback-publisher")
        pub.sock.sendall(encoders.encode_publish(f"reply/{i}", b"answer", qos=1, packet_id=1))
        pub.packet()  # PUBACK
        pub.close()
        sub.sock.settimeout(1)
        try:
            while sub.packet()[:1] != b"\x32":
                pass
        except TimeoutError:
            missed += 1
        sub.close()
    times.sort()
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    return {"p50": statistics.median(times), "p99": p99, "missed": missed}


@contextmanager
def _server(workers: int, extra: Sequence[str]) -> Iterator[int]:
    port = free_port()
    proc = start_heartbeat(port, workers, ["--tick", "0.05", *extra], cwd=str(ROOT))
    try:
        time.sleep(0.5)
        yield port
    finally:
        stop(proc)  # by PID


def main(argv: Sequence[str] | None = None) -> int:
    """Run every set-up and print one row each."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.suback", description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=200, help="subscribers per set-up (default: 200)")
    args = p.parse_args(argv)
    rows: list[tuple[str, dict[str, float]]] = []
    for workers in (1, 2):
        with _server(workers, []) as port:
            rows.append((f"{workers} worker{'s' * (workers > 1)}", measure(port, port, args.count)))
    binary = redis_server_binary()
    if binary is None:
        print("redis-server not found: the fleet rows are skipped", file=sys.stderr)
    else:
        redis = RedisServer(binary=binary)
        redis.start()
        try:
            fleet = ["--cluster", redis.url]
            with _server(1, [*fleet, "--node", "solo"]) as port:
                rows.append(("fleet of 1 gateway", measure(port, port, args.count)))
            with _server(1, [*fleet, "--node", "gw-a"]) as a, _server(1, [*fleet, "--node", "gw-b"]) as b:
                rows.append(("fleet of 2, published on the other", measure(a, b, args.count)))
        finally:
            redis.stop()
    print(f"{'set-up':36s} {'SUBACK p50':>11s} {'p99':>9s} {'replies missed':>15s}")
    for name, row in rows:
        print(f"{name:36s} {row['p50']:8.2f} ms {row['p99']:6.2f} ms {int(row['missed']):>7d} of {args.count}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
