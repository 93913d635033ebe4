"""The demo: simulated clients against the echo server, some of them going bad.

    python -m loadtest.echo_demo [--clients 400] [--duration 12]

It starts ``servers.echo`` as a separate process on a free loopback port, then
connects clients that behave like real ones:

- **healthy**: a PING every second, reading every PONG; must never be dropped;
- **silent**: pings for a while, then stops with its socket open (a dead device);
  must be closed ``--idle`` after its last ping, never sooner;
- **slowloris**: trickles one byte a second and never finishes its line; must be
  closed ``--line-timeout`` after its first byte, however it trickles;
- **slow reader**: asks for 50 MB and never reads; must be closed once its reply
  has stalled for ``--send-timeout``.

It ends with a report: who was closed, why, how late (seen from the client), the
false expiries (must be 0), and the server's memory and keeper statistics.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import trio

from .options import command_parser
from .report import figure, plural
from .stats import percentile

HOST = "127.0.0.1"


@dataclass
class Client:
    """One simulated client and what it saw."""

    kind: str
    index: int
    local_port: int = 0
    first_byte: float = math.nan  # trio time of its first byte of the current line (slowloris)
    last_ping: float = math.nan  # trio time of its last complete request
    closed_at: float = math.nan  # trio time the server's close was seen
    closed: trio.Event = field(default_factory=trio.Event)
    server_reason: str | None = None
    held_s: float = math.nan


async def wait_closed(stream: trio.SocketStream, client: Client) -> None:
    """Read until the server closes; note when."""
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    client.closed_at = trio.current_time()
    client.closed.set()


async def run_client(client: Client, port: int, until: float, args: argparse.Namespace) -> None:
    """Connect and behave as ``client.kind`` says until ``until`` (trio time) or the server's close."""
    rng = random.Random(client.index)
    try:
        stream = await trio.open_tcp_stream(HOST, port)
    except OSError:
        return
    client.local_port = stream.socket.getsockname()[1]
    async with stream, trio.open_nursery() as nursery:
        if client.kind == "slow reader":
            client.last_ping = trio.current_time()
            await stream.send_all(b"BLOB 50000000\n")
            with trio.move_on_at(until):
                await trio.sleep_forever()  # never reads; the server's close shows in its log
            nursery.cancel_scope.cancel()
            return
        nursery.start_soon(wait_closed, stream, client)
        try:
            if client.kind == "slowloris":
                client.first_byte = trio.current_time()
                await stream.send_all(b"P")
                while trio.current_time() < until and math.isnan(client.closed_at):
                    await trio.sleep(1.0)
                    await stream.send_all(b"I")
            else:
                stop = until if client.kind == "healthy" else trio.current_time() + rng.uniform(0.5, 4.0)
                await trio.sleep(rng.uniform(0, 1))
                while trio.current_time() < stop and math.isnan(client.closed_at):
                    client.last_ping = trio.current_time()
                    await stream.send_all(b"PING\n")
                    await trio.sleep(rng.uniform(0.8, 1.2))
                if client.kind == "silent":
                    with trio.move_on_at(until):
                        await trio.sleep_forever()  # dead device: socket open, nothing sent
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        with trio.move_on_at(until):
            await client.closed.wait()
        nursery.cancel_scope.cancel()


async def demo(args: argparse.Namespace) -> dict[str, Any]:
    """Start ``servers.echo``, run every client against it, and return the summary."""
    cmd = [
        sys.executable,
        "-m",
        "servers.echo",
        "--port",
        "0",
        "--idle",
        str(args.idle),
        "--line-timeout",
        str(args.line_timeout),
        "--send-timeout",
        str(args.send_timeout),
        "--tick",
        str(args.tick),
    ]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    events: list[dict[str, Any]] = []
    port_ready = trio.Event()
    port = 0
    rss_samples: list[int] = []
    server = psutil.Process(proc.pid)

    async def read_events() -> None:
        nonlocal port
        buf = b""
        assert proc.stdout is not None
        async for chunk in proc.stdout:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                event = json.loads(line)
                events.append(event)
                if event.get("event") == "listening":
                    port = int(event["port"])
                    port_ready.set()

    kinds = (
        ["silent"] * round(args.clients * args.silent)
        + ["slowloris"] * round(args.clients * args.slowloris)
        + ["slow reader"] * round(args.clients * args.slow_readers)
    )
    kinds += ["healthy"] * (args.clients - len(kinds))
    clients = [Client(kind, i) for i, kind in enumerate(kinds)]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_events)
            with trio.fail_after(10):
                await port_ready.wait()
            start = trio.current_time()
            until = start + args.duration
            print(
                f"idlekeeper demo: {plural(len(clients), 'client')} against servers.echo "
                f"(pid {proc.pid}, port {port}); "
                f"idle={args.idle}s line={args.line_timeout}s send={args.send_timeout}s tick={args.tick * 1000:.0f}ms",
                flush=True,
            )
            async with trio.open_nursery() as clients_nursery:
                for client in clients:
                    clients_nursery.start_soon(run_client, client, port, until, args)
                    await trio.sleep(0.002)  # a gentle ramp: the listen queue is finite
                while trio.current_time() < until + 0.5:
                    rss_samples.append(server.memory_info().rss)
                    closed = sum(1 for c in clients if not math.isnan(c.closed_at))
                    expired = sum(1 for e in events if e.get("event") == "expired")
                    print(
                        f"  t={trio.current_time() - start:5.1f}s  clients={len(clients)}  "
                        f"closed by server={expired:4d}  seen closed={closed:4d}",
                        flush=True,
                    )
                    await trio.sleep(1.0)
            proc.send_signal(signal.SIGTERM)  # by PID, never by name
            with trio.move_on_after(10):
                await proc.wait()
            nursery.cancel_scope.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return summarize(clients, events, rss_samples, args)


