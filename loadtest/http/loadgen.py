"""The legitimate HTTP load: ``wrk`` when installed, else a small keep-alive client of our
own, and the median of several rounds of it."""

from __future__ import annotations

import math
import re
import selectors
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..sampler import cpu_split, processes
from ..stats import percentile
from .workload import REQUEST, LoadFigures

__all__ = ["median_round", "rounds_in_turn", "run_load", "run_own_client", "run_wrk"]

Figures = TypeVar("Figures", bound=LoadFigures)


def _ms(text: str) -> float:
    match = re.match(r"([\d.]+)(us|ms|s)", text)
    if not match:
        return math.nan
    value, unit = float(match.group(1)), match.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_wrk(port: int, connections: int, duration: float) -> LoadFigures:
    """``wrk -t1 --latency``: one thread is plenty for a single-process Python server."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency", f"http://127.0.0.1:{port}/"],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    ).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    errors += int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    return LoadFigures(
        "wrk",
        int(total.group(1)) if total else 0,
        float(rps.group(1)) if rps else math.nan,
        _ms(p50.group(1)) if p50 else math.nan,
        _ms(p99.group(1)) if p99 else math.nan,
        errors,
    )


def run_own_client(port: int, connections: int, duration: float) -> LoadFigures:
    """Keep-alive GETs on ``connections`` sockets, one request in flight on each."""
    sel = selectors.DefaultSelector()
    latencies: list[float] = []
    errors = 0
    sent_at: dict[socket.socket, float] = {}
    buffers: dict[socket.socket, bytes] = {}
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        sock.send(REQUEST)
        sent_at[sock] = time.perf_counter()
        buffers[sock] = b""
    end = time.monotonic() + duration
    while time.monotonic() < end:
        for key, _ in sel.select(timeout=0.5):
            sock = key.fileobj  # type: ignore[assignment]
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                errors += 1
                sel.unregister(sock)
                sock.close()
                continue
            buf = buffers[sock] + data
            head, sep, body = buf.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length:\s*(\d+)", head)
            if not sep or not length or len(body) < int(length.group(1)):
                buffers[sock] = buf
                continue
            buffers[sock] = body[int(length.group(1)) :]
            latencies.append(time.perf_counter() - sent_at[sock])
            sock.send(REQUEST)
            sent_at[sock] = time.perf_counter()
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    ms = [v * 1000 for v in latencies]
    return LoadFigures("own client", len(ms), len(ms) / duration, percentile(ms, 50), percentile(ms, 99), errors)


def median_round(rounds: Sequence[LoadFigures]) -> LoadFigures:
    """The round with the median throughput (the lower of the two middle ones for an
    even count), with its own latencies: a figure measured, not a blend."""
    if not rounds:
        raise ValueError("no rounds")
    ordered = sorted(rounds, key=lambda r: (r.rps != r.rps, r.rps))
    return ordered[(len(ordered) - 1) // 2]


def rounds_in_turn(
    names: Sequence[str], rounds: int, measure: Callable[[str], Figures], title: str, unit: str = "req/s"
) -> dict[str, list[Figures]]:
    """``measure`` each server of ``names`` once per round, each round starting from the next
    one, so that a disturbance of the shared machine falls on all of them alike; every
    server's rounds, in order (:func:`median_round` picks its figure). A line per
    measurement, under a ``title`` per round."""
    out: dict[str, list[Figures]] = {name: [] for name in names}
    order = list(names)
    for r in range(rounds):
        print(f"\n== {title} round {r + 1} of {rounds} ==", flush=True)
        for name in order[r % len(order) :] + order[: r % len(order)] if order else []:
            figures = measure(name)
            out[name].append(figures)
            print(f"   {name:<20} {figures.rps:,.0f} {unit}, p99 {figures.p99_ms:.1f} ms", flush=True)
    return out


def run_load(port: int, connections: int, duration: float, tool: str = "auto", pids: Sequence[int] = ()) -> LoadFigures:
    """wrk when installed (or asked for), else the own client. Given the server's
    ``pids`` (each with its descendants), also what a request cost it in CPU, in user
    space and in the kernel apart."""
    procs = processes(pids, trees=True)
    before = cpu_split(procs)
    if tool == "wrk" or (tool == "auto" and shutil.which("wrk")):
        figures = run_wrk(port, connections, duration)
    else:
        figures = run_own_client(port, connections, duration)
    if procs and figures.requests:
        after = cpu_split(procs)
        figures.user_us = (after[0] - before[0]) * 1e6 / figures.requests
        figures.kernel_us = (after[1] - before[1]) * 1e6 / figures.requests
    return figures
