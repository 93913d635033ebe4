"""CPU per heartbeat when heartbeats trickle in, with and without the engine's coalescing.

    python -m benchmarks.wakeups [--devices 4000] [--rate 56] [--seconds 40] [--coalesce 0,0.1,0.25]
                                 [--keepalive 3600] [--server-args "..."] [--mosquitto]

At 500,000 devices over 29 workers (the 20,000-file limit), each worker sees about
56 PINGREQs a second, evenly spread: every one wakes the process on its own. This
starts one ``servers.heartbeat`` worker per ``--coalesce`` value, one after the
other, connects ``--devices`` raw MQTT devices (keep-alive ``--keepalive``, 3600 s
by default), sends PINGREQs at ``--rate`` per second for ``--seconds``, the devices
in a shuffled round (so each pings every devices/rate seconds: give a keep-alive
whose 1.5 times is longer), checks every one is answered, and reads the server's
CPU time over that window, after ``--warmup`` seconds of the same. A keep-alive
near the round's length has the keeper re-file each device's deadline about once a
round, as at 500,000 devices; a warm-up past 1.5 keep-alives has that under way. It also
measures the floor of one wake-up on this machine: a plain ``epoll`` loop and a trio
loop, each woken by a socketpair at the same rate. ``--mosquitto`` adds Mosquitto, driven and
measured the same way, as the last row. Loopback only; each server is stopped by its PID.
"""

from __future__ import annotations

import argparse
import collections
import random
import resource
import select
import shlex
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import trio

from loadtest.generator.source import bind_source
from loadtest.mqtt_targets import MqttTarget, PeerUnavailable, start_mosquitto
from loadtest.processes import free_port, start_heartbeat, start_server
from servers.heartbeat.mqtt import encoders

ROOT = Path(__file__).resolve().parent.parent


def _connect_all(port: int, n: int, keepalive: int = 3600) -> list[socket.socket]:
    socks = []
    for i in range(n):
        sock = socket.socket()
        bind_source(sock, f"127.0.3.{2 + i // 15_000}")
        sock.connect(("127.0.0.1", port))
        sock.sendall(encoders.encode_connect(f"wake-{i}", keep_alive=keepalive))
        socks.append(sock)
    for sock in socks:
        sock.settimeout(10)
        if sock.recv(4)[:1] != b"\x20":
            raise RuntimeError("no CONNACK")
    # Connecting can take long (a full accept queue drops SYNs, retried a second or
    # more later): one heartbeat each now, so the round starts with every deadline fresh.
    for sock in socks:
        sock.send(encoders.encode_pingreq())
    for sock in socks:
        if sock.recv(2) != encoders.encode_pingresp():
            raise RuntimeError("no PINGRESP")
        sock.setblocking(False)
    return socks


def _ping(
    socks: list[socket.socket], rate: float, seconds: float, offset: int = 0, delays: list[float] | None = None
) -> tuple[int, int]:
    """PINGREQs at ``rate``/s, evenly spaced, the devices in a shuffled round (from its
    ``offset``-th); returns (sent, answered). ``delays`` is given each PINGRESP's time
    after its PINGREQ was sent (as this loop sees it: its own lag is in it too)."""
    poller = select.epoll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.EPOLLIN)
    order = list(socks)
    random.Random(1).shuffle(order)
    waiting: dict[int, collections.deque[float]] = collections.defaultdict(collections.deque)
    sent = answered = 0
    start = next_at = time.monotonic()
    while (now := time.monotonic()) - start < seconds or answered < sent:
        if now - start > seconds + 5:
            break
        while next_at <= now and now - start < seconds:
            sock = order[(offset + sent) % len(order)]
            sock.send(encoders.encode_pingreq())
            waiting[sock.fileno()].append(time.monotonic())
            sent += 1
            next_at += 1 / rate
        for fd, _ in poller.poll(max(0.0, min(next_at - time.monotonic(), 0.5))):
            got = len(by_fd[fd].recv(4096)) // 2  # PINGRESP is 2 bytes
            answered += got
            at, queue = time.monotonic(), waiting[fd]
            for _ in range(min(got, len(queue))):
                sent_at = queue.popleft()
                if delays is not None:
                    delays.append(at - sent_at)
    poller.close()
    return sent, answered


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_seconds(process: psutil.Process) -> float:
    """CPU time of all the process's threads; to the nanosecond where the kernel says
    (``/proc/PID/task/*/sched``), since psutil counts in clock ticks (10 ms): a quiet,
    coalescing server can spend less than one tick in a short run and read as zero."""
    total, found = 0.0, False
    for sched in Path(f"/proc/{process.pid}/task").glob("*/sched"):
        try:
            text = sched.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("se.sum_exec_runtime"):
                total += float(line.split(":", 1)[1]) / 1000  # milliseconds
                found = True
                break
    if found:
        return total
    times = process.cpu_times()
    return float(times.user + times.system)