def summarize(
    clients: list[Client], events: list[dict[str, Any]], rss: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Join what the clients saw with what the server logged."""
    by_port = {c.local_port: c for c in clients if c.local_port}
    for event in events:
        if event.get("event") == "expired":
            client = by_port.get(event["peer"][1])
            if client is not None:
                client.server_reason = event["reason"]
                client.held_s = event["age_s"]
    stats: dict[str, Any] = next((e["stats"] for e in events if e.get("event") == "stats"), {})
    expected = {"healthy": None, "silent": "idle", "slowloris": "absolute", "slow reader": "send"}
    limit = {"silent": args.idle, "slowloris": args.line_timeout}
    rows = []
    for kind, reason in expected.items():
        group = [c for c in clients if c.kind == kind]
        dropped = [c for c in group if c.server_reason is not None]
        right = [c for c in dropped if c.server_reason == reason]
        row: dict[str, Any] = {"kind": kind, "clients": len(group), "closed": len(dropped), "expected": reason}
        row["right_reason"] = len(right)
        if kind in limit:
            base = "last_ping" if kind == "silent" else "first_byte"
            late = [
                (c.closed_at - getattr(c, base) - limit[kind]) * 1000
                for c in right
                if not math.isnan(c.closed_at) and not math.isnan(getattr(c, base))
            ]
            if late:
                row["lateness_ms"] = {
                    "min": min(late),
                    "p50": percentile(late, 50),
                    "p99": percentile(late, 99),
                    "max": max(late),
                }
        if kind == "slow reader" and right:
            row["held_s_median"] = statistics.median(c.held_s for c in right)
        rows.append(row)
    return {
        "clients": len(clients),
        "rows": rows,
        "false_expiries": sum(1 for c in clients if c.kind == "healthy" and c.server_reason is not None),
        "server_rss_peak_mb": max(rss) / 1e6 if rss else math.nan,
        "keeper": stats,
    }


def print_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print who was closed, why and how late, the false expiries, and the server's costs."""
    print()
    print(f"{'behaviour':<12} {'clients':>7} {'closed':>7} {'reason':>9} {'right':>6}  lateness seen by the client")
    for row in result["rows"]:
        late = row.get("lateness_ms")
        if late:
            detail = f"min {late['min']:.0f} / p50 {late['p50']:.0f} / p99 {late['p99']:.0f} / max {late['max']:.0f} ms"
        elif "held_s_median" in row:
            detail = f"held {row['held_s_median']:.1f} s (median), stalled reply cut {args.send_timeout}s after"
        else:
            detail = "must never be closed"
        print(
            f"{row['kind']:<12} {row['clients']:>7} {row['closed']:>7} {row['expected'] or '-':>9} "
            f"{row['right_reason']:>6}  {detail}"
        )
    keeper = result["keeper"]
    lag = keeper.get("lag", {})
    print()
    print(f"false expiries (healthy clients dropped): {result['false_expiries']}")
    print(
        f"server: peak RSS {figure(result['server_rss_peak_mb'], '.1f', ' MB', why='never sampled')}; "
        f"keeper woke {keeper.get('wakeups', '?')} times, "
        f"re-filed {keeper.get('refiles', '?')} entries, max reaper lag {lag.get('max', 0) * 1000:.1f} ms"
    )
    print(f"JSON: {args.json}")


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest.echo_demo``; 0 if no healthy client was dropped and every other was closed
    for its own reason."""
    p = command_parser("python -m loadtest.echo_demo", __doc__)
    p.add_argument("--clients", type=int, default=400, help="simulated clients (default: 400)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds the clients run (default: 12)")
    p.add_argument("--silent", type=float, default=0.25, help="share of clients that go silent")
    p.add_argument("--slowloris", type=float, default=0.08, help="share of slowloris clients")
    p.add_argument("--slow-readers", type=float, default=0.07, help="share of clients that never read")
    p.add_argument("--idle", type=float, default=3.0, help="server idle timeout (s)")
    p.add_argument("--line-timeout", type=float, default=5.0, help="server line deadline (s)")
    p.add_argument("--send-timeout", type=float, default=3.0, help="server send timeout (s)")
    p.add_argument("--tick", type=float, default=0.05, help="server keeper tick (s)")
    p.add_argument("--json", default="results/echo-demo.json", help="where to write the JSON result")
    args = p.parse_args(argv)
    started = time.time()
    result = trio.run(demo, args)
    result["wall_s"] = time.time() - started
    from pathlib import Path

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print_report(result, args)
    ok = result["false_expiries"] == 0 and all(
        row["right_reason"] == row["clients"] for row in result["rows"] if row["expected"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
