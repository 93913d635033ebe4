"""How soon a gateway cut off from Redis acts once the network heals.

    python -m benchmarks.partition_heal [--cuts 10,30,60] [--devices 20] [--how drop]

Gateway ``gw0`` runs in a network namespace (:mod:`loadtest.partition`) whose link
to Redis is cut; ``gw1`` and Redis are on the host. ``--devices`` devices on ``gw0``
ping every second. For each cut length: the link is cut (``--how drop``: packets
silently lost, both ends up, as when a partition is along the path), ``gw1``
declares ``gw0`` lost once its lease lapses and ends its sessions, and the link is
healed. What is timed from the heal:

- **fenced**: until ``gw0`` has closed every device connection whose session was
  ended meanwhile (it must reach Redis again to learn that);
- **a kept connection**: until a plain TCP connection to Redis from the island,
  whose PING was sent as the cut began, gets its answer. That is what a client that
  kept its stalled connection waits for: TCP's retransmission backoff, which grows
  during the cut.

Side by side in one run; the ratio is fenced over kept. Needs root and ``ip``
(iproute2). Every process is stopped by its PID, every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from loadtest.device_results import read_presence_log
from loadtest.partition import Island, partitions_possible
from loadtest.processes import free_port, start_heartbeat, stop
from loadtest.redis_server import RedisServer, redis_server_binary
from servers.heartbeat.mqtt import encoders

__all__ = ["main"]

LEASE = 3.0
KEEP_ALIVE = 10

KEPT = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
sock.settimeout(None)
print("ready", flush=True)
sys.stdin.readline()
sock.sendall(b"PING\\r\\n")
assert sock.recv(64).startswith(b"+PONG")
print(time.time(), flush=True)
"""
"""Run in the island: one connection to Redis; on a line from stdin, a PING, and the
wall-clock time its answer came."""


class Pinger:
    """PINGREQs every second to each device given to it, as its client would send them."""

    def __init__(self) -> None:
        self.socks: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, client_id: str, sock: socket.socket) -> None:
        with self._lock:
            self.socks[client_id] = sock

    def take(self, client_id: str) -> socket.socket:
        with self._lock:
            return self.socks.pop(client_id)

    def _run(self) -> None:
        for _ in range(3600):  # bounded: an hour at most
            if self._stop.wait(1.0):
                return
            with self._lock:
                socks = list(self.socks.values())
            for sock in socks:
                with contextlib.suppress(OSError):  # cut, or closed: left alone
                    sock.send(encoders.encode_pingreq(), socket.MSG_DONTWAIT)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.socks.values():
            sock.close()


def connect(host: str, port: int, client_id: str) -> socket.socket:
    """A device past its CONNACK."""
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(encoders.encode_connect(client_id, keep_alive=KEEP_ALIVE))
    if sock.recv(4) != encoders.encode_connack(False, 0):
        raise RuntimeError(f"{client_id} was not accepted")
    return sock


def closed_at(sock: socket.socket, deadline: float) -> float | None:
    """``time.monotonic()`` when the server closed ``sock`` (reading past its
    PINGRESPs); None if it is still open at ``deadline``."""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return time.monotonic()
        except ConnectionResetError:
            return time.monotonic()
        except TimeoutError:
            return None
    return None


def reaches(log: Path, status: str, reason: str | None, at_least: int, deadline: float, pause: float = 0.1) -> bool:
    """Whether ``log`` holds ``at_least`` events of ``status`` (and ``reason``) by
    ``deadline`` (``time.monotonic()``), read every ``pause`` seconds."""
    while count(log, status, reason) < at_least:
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
    return True


def count(log: Path, status: str, reason: str | None) -> int:
    return sum(1 for e in read_presence_log(log) or [] if e.get("status") == status and e.get("reason") == reason)