def measure_server(
    devices: int,
    rate: float,
    seconds: float,
    coalesce: float | None,
    keepalive: int = 3600,
    extra: Sequence[str] = (),
    warmup: float = 0.0,
    start_at: float | None = None,
    floor: bool = False,
) -> dict[str, float]:
    """One worker at ``coalesce`` (or Mosquitto, for ``coalesce`` None; or with ``floor``,
    :mod:`benchmarks.ping_floor`): its CPU per 1,000 heartbeats/s, and a heartbeat's
    CPU split into user and kernel time.

    With ``start_at`` (a ``time.monotonic()`` reading, the same in every process), the
    warm-up begins then rather than as soon as the devices are connected: two servers
    measured by two processes at once share one window."""
    port = free_port()
    if floor:
        proc = start_server("ping_floor", port, 1, module="benchmarks.ping_floor", cwd=str(ROOT))
        peer = MqttTarget("ping floor", proc, port)
    elif coalesce is None:
        peer = start_mosquitto("mosquitto", port)
    else:
        proc = start_heartbeat(port, 1, ["--coalesce", str(coalesce), *extra], cwd=str(ROOT))
        peer = MqttTarget("idlekeeper", proc, port)
    proc = peer.proc
    try:
        socks = _connect_all(port, devices, keepalive)
        time.sleep(2 if start_at is None else max(0.0, start_at - time.monotonic()))
        warmed, _ = _ping(socks, rate, warmup)  # past the first deadlines: re-filing has begun
        server = psutil.Process(proc.pid)
        split0 = server.cpu_times()
        before, t0 = _cpu_seconds(server), time.monotonic()
        delays: list[float] = []
        sent, answered = _ping(socks, rate, seconds, warmed, delays)
        after, t1 = _cpu_seconds(server), time.monotonic()
        split1 = server.cpu_times()
        for sock in socks:
            sock.close()
    finally:
        peer.stop()  # by PID
    core = (after - before) / (t1 - t0)
    per_s = sent / seconds
    per_heartbeat = 1e6 / sent if sent else 0.0
    return {
        "coalesce": -2.0 if floor else -1.0 if coalesce is None else coalesce,
        "heartbeats_per_s": per_s,
        "answered": answered / sent if sent else 0.0,
        "cpu_pct": 100 * core,
        "cpu_pct_per_1k": 100 * core / (per_s / 1000),
        # Clock ticks (10 ms) here, so a split of tens of ticks: a few percent either way.
        "user_us": (split1.user - split0.user) * per_heartbeat,
        "kernel_us": (split1.system - split0.system) * per_heartbeat,
        "delay_p50_ms": 1000 * _quantile(delays, 0.50),
        "delay_p99_ms": 1000 * _quantile(delays, 0.99),
        "window_start": t0,
        "window_end": t1,
    }


def _thread_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def _waker(sock: socket.socket, rate: float, stop: threading.Event) -> None:
    while not stop.wait(1 / rate):
        sock.send(b"x")


def _epoll_loop(sock: socket.socket, seconds: float) -> tuple[float, int]:
    poller = select.epoll()
    poller.register(sock.fileno(), select.EPOLLIN)
    c0, t0, n = _thread_cpu(), time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        poller.poll(1.0)
        sock.recv(64)
        n += 1
    poller.close()
    return _thread_cpu() - c0, n


