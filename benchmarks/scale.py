"""What a worker's share of a large fleet costs per heartbeat, ours beside Mosquitto's.

    python -m benchmarks.scale [--shape 10000x1000] [--shape 17000x72] [--seconds 60] [--repeat 3]

The 20,000-file limit spreads 500,000 devices over 29 workers: each holds about
17,000 devices and sees about 72 heartbeats a second, where one process of 10,000
devices sees 1,000. At each shape (``DEVICESxRATE``) this runs one process of ours
(``servers.heartbeat``, dense engine, ``--coalesce``) and one Mosquitto at the same
time, each driven by a process of its own in the same window (:mod:`benchmarks.wakeups`:
raw MQTT devices, PINGREQs evenly spread, CPU from ``/proc/PID/task/*/sched``), the
shapes in turn ``--repeat`` times, and prints each server's median CPU per 1,000
heartbeats/s (the lower middle for an even count), the median of the pairs' ratios,
and the ratio between the shapes for each server: how much of the cost of the large
fleet's shape is the machine's, paid by a broker written in C as much as by ours.

It also measures what this machine charges for memory left untouched: the kernel's
own ``epoll_wait`` per ready socket, when the loop slept 10 ms and when it slept 1 s
before looking (sockets, ``epoll`` and the reads are all the kernel's; Python only
times them). On a virtual machine whose host runs other guests between our
wake-ups, a worker that wakes once a second finds every cache cold.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import select
import socket
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from benchmarks.wakeups import measure_server
from loadtest.generator.source import bind_source
from loadtest.mqtt_targets import PeerUnavailable
from loadtest.stats import percentile


def parse_shape(text: str) -> tuple[int, float]:
    """``"17000x72"`` -> (17000 devices, 72 heartbeats a second)."""
    devices, _, rate = text.partition("x")
    try:
        shape = int(devices), float(rate)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is DEVICESxRATE, such as 17000x72, not {text!r}") from None
    if shape[0] < 1 or not shape[1] > 0:
        raise argparse.ArgumentTypeError(f"a shape needs devices >= 1 and a rate > 0, not {text!r}")
    return shape


def keepalive_for(devices: int, rate: float) -> int:
    """A keep-alive whose 1.5 times outlasts a round of every device's PINGREQ, with room
    for the connect phase: no device may expire while the benchmark runs."""
    return max(30, math.ceil(devices / rate) + 30)


def cold_touch(
    sockets: int = 200, ready: int = 72, sleeps: Sequence[float] = (0.01, 1.0), rounds: int | None = None
) -> dict[float, float]:
    """µs the kernel's ``epoll_wait`` spends per ready socket, after sleeping each of
    ``sleeps`` seconds with ``ready`` of ``sockets`` loopback connections readable
    (``rounds`` times each; by default about 5 s of short sleeps, or 8 long ones)."""
    with socket.create_server(("127.0.0.1", 0), backlog=sockets) as listener:
        clients, servers = [], []
        try:
            for _ in range(sockets):
                client = socket.socket()
                bind_source(client, "127.0.6.2")
                client.connect(listener.getsockname())
                clients.append(client)
                server, _ = listener.accept()
                server.setblocking(False)
                servers.append(server)
            poller = select.epoll()
            by_fd = {s.fileno(): s for s in servers}
            for fd in by_fd:
                poller.register(fd, select.EPOLLIN)
            rng = random.Random(1)
            out: dict[float, float] = {}
            for pause in sleeps:
                spent, seen = 0.0, 0
                for _ in range(rounds or max(3, int(5 / pause) if pause < 1 else 8)):
                    for client in rng.sample(clients, ready):
                        client.send(b"\xc0\x00")
                    time.sleep(pause)
                    t0 = time.perf_counter()
                    events = poller.poll(0, 1024)
                    spent += time.perf_counter() - t0
                    seen += len(events)
                    for fd, _ in events:
                        by_fd[fd].recv(64)
                out[pause] = 1e6 * spent / max(seen, 1)
            poller.close()
        finally:
            for sock in clients + servers:
                sock.close()
    return out


def measure_pair(
    devices: int, rate: float, seconds: float, coalesce: float, warmup: float, mosquitto: bool = True
) -> dict[str, dict[str, float]]:
    """Ours and (with ``mosquitto``) Mosquitto at one shape, at the same time: each
    server with its own driver process (the file limit keeps two fleets out of one),
    both warming up and measuring in the same window, so that whatever else the shared
    machine does then falls on both. ``{"idlekeeper": row, "Mosquitto": row}``."""
    keepalive = keepalive_for(devices, rate)
    # Time to spawn a driver and connect its devices (about 2,000 a second here).
    start_at = time.monotonic() + 8 + devices / 1000
    jobs: dict[str, float | None] = {"idlekeeper": coalesce}
    if mosquitto:
        jobs["Mosquitto"] = None
    out: dict[str, dict[str, float]] = {}
    with ProcessPoolExecutor(max_workers=len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {
            name: pool.submit(measure_server, devices, rate, seconds, c, keepalive, (), warmup, start_at)
            for name, c in jobs.items()
        }
        for name, future in futures.items():
            try:
                out[name] = future.result()
            except PeerUnavailable as exc:
                print(f"no {name} row: {exc}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run every shape, both servers at once, ``--repeat`` times; print the table; exit 1
    if a heartbeat went unanswered."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape",
        action="append",
        type=parse_shape,
        default=None,
        help="DEVICESxRATE, repeatable (default: 10000x1000 and 17000x72)",
    )
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds per pair (default: 60)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of PINGREQs before measuring (default: 10)")
    p.add_argument("--repeat", type=int, default=3, help="pairs per shape, the shapes taken in turn (default: 3)")
    p.add_argument("--coalesce", type=float, default=1.0, help="our server's --coalesce (default: 1)")
    p.add_argument("--no-mosquitto", action="store_true", help="ours only")
    p.add_argument(
        "--touch-rounds",
        type=int,
        default=None,
        help="sleeps per pause for the epoll_wait figure (default: about 5 s each)",
    )
    args = p.parse_args(argv)
    shapes: list[tuple[int, float]] = args.shape or [(10_000, 1000.0), (17_000, 72.0)]
    floor = cold_touch(rounds=args.touch_rounds)
    print(
        "epoll_wait per ready socket: "
        + ", ".join(f"{us:.1f} µs after sleeping {pause:g} s" for pause, us in floor.items())
    )
    runs: dict[tuple[int, float], list[dict[str, dict[str, float]]]] = {shape: [] for shape in shapes}
    answered = True
    for n in range(args.repeat):
        for devices, rate in shapes:
            pair = measure_pair(devices, rate, args.seconds, args.coalesce, args.warmup, not args.no_mosquitto)
            runs[(devices, rate)].append(pair)
            answered &= all(row["answered"] >= 1.0 for row in pair.values())
            said = ", ".join(f"{name} {row['cpu_pct_per_1k']:.1f}%" for name, row in pair.items())
            print(f"pair {n + 1}: {devices:,} devices at {rate:g}/s: {said} per 1,000 heartbeats/s", flush=True)
    names = [n for n in ("idlekeeper", "Mosquitto") if any(n in pair for pairs in runs.values() for pair in pairs)]
    medians = {
        shape: {n: percentile([pair[n]["cpu_pct_per_1k"] for pair in pairs if n in pair], 50) for n in names}
        for shape, pairs in runs.items()
    }
    print(
        f"\nCPU per 1,000 heartbeats/s, one process each, both at once, "
        f"median of {args.repeat} pairs of {args.seconds:g} s"
    )
    print(
        "| devices | heartbeats/s | "
        + " | ".join(names)
        + (" | ours ÷ Mosquitto, median of the pairs |" if len(names) > 1 else " |")
    )
    print("|---|---|" + "---|" * (len(names) + (len(names) > 1)))
    for (devices, rate), row in medians.items():
        cells = [f"{row[n]:.1f}%" for n in names]
        if len(names) > 1:
            pairs = [pair for pair in runs[(devices, rate)] if len(pair) == 2]
            ratio = percentile(
                [pair["idlekeeper"]["cpu_pct_per_1k"] / pair["Mosquitto"]["cpu_pct_per_1k"] for pair in pairs], 50
            )
            cells.append(f"{ratio:.2f}×")
        print(f"| {devices:,} | {rate:g} | " + " | ".join(cells) + " |")
    first = medians[shapes[0]]
    for shape in shapes[1:]:
        ratios = [f"{medians[shape][n] / first[n]:.1f}×" for n in names]
        print(
            f"| {shape[0]:,}x{shape[1]:g} ÷ {shapes[0][0]:,}x{shapes[0][1]:g} | | "
            + " | ".join(ratios)
            + (" | |" if len(names) > 1 else " |")
        )
    return 0 if answered else 1


if __name__ == "__main__":
    sys.exit(main())
