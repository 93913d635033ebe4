"""Instructions per request or per heartbeat, counted by callgrind: a figure the
machine's noise does not move.

    python -m benchmarks.instructions [--server http,mqtt,drain] [--count 4000] [--connections 1]
                                      [--roots DIR[,DIR...]] [--floor]

Wall-clock figures on these shared two-core machines drift by tens of percent
between runs; ``valgrind --tool=callgrind`` counts the instructions a server runs,
which repeat to within a fraction of a percent for the same code and load, whatever
else the machine does. For each server this starts ``python -m servers.http`` or
``python -m servers.heartbeat`` (one worker) under callgrind, drives it from
``--connections`` loopback clients (``GET /`` on a keep-alive connection, or a
PINGREQ answered by PINGRESP on an MQTT connection), each waiting for its answer
before the next, stops it by its PID, and reads the total. A second run with no
requests gives start-up and shutdown; the difference over ``--count`` is the cost
of one request or heartbeat, the Python interpreter's share included.

``drain`` is a persistent session's stored queue drained on its return: ``--count``
QoS 1 messages are published to it while it is away (server ``--max-inflight 20``, as
``loadtest qos``), then its client comes back and acknowledges each window as it
reads it. The run without a drain publishes the same messages and never comes back,
so the difference over ``--count`` is what a drained message costs: the outbox's
refill, its encoding and the writes, and the acknowledgements read.

``--floor`` adds, for mqtt, :mod:`benchmarks.ping_floor`: a bare ``epoll`` loop that
answers PINGREQ and nothing else, the least a Python server can run a heartbeat on.

``--roots`` runs the servers of several source trees (a checkout of an earlier
commit beside this one, say) with this load, one after the other, and gives each
figure as a ratio to the first root's: how a change moved the per-packet cost.
Give the trees paths of the same length (``/tmp/before`` and ``/tmp/after1``): the
path is in every module's file name, and another length shifts the heap's layout,
which moved a heartbeat's count by 2% here with no line of code changed.
Loopback only; every server is stopped by its PID.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.processes import free_port
from servers.heartbeat.mqtt import encoders

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("http", "mqtt", "drain")
DRAIN_WINDOW = 20
"""The drain's in-flight window (``--max-inflight``): ``loadtest qos``'s."""
_REQUEST = b"GET / HTTP/1.1\r\nHost: localhost\r\nUser-Agent: instructions\r\nAccept: */*\r\n\r\n"
_PINGREQ, _PINGRESP = encoders.encode_pingreq(), encoders.encode_pingresp()


@dataclass(frozen=True)
class Count:
    """What one server of one tree cost: instructions with and without the load."""

    server: str
    root: str
    count: int
    loaded: int
    idle: int

    @property
    def per_item(self) -> float:
        """Instructions per request (HTTP), heartbeat (MQTT) or drained message."""
        return (self.loaded - self.idle) / self.count


def callgrind_total(path: Path) -> int:
    """The total instruction count of a callgrind output (the largest, over its parts)."""
    total = 0
    for part in path.parent.glob(path.name + "*"):
        for line in part.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                total = max(total, int(line.split()[1]))
    if not total:
        raise RuntimeError(f"no instruction total in {path}*")
    return total


def _recv_until(sock: socket.socket, done: Callable[[bytes], bool]) -> bytes:
    data = b""
    while not done(data):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data[:80]!r}")
        data += chunk
    return data


def _http_answered(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    raise AssertionError(f"no Content-Length in {head!r}")


def http_client(port: int, count: int) -> None:
    """``count`` requests on one keep-alive connection, each answered before the next."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(60)
        for _ in range(count):
            sock.sendall(_REQUEST)
            answer = _recv_until(sock, _http_answered)
            if not answer.startswith(b"HTTP/1.1 200"):
                raise AssertionError(f"answered {answer[:80]!r}")


def mqtt_client(port: int, count: int, name: str) -> None:
    """One device: CONNECT, ``count`` PINGREQs each answered before the next, DISCONNECT."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(60)
        sock.sendall(encoders.encode_connect(name, keep_alive=600))
        connack = _recv_until(sock, lambda d: len(d) >= 4)
        if connack != encoders.encode_connack(False, 0):
            raise AssertionError(f"CONNACK {connack!r}")
        for _ in range(count):
            sock.sendall(_PINGREQ)
            if _recv_until(sock, lambda d: len(d) >= 2) != _PINGRESP:
                raise AssertionError("no PINGRESP")
        sock.sendall(encoders.encode_disconnect())


def drain_client(port: int, count: int, back: bool) -> None:
    """Queue ``count`` QoS 1 messages for an absent persistent session; ``back``: then
    return and take them all, acknowledging each read's in one write, in order."""
    from loadtest.qos.client import goodbye, open_client, subscribe
    from loadtest.qos.queued import publish_all, take_deliveries

    away, _ = open_client(port, "drained", clean=False, timeout=60)
    subscribe(away, "q/#", 1)
    goodbye(away)
    publisher, _ = open_client(port, "filler", timeout=60)
    try:
        publish_all(publisher, "q/m", count, 64, 100)
    finally:
        goodbye(publisher)
    if not back:
        return
    sock, present = open_client(port, "drained", clean=False, timeout=60)
    seen: list[int] = []
    buf = bytearray()
    with sock:
        while len(seen) < count:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError(f"closed after {len(seen)} of {count} messages")
            buf += data
            acks, _, _ = take_deliveries(buf, seen.append)
            if acks:
                sock.sendall(acks)
        goodbye(sock)
    if not present or seen != list(range(count)):
        raise AssertionError(f"the drain was not every message once, in order (session present: {present})")