async def _trio_loop(sock: socket.socket, seconds: float) -> tuple[float, int]:
    c0, t0, n = _thread_cpu(), time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        await trio.lowlevel.wait_readable(sock)
        sock.recv(64)
        n += 1
    return _thread_cpu() - c0, n


def wakeup_floor(rate: float, seconds: float = 5.0) -> dict[str, float]:
    """CPU per wake-up of a plain epoll loop and of a trio loop (this thread only)."""
    out: dict[str, float] = {}
    for kind in ("epoll", "trio"):
        a, b = socket.socketpair()
        a.setblocking(False)
        stop = threading.Event()
        threading.Thread(target=_waker, args=(b, rate, stop), daemon=True).start()
        cpu, n = _epoll_loop(a, seconds) if kind == "epoll" else trio.run(_trio_loop, a, seconds)
        stop.set()
        a.close()
        b.close()
        out[f"{kind}_us_per_wakeup"] = 1e6 * cpu / max(n, 1)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and print a table; exit 1 if a heartbeat went unanswered."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.wakeups", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4000)
    p.add_argument("--rate", type=float, default=56.0, help="PINGREQs per second (default: 56)")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--coalesce", default="0,0.1,0.25", help="comma-separated --coalesce values (default: 0,0.1,0.25)")
    p.add_argument("--keepalive", type=int, default=3600, help="the devices' keep-alive, seconds (default: 3600)")
    p.add_argument("--server-args", default="", help="more options for the server, as one string")
    p.add_argument(
        "--coalesce-pings",
        default="default",
        help="comma-separated --coalesce-pings values, a row each per --coalesce (default: the server's own)",
    )
    p.add_argument("--warmup", type=float, default=0.0, help="seconds of PINGREQs before measuring (default: 0)")
    p.add_argument("--mosquitto", action="store_true", help="add a row for Mosquitto driven the same way, if installed")
    p.add_argument("--floor", action="store_true", help="add a row for benchmarks.ping_floor, a bare Python epoll loop")
    args = p.parse_args(argv)
    floor = wakeup_floor(args.rate)
    epoll_us, trio_us = floor["epoll_us_per_wakeup"], floor["trio_us_per_wakeup"]
    print(f"one wake-up here: plain epoll {epoll_us:.0f} µs, trio {trio_us:.0f} µs of CPU")
    extra = shlex.split(args.server_args)
    rows = []
    for c in args.coalesce.split(","):
        for pings in args.coalesce_pings.split(","):
            more = [*extra, "--coalesce-pings", pings] if pings != "default" else extra
            row = measure_server(args.devices, args.rate, args.seconds, float(c), args.keepalive, more, args.warmup)
            row["pings"] = pings
            rows.append(row)
    if args.mosquitto:
        try:
            rows.append(measure_server(args.devices, args.rate, args.seconds, None, args.keepalive, (), args.warmup))
        except PeerUnavailable as exc:
            print(f"no Mosquitto row: {exc}")
    if args.floor:
        rows.append(
            measure_server(args.devices, args.rate, args.seconds, None, args.keepalive, (), args.warmup, floor=True)
        )
    base = rows[0]["cpu_pct_per_1k"]
    print(f"{args.devices:,} devices, {args.rate:g} PINGREQ/s for {args.seconds:g} s, one worker")
    print(
        "| --coalesce | heartbeats/s | answered | server CPU | per 1,000 heartbeats/s | vs the first "
        "| a heartbeat: user · kernel | PINGRESP after, p50 · p99 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = {-2.0: "Python floor", -1.0: "Mosquitto"}.get(r["coalesce"], f"{r['coalesce']:g} s")
        if "pings" in r:
            name += f", pings {r['pings']}"
        print(
            f"| {name} | {r['heartbeats_per_s']:.0f} | {100 * r['answered']:.0f}% | "
            f"{r['cpu_pct']:.2f}% | {r['cpu_pct_per_1k']:.1f}% | {r['cpu_pct_per_1k'] / base:.2f}× "
            f"| {r['user_us']:.1f} · {r['kernel_us']:.1f} µs "
            f"| {r['delay_p50_ms']:.1f} · {r['delay_p99_ms']:.1f} ms |"
        )
    return 0 if all(r["answered"] >= 1.0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
