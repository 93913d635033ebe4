"""What one client's wildcard filters cost everyone else: publish cost and healthy devices'
round trips against the number of filters, ours beside Mosquitto.

    python -m benchmarks.topics [--filters 0,1000,10000,20000] [--rates 200] [--seconds 5]
                                [--devices 10] [--ping-every 0.25] [--servers ours,mosquitto]
                                [--roots DIR[,DIR...]] [--ours-args ARGS[;ARGS...]] [--memory 20000]

For each server and each count N of ``--filters``: a server is started afresh (ours:
``python -m servers.heartbeat``, one worker, the dense engine, with ``--ours-args``;
Mosquitto 2.0 from a config file with ``listener PORT 127.0.0.1`` and ``allow_anonymous
true``). ``--devices`` healthy devices each send a PINGREQ every ``--ping-every`` seconds,
timed to the PINGRESP, and a newcomer connects once a second (timed to its CONNACK),
from start to end. One client subscribes to ``zz/+/0`` .. ``zz/+/<N-1>`` (one filter a
SUBSCRIBE, timed to the last SUBACK: the "subscribing" row). Then windows of
``--seconds`` each: a quiet one (pings only: the baseline CPU), and for each of
``--rates`` another client publishing QoS 0 at that rate on a topic no filter matches
(``zz/m/none``) and on one that exactly one filter matches (``zz/m/0``). A window's CPU per
publish is the server's CPU over the window, less the quiet window's rate, per publish.

The server runs pinned to one CPU and the clients (one trio run) to the other, where the
machine has two. A server that falls half a second behind the rate is sent no more until
it catches up, and if it cannot read what it was sent within 30 s its later windows are
skipped. ``--roots`` runs our server from several source trees (a copy of an earlier
commit, say) in the same run. Last, the bytes a wildcard filter takes (tracemalloc, with
``--memory`` of them held by one client) in the broker's subscriptions of each tree, and
in the index another worker or node keeps of them. Every server is stopped by its PID.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from loadtest.mqtt_targets import start_mosquitto
from loadtest.processes import free_port, load_side, pin, split_cpus, start_heartbeat, stop
from loadtest.sampler import cpu_model, cpu_seconds, process_tree, processes

from .topics_load import Client, Devices, Window, hold_filters, percentile, publish_window

__all__ = ["Row", "cpu_of", "main", "memory_per_filter", "measure", "ratios", "table"]

ROOT = Path(__file__).resolve().parent.parent
SUBSCRIBE_BOUND = 300.0
"""Seconds the SUBSCRIBEs may take before the run gives up."""
TOPICS = {"none": "zz/m/none", "one": "zz/m/0"}
"""The topics published on: one no filter matches, one that ``zz/+/0`` matches."""


@dataclass(frozen=True)
class Row:
    """One window of one server with ``filters`` held."""

    server: str
    filters: int
    subscribe: float
    """Seconds to have every SUBSCRIBE acknowledged."""
    topic: str
    """subscribing (while the filters were taken), quiet (no publishes), none or one
    (filters matching the topic published on)."""
    rate: float
    """Publishes a second asked for."""
    window: Window | None
    """None: skipped (the server was still behind an earlier window)."""
    cpu_per_publish: float
    """Server CPU seconds per publish beyond the quiet window's rate (NaN when quiet)."""

    def p(self, q: float) -> float:
        """Healthy devices' round-trip quantile ``q``, seconds."""
        return percentile(self.window.rtts, q) if self.window else math.nan


async def measure(
    port: int,
    filters: int,
    rates: Sequence[float],
    seconds: float,
    devices: int,
    every: float,
    cpu: Callable[[], float],
) -> list[tuple[str, float, float, Window | None]]:
    """Hold ``filters`` filters while the devices ping, then run the windows; (topic, rate,
    subscribe seconds, window) each, the first for the SUBSCRIBEs themselves."""
    holder = await Client.connect(port, "zz-holder")
    publisher = await Client.connect(port, "zz-publisher")
    received = 0

    async def read_holder() -> None:
        nonlocal received
        while True:
            received += (await holder.packet())[0] & 0xF0 == 0x30

    out: list[tuple[str, float, float, Window | None]] = []
    healthy = Devices(port, devices, every)
    stop_devices = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(healthy.run, stop_devices)
        await trio.sleep(min(1.0, seconds))  # every device's first ping is under way
        healthy.take()
        cpu0 = cpu()
        with trio.fail_after(SUBSCRIBE_BOUND):
            took, refused = await hold_filters(holder, filters)
        if refused:
            print(f"  {refused} of {filters} filters refused", file=sys.stderr)
        rtts, connects = healthy.take()
        out.append(("subscribing", 0.0, took, Window(took, 0, cpu() - cpu0, True, rtts, connects, 0)))
        nursery.start_soon(read_holder)  # once hold_filters has read every SUBACK
        quiet = await publish_window(None, "", 0, seconds, healthy, cpu, lambda: received)
        out.append(("quiet", 0.0, took, quiet))
        behind = False
        for rate in rates:
            for kind, topic in TOPICS.items():
                if behind:
                    out.append((kind, rate, took, None))
                    continue
                window = await publish_window(publisher, topic, rate, seconds, healthy, cpu, lambda: received)
                behind = not window.drained
                out.append((kind, rate, took, window))
        stop_devices.set()
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    for client in (holder, publisher):
        await client.close()
    return out