def one_cut(
    place: Island, redis: RedisServer, gw0: tuple[str, int], logs: tuple[Path, Path], cut: float, n: int, how: str
) -> dict[str, float]:
    """Devices on gw0, the cut, the heal: the seconds from the heal to each end."""
    host0, port0 = gw0
    log0, log1 = logs
    pinger = Pinger()
    kept = subprocess.Popen(
        [*place.prefix, sys.executable, "-c", KEPT, place.host_backend, str(redis.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert kept.stdin is not None and kept.stdout is not None
        if kept.stdout.readline().strip() != "ready":
            raise RuntimeError("the kept connection did not reach Redis")
        ids = {f"d-{i}" for i in range(n)}
        online_before = count(log0, "online", None)
        for client_id in sorted(ids):
            pinger.add(client_id, connect(host0, port0, client_id))
        reaches(log0, "online", None, online_before + n, time.monotonic() + 30)
        lost_before = count(log1, "offline", "node-lost")
        place.cut("backend", how)
        kept.stdin.write("ping\n")
        kept.stdin.flush()
        started = time.monotonic()
        # gw1 declares gw0 lost once its lease lapses; the cut lasts ``cut`` s from its start.
        deadline = started + max(cut, 4 * LEASE) + 30
        if not reaches(log1, "offline", "node-lost", lost_before + n, deadline, pause=0.2):
            raise RuntimeError(f"gw0 was not declared lost within {deadline - started:.0f} s")
        time.sleep(max(0.0, started + cut - time.monotonic()))
        place.heal("backend")
        healed_wall, healed = time.time(), time.monotonic()
        ends = [closed_at(pinger.take(c), healed + 180) for c in sorted(ids)]
        line = kept.stdout.readline().strip()
        answered = float(line) - healed_wall if line else float("nan")
        fenced = [e - healed for e in ends if e is not None]
        return {
            "fenced_median": statistics.median(fenced) if fenced else float("nan"),
            "fenced_max": max(fenced) if fenced else float("nan"),
            "not_fenced": float(len(ends) - len(fenced)),
            "kept": answered,
        }
    finally:
        pinger.close()
        if kept.poll() is None:
            kept.kill()  # by PID
        kept.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cuts; print the table; exit 0 if every device was fenced."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.partition_heal", description=__doc__.split("\n\n")[0])
    p.add_argument("--cuts", default="10,30,60", help="cut lengths in seconds, comma-separated")
    p.add_argument("--devices", type=int, default=20)
    p.add_argument("--how", choices=("drop", "down"), default="drop")
    args = p.parse_args(argv)
    why = partitions_possible()
    binary = redis_server_binary()
    if why is not None or binary is None:
        print(f"cannot run: {why or 'redis-server is not installed'}", file=sys.stderr)
        return 2
    cuts = [float(c) for c in args.cuts.split(",") if c]
    place = Island()
    gateways: list[subprocess.Popen[str]] = []
    redis: RedisServer | None = None
    rows = []
    workdir = Path(f"/tmp/ik-partition-heal-{place.number}")
    workdir.mkdir(exist_ok=True)
    try:
        place.make()
        redis = RedisServer(binary=binary, extra=["--bind", "127.0.0.1", place.host_backend, "--protected-mode", "no"])
        redis.start()
        logs = (workdir / "gw0.jsonl", workdir / "gw1.jsonl")
        for old in (*logs, workdir / "gw0.log", workdir / "gw1.log"):
            old.unlink(missing_ok=True)
        ports = []
        for name, host, redis_host, prefix, log in (
            ("gw0", place.address, place.host_backend, place.prefix, logs[0]),
            ("gw1", "127.0.0.1", "127.0.0.1", [], logs[1]),
        ):
            port = free_port()
            extra = ["--cluster", f"redis://{redis_host}:{redis.port}/0", "--node", name, "--presence-log", str(log)]
            extra += ["--tick", "0.05", "--lease", str(LEASE), "--host", host, "--log-level", "info"]
            gateways.append(start_heartbeat(port, 1, extra, prefix=prefix, log=workdir / f"{name}.log"))
            ports.append(port)
        for cut in cuts:
            row = one_cut(place, redis, (place.address, ports[0]), logs, cut, args.devices, args.how)
            row["cut"] = cut
            rows.append(row)
            print(
                f"cut {cut:5.0f} s: fenced after the heal in {row['fenced_median']:.2f} s median, "
                f"{row['fenced_max']:.2f} s max; a kept connection answered after {row['kept']:.2f} s",
                flush=True,
            )
    finally:
        for proc in gateways:
            stop(proc, timeout=20.0)  # by PID
        if redis is not None:
            redis.stop()
        place.remove()
    print()
    print(f"{args.devices} devices, the link cut by {args.how!r}:")
    print("| cut (s) | fenced, median (s) | fenced, max (s) | a kept connection (s) | max / kept |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        ratio = row["fenced_max"] / row["kept"] if row["kept"] > 0 else float("nan")
        figures = f"{row['fenced_median']:.2f} | {row['fenced_max']:.2f} | {row['kept']:.2f}"
        print(f"| {row['cut']:.0f} | {figures} | {ratio:.2f}× |")
    return 0 if all(row["not_fenced"] == 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
