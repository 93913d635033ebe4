"""A stored queue drained through faults: nothing lost.

    python -m benchmarks.drain_faults [--messages 30000] [--workers 2] [--stall 2]

A persistent subscriber (CleanSession=0, QoS 1) is away while ``--messages`` are
published for it, then comes back and drains them with the load tests' client (one
read, every PUBACK of it in one write). With ``--workers`` of 2 or more its session
lives in the supervisor, and each read's acknowledgements cross to it as one report.
A third of the way in, the worker holding the subscriber is killed (SIGKILL); the
subscriber reconnects, must find its session present, and drains on. Two thirds of
the way in, the supervisor is stopped for ``--stall`` seconds (SIGSTOP, then
SIGCONT). PASS when every message arrived (QoS 1 allows one twice after a
reconnect: the duplicates are counted, not failed) and the server exits 0 on
SIGTERM. Every process is stopped by its PID; each wait is bounded.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

from loadtest.processes import free_port, start_heartbeat
from loadtest.qos.client import goodbye, open_client, subscribe
from loadtest.qos.queued import publish_all, take_deliveries

__all__ = ["main"]


class Drainer:
    """The subscriber's side: acknowledges every delivery, counts each message once."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.duplicates = 0

    def receive(self, sock: socket.socket, stop_at: int, idle: float = 3.0) -> None:
        """Take deliveries until ``stop_at`` distinct ones came, the connection ended, or
        ``idle`` seconds passed without one."""
        buf = bytearray()
        sock.settimeout(idle)
        while len(self.seen) < stop_at:
            try:
                data = sock.recv(1 << 16)
            except OSError:  # a timeout, or the connection reset by the killed worker
                return
            if not data:
                return
            buf += data
            acks, _seen, _dups = take_deliveries(buf, self._see)
            if acks:
                try:
                    sock.sendall(acks)
                except OSError:
                    return

    def _see(self, seq: int) -> None:
        self.duplicates += seq in self.seen
        self.seen.add(seq)


def _holder(workers: Sequence[int], server_port: int, client_port: int) -> int | None:
    """The worker whose socket serves the client at ``client_port``."""
    for pid in workers:
        for conn in psutil.Process(pid).net_connections():
            if conn.laddr and conn.laddr.port == server_port and conn.raddr and conn.raddr.port == client_port:
                return pid
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the drill; exit 0 on PASS."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.drain_faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=30_000, help="messages stored for the subscriber (default: 30,000)")
    p.add_argument("--workers", type=int, default=2, help="server workers, at least 2 (default: 2)")
    p.add_argument("--stall", type=float, default=2.0, help="seconds the supervisor is stopped (default: 2)")
    args = p.parse_args(argv)
    if args.workers < 2 or args.messages < 3:
        p.error("--workers must be at least 2 (one is killed), --messages at least 3")
    n = args.messages
    port = free_port()
    server = start_heartbeat(port, args.workers, ["--max-inflight", "20", "--max-queued", str(n + 10)])
    drainer = Drainer()
    ok = False
    try:
        first, _ = open_client(port, "drainer", clean=False)
        subscribe(first, "q/#", 1)
        goodbye(first)
        publisher, _ = open_client(port, "filler", timeout=60.0)
        publish_all(publisher, "q/m", n, 64, 100)
        goodbye(publisher)
        workers = [c.pid for c in psutil.Process(server.pid).children()] or [server.pid]
        back, present = open_client(port, "drainer", clean=False, timeout=60.0)
        drainer.receive(back, n // 3)
        victim = _holder(workers, port, back.getsockname()[1])
        if victim is None:
            print("the subscriber's worker was not found", file=sys.stderr)
            return 1
        os.kill(victim, signal.SIGKILL)
        killed_at = len(drainer.seen)
        back.close()
        time.sleep(1.0)  # the supervisor learns of the death and starts another
        back, present_after = open_client(port, "drainer", clean=False, timeout=60.0)
        drainer.receive(back, 2 * n // 3)
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(args.stall)
        os.kill(server.pid, signal.SIGCONT)
        stalled_at = len(drainer.seen)
        drainer.receive(back, n, idle=10.0)
        goodbye(back)
        ok = _report(drainer, n, killed_at, stalled_at, present_after) and present
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(20)
        except subprocess.TimeoutExpired:  # a server that does not stop is killed, and fails
            server.kill()
            code = -1
        print(f"server exit code       {code}")
        ok = ok and code == 0
    print(f"result                 {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _report(drainer: Drainer, n: int, killed_at: int, stalled_at: int, present: bool) -> bool:
    """Print what happened; True if the session was found again and nothing is missing."""
    missing = n - len(drainer.seen)
    print(f"messages stored        {n:,}")
    print(f"worker killed          after {killed_at:,} delivered")
    print(f"session present        {present} (on reconnecting)")
    print(f"supervisor stalled     after {stalled_at:,} delivered")
    print(
        f"delivered              {len(drainer.seen):,} of {n:,}; missing {missing:,}; duplicates {drainer.duplicates:,}"
    )
    return present and missing == 0


if __name__ == "__main__":
    raise SystemExit(main())