def ours_args(args: argparse.Namespace, root: str) -> list[str]:
    """``--ours-args`` for ``root``: one set for every tree, or one per tree (``;`` between):
    an earlier tree may not know an option a later one needs."""
    sets = args.ours_args.split(";")
    if len(sets) == 1:
        return shlex.split(sets[0])
    return shlex.split(sets[args.root_list.index(root)])


def run_server(server: str, root: str, args: argparse.Namespace) -> list[Row]:
    """Every count of filters on a fresh ``server`` (ours from ``root``, or mosquitto)."""
    split = split_cpus()
    rows: list[Row] = []
    name = server if server == "mosquitto" or len(args.root_list) == 1 else f"ours ({root})"
    for filters in args.filter_list:
        port = free_port()
        if server == "mosquitto":
            proc = start_mosquitto("mosquitto", port).proc
        else:
            proc = start_heartbeat(port, 1, ["--engine", "dense", *ours_args(args, root)], cwd=root)
        try:
            pids = [p.pid for p in process_tree(proc.pid)]
            if split is not None:
                pin(pids, split.server)
            cpu = functools.partial(cpu_of, pids)
            with load_side(split):
                found = trio.run(
                    measure, port, filters, args.rate_list, args.seconds, args.devices, args.ping_every, cpu
                )
        finally:
            stop(proc)  # by its PID
        quiet = next(window for topic, _, _, window in found if topic == "quiet")
        base = quiet.cpu / quiet.seconds if quiet else 0.0
        for topic, rate, took, window in found:
            per = math.nan
            if window is not None and window.published:
                per = max(0.0, window.cpu - base * window.seconds) / window.published
            rows.append(Row(name, filters, took, topic, rate, window, per))
        print(f"{name}: {filters} filters done", file=sys.stderr)
    return rows


def cpu_of(pids: Sequence[int]) -> float:
    """CPU seconds the threads of ``pids`` ran, from the scheduler's nanosecond counts
    (``/proc/PID/task/*/schedstat``): psutil's clock ticks are 10 ms, as much as 50
    publishes' worth at 200 a second. psutil's figure where there is no ``/proc``."""
    total = 0
    try:
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        return cpu_seconds(processes(pids))
    return total / 1e9


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else "none" if math.isinf(seconds) else f"{1000 * seconds:,.1f} ms"