FLOOR = "benchmarks.ping_floor"
"""The floor under any Python MQTT server's heartbeat (``--floor``)."""


def run_once(server: str, root: str, count: int, connections: int, out: Path, module: str | None = None) -> int:
    """Start ``server`` of tree ``root`` (or ``module`` there) under callgrind, drive
    ``count`` items over ``connections`` clients (none: start-up and shutdown only; for
    the drain, a negative count queues that many messages and drains none), stop it;
    its total."""
    port = free_port()
    module = module or ("servers.http" if server == "http" else "servers.heartbeat")
    cmd = [
        *("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"),
        *(sys.executable, "-m", module, "--port", str(port), "--workers", "1", "--tick", "1.0"),
    ]
    if server == "drain":
        cmd += ["--max-inflight", str(DRAIN_WINDOW), "--max-queued", str(max(count, 1000))]
    # A fixed hash seed: dict and set layouts, and so the instructions, repeat run to run.
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        said = ""
        while "listening" not in said:
            line = proc.stderr.readline()
            if not line:
                raise RuntimeError(f"{module} in {root} exited before listening: {said[-400:]}")
            said += line
        threading.Thread(target=lambda: [None for _ in proc.stderr or ()], daemon=True).start()
        share = count // connections if count else 0
        if server == "drain":
            # Both runs queue the same messages; only the loaded one drains them.
            drain_client(port, abs(count), back=count > 0)
            share = 0
        workers = [
            threading.Thread(target=http_client, args=(port, share))
            if server == "http"
            else threading.Thread(target=mqtt_client, args=(port, share, f"counted-{i}"))
            for i in range(connections if share else 0)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        proc.terminate()  # SIGTERM, by PID
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return callgrind_total(out)


def measure(server: str, root: str, count: int, connections: int, workdir: Path, module: str | None = None) -> Count:
    """The loaded and the idle run of one server of one tree (or of ``module`` there)."""
    runs = Path(tempfile.mkdtemp(prefix=f"{server}-", dir=workdir))
    n = count - count % connections
    # The drain's idle run queues the messages too (a negative count), and drains none.
    idle = run_once(server, root, -n if server == "drain" else 0, connections, runs / "idle.out", module)
    loaded = run_once(server, root, n, connections, runs / "loaded.out", module)
    return Count(server, module or root, n, loaded, idle)


def table(counts: Sequence[Count]) -> str:
    """Markdown: each server's figure per tree, with its ratio to the first tree's."""
    lines = ["| server | tree | items | instructions per item | vs first tree |", "|---|---|---:|---:|---:|"]
    first: dict[str, float] = {}
    for c in counts:
        base = first.setdefault(c.server, c.per_item)
        item = {"http": "request", "mqtt": "heartbeat", "drain": "drained message"}[c.server]
        ratio = c.per_item / base
        lines.append(f"| {c.server} | {c.root} | {c.count:,} | {c.per_item:,.0f} per {item} | {ratio:.3f}× |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; see the module's docstring."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.instructions", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=",".join(SERVERS), help="comma-separated: http, mqtt, drain (default: all)")
    p.add_argument("--count", type=int, default=4000, help="requests or heartbeats per run (default: 4000)")
    p.add_argument("--connections", type=int, default=1, help="clients, each waiting for its answers (default: 1)")
    p.add_argument("--roots", default=str(ROOT), help="comma-separated source trees to run the servers from")
    p.add_argument(
        "--floor", action="store_true", help="with mqtt: add a row for benchmarks.ping_floor, a bare Python epoll loop"
    )
    args = p.parse_args(argv)
    servers = [s for s in args.server.split(",") if s]
    if unknown := set(servers) - set(SERVERS):
        p.error(f"unknown server(s): {', '.join(sorted(unknown))}")
    if args.count < args.connections or args.connections < 1:
        p.error("--count must be at least --connections, which must be at least 1")
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    roots = [str(Path(r).resolve()) for r in args.roots.split(",") if r]
    counts = []
    with tempfile.TemporaryDirectory(prefix="ik-callgrind-") as tmp:
        for server in servers:
            for root in roots:
                count = measure(server, root, args.count, args.connections, Path(tmp))
                print(f"{server} {root}: {count.per_item:,.0f} instructions per item", file=sys.stderr)
                counts.append(count)
            if server == "mqtt" and args.floor:
                count = measure(server, str(ROOT), args.count, args.connections, Path(tmp), FLOOR)
                print(f"{server} {FLOOR}: {count.per_item:,.0f} instructions per item", file=sys.stderr)
                counts.append(count)
    print(table(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