def table(rows: Sequence[Row]) -> str:
    """Every window as a markdown table."""
    lines = [
        "| server | filters | SUBSCRIBEs took | topic | msg/s sent | CPU per publish | PINGREQ p50 | p99 | "
        "CONNECT max | delivered |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        w = r.window
        sent = "-" if w is None else f"{w.published / w.seconds:,.0f}" + ("" if w.drained else " (behind)")
        per = "-" if math.isnan(r.cpu_per_publish) else f"{1e6 * r.cpu_per_publish:,.1f} µs"
        connect = _ms(max(w.connects)) if w and w.connects else "-"
        lines.append(
            f"| {r.server} | {r.filters:,} | {r.subscribe:.2f} s | {r.topic} | {sent} | {per} | {_ms(r.p(0.5))} | "
            f"{_ms(r.p(0.99))} | {connect} | {'-' if w is None else w.delivered} |"
        )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or b <= 0:
        return "-"
    return f"{a / b:,.2f}×"


def ratios(rows: Sequence[Row], peer: str = "mosquitto") -> str:
    """Each of our windows over the same window of ``peer``, as a markdown table."""
    theirs = {(r.filters, r.topic, r.rate): r for r in rows if r.server == peer}
    lines = [
        f"| server / {peer} | filters | topic | msg/s | SUBSCRIBEs took | CPU per publish | PINGREQ p50 | p99 |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        other = theirs.get((r.filters, r.topic, r.rate))
        if r.server == peer or other is None:
            continue
        lines.append(
            f"| {r.server} | {r.filters:,} | {r.topic} | {r.rate:,.0f} | {_ratio(r.subscribe, other.subscribe)} | "
            f"{_ratio(r.cpu_per_publish, other.cpu_per_publish)} | {_ratio(r.p(0.5), other.p(0.5))} | "
            f"{_ratio(r.p(0.99), other.p(0.99))} |"
        )
    return "\n".join(lines)


_MEMORY = """
import json, sys, tracemalloc
from servers.heartbeat.broker.subscriptions import Subscriptions
n = int(sys.argv[1])
filters = [f"zz/+/{i}" for i in range(n)]  # made before tracing: a packet brings them in
tracemalloc.start()
subs = Subscriptions(max_qos=2)
for f in filters:
    subs.subscribe("holder", f, 0)
out = {"subscriptions": tracemalloc.get_traced_memory()[0] / n}
tracemalloc.stop()
try:
    from servers.heartbeat.broker.topics import FilterIndex
except ImportError:
    pass
else:
    frozen = frozenset(filters)  # what a RemoteFilters frame brings
    tracemalloc.start()
    index = FilterIndex(frozen)
    out["index"] = tracemalloc.get_traced_memory()[0] / n
print(json.dumps(out))
"""


def memory_per_filter(root: str, count: int) -> dict[str, float]:
    """Bytes per wildcard filter (tracemalloc) when one key holds ``count`` of them, in the
    source tree ``root``: in the broker's Subscriptions, and in a FilterIndex beyond the
    frozenset it is given (where the tree has one)."""
    done = subprocess.run(
        [sys.executable, "-c", _MEMORY, str(count)], cwd=root, capture_output=True, text=True, check=True, timeout=300
    )
    found: dict[str, float] = json.loads(done.stdout)
    return found


def _numbers(text: str, kind: Callable[[str], float]) -> list[float]:
    return [kind(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; see the module's docstring."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.topics", description=__doc__.split("\n\n")[0])
    p.add_argument("--filters", default="0,1000,10000,20000", help="comma-separated wildcard filter counts")
    p.add_argument("--rates", default="200", help="comma-separated publishes a second (default: 200)")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each window (default: 5)")
    p.add_argument("--devices", type=int, default=10, help="healthy devices pinging (default: 10)")
    p.add_argument("--ping-every", type=float, default=0.25, help="seconds between a device's pings (default: 0.25)")
    p.add_argument("--servers", default="ours,mosquitto", help="comma-separated: ours, mosquitto (default: both)")
    p.add_argument("--roots", default=str(ROOT), help="comma-separated source trees to run our server from")
    p.add_argument(
        "--ours-args",
        default="",
        help="more options for our server (e.g. '--max-subscriptions 30000'); with several --roots, "
        "one set per root may be given, ';' between them",
    )
    p.add_argument("--memory", type=int, default=20000, help="filters held for the memory figures; 0: none")
    args = p.parse_args(argv)
    args.filter_list = [int(n) for n in _numbers(args.filters, int)]
    args.rate_list = _numbers(args.rates, float)
    args.root_list = [str(Path(r).resolve()) for r in args.roots.split(",") if r]
    if ";" in args.ours_args and len(args.ours_args.split(";")) != len(args.root_list):
        p.error("--ours-args: one set for every root, or as many sets (';' between them) as --roots")
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - {"ours", "mosquitto"}:
        p.error(f"unknown server(s): {', '.join(sorted(unknown))}")
    if min(args.filter_list, default=-1) < 0 or min(args.rate_list, default=0) <= 0 or args.seconds <= 0:
        p.error("--filters must be counts, --rates and --seconds positive")
    rows: list[Row] = []
    for server in servers:
        for root in args.root_list if server == "ours" else [""]:
            rows += run_server(server, root, args)
    print(f"{cpu_model()}; windows of {args.seconds:g} s, {args.devices} devices pinging every {args.ping_every:g} s\n")
    print(table(rows))
    if args.memory:
        print(f"\n| source tree | bytes per wildcard filter, {args.memory:,} held: Subscriptions | FilterIndex |")
        print("|---|---:|---:|")
        for root in args.root_list:
            got = memory_per_filter(root, args.memory)
            index = f"{got['index']:,.0f}" if "index" in got else "-"
            print(f"| {root} | {got['subscriptions']:,.0f} | {index} |")
    if "mosquitto" in servers and len(servers) > 1:
        print()
        print(ratios(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
