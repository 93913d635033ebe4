"""The main job: the heartbeat server, simulated devices, some going silent, and a report.

    python -m loadtest.demo [--devices 2000] [--workers 2] [--keepalive 2] [--duration 14]

It starts ``servers.heartbeat`` with ``--workers`` processes on a free loopback
port, subscribes to ``presence/#`` as a dashboard would, and connects MQTT devices
that ping every keep-alive K (with jitter), as mosquitto and paho clients do. A
share of them goes silent mid-run with the socket left open: dead devices whose
TCP never closed. The report says how many were detected, how late (never before
1.5 K after their last ping; at most one tick after), whether any healthy device was
dropped (there must be none), and the server's memory per device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import trio

from servers.heartbeat import codec

from .processes import free_port, start_heartbeat

HOST = "127.0.0.1"
SERVER_CUTS = {"keepalive-timeout", "connect-timeout", "protocol-error", "send-timeout", "takeover", "refused"}


@dataclass
class Device:
    """One simulated device and what it saw."""

    index: int
    silent: bool
    client_id: str = ""
    last_ping: float = math.nan  # trio time of its last packet
    closed_at: float = math.nan  # trio time it saw the server close it
    connected: bool = False
    cut_early: bool = False  # the server closed it while it was still running
    pings: list[float] = field(default_factory=list)  # wall-clock times its packets left
    went_silent: bool = False  # it did stop pinging before the end of the run


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


async def run_device(device: Device, port: int, args: argparse.Namespace, stop_at: float) -> None:
    rng = random.Random(device.index)
    try:
        stream = await trio.open_tcp_stream(HOST, port)
        sent_connect = trio.current_time()  # see run_device's ping loop on why "before"
        device.pings.append(time.time())
        await stream.send_all(codec.encode_connect(device.client_id, keep_alive=args.keepalive))
        got = b""
        while len(got) < 4:
            chunk = await stream.receive_some()
            if not chunk:
                return
            got += chunk
        if got[:4] != codec.encode_connack(False, 0):
            return
    except OSError:
        return
    device.connected = True
    device.last_ping = sent_connect  # CONNECT is its first packet
    silent_at = trio.current_time() + rng.uniform(1.0, args.duration / 2) if device.silent else math.inf

    async def read_until_closed() -> None:
        try:
            while await stream.receive_some():
                pass
        except trio.BrokenResourceError:
            pass
        device.closed_at = trio.current_time()
        device.cut_early = device.closed_at < stop_at
        nursery.cancel_scope.cancel()

    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(read_until_closed)
        with trio.move_on_at(stop_at):
            while True:
                # Real clients ping `keepalive` after their last packet; jitter spreads them.
                await trio.sleep(args.keepalive * rng.uniform(0.8, 1.0))
                if trio.current_time() >= silent_at:
                    device.went_silent = True
                    break
                # trio sends within this task step and only then yields, so the time
                # read just before send_all is when the bytes left; the time after it
                # can be much later on a loaded generator.
                now = trio.current_time()
                device.pings.append(time.time())
                try:
                    await stream.send_all(codec.encode_pingreq())
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                device.last_ping = now
        if device.went_silent:
            # Dead: the socket stays open and nothing is sent, until the server notices
            # (read_until_closed then ends this) or the observation window is over.
            with trio.move_on_at(stop_at + 1.5 * args.keepalive + 0.5):
                await trio.sleep_forever()
        nursery.cancel_scope.cancel()


async def watch_presence(port: int, events: list[dict[str, Any]]) -> None:
    """A dashboard: subscribe to presence/# and keep every event."""
    stream = await trio.open_tcp_stream(HOST, port)
    await stream.send_all(codec.encode_connect("demo-dashboard", keep_alive=0))
    await stream.send_all(codec.encode_subscribe(1, [("presence/#", 0)]))
    head = b""
    while len(head) < 9:  # CONNACK (4) and SUBACK (5)
        head += await stream.receive_some()
    reader = codec.PacketReader(max_packet_size=1 << 20)  # PUBLISH has the same layout both ways
    reader.feed(head[9:])
    async for data in stream:
        for packet in reader.feed(data):
            if isinstance(packet, codec.Publish):
                event = json.loads(packet.payload)
                event["seen_at"] = trio.current_time()
                events.append(event)


def server_processes(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """The supervisor and its workers."""
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children()]
    except psutil.NoSuchProcess:
        return []


def rss(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


async def demo(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="ik-demo-")) / "presence.jsonl"
    extra = ["--tick", str(args.tick), "--presence-log", str(log)]
    proc = await trio.to_thread.run_sync(start_heartbeat, port, args.workers, extra)
    devices = [Device(i, silent=i < args.devices * args.silent) for i in range(args.devices)]
    random.Random(1).shuffle(devices)
    for i, device in enumerate(devices):
        device.client_id = f"device-{i:06d}"
    events: list[dict[str, Any]] = []
    procs = server_processes(proc)
    baseline = rss(procs)
    peak = baseline
    window = 1.5 * args.keepalive
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_presence, port, events)
            start = trio.current_time()
            stop_at = start + args.duration
            print(
                f"idlekeeper demo: {args.devices} MQTT devices, keep-alive {args.keepalive}s "
                f"(dead after {window:g}s of silence), {args.silent:.0%} going silent; "
                f"servers.heartbeat with {args.workers} workers on port {port}, tick {args.tick * 1000:.0f} ms",
                flush=True,
            )
            async with trio.open_nursery() as fleet:
                for n, device in enumerate(devices):
                    fleet.start_soon(run_device, device, port, args, stop_at)
                    if n % 200 == 199:
                        await trio.sleep(0.05)  # a ramp: the listen queue is finite
                while trio.current_time() < stop_at + window + 1:
                    peak = max(peak, rss(procs))
                    online = sum(1 for d in devices if d.connected and math.isnan(d.closed_at))
                    dead = sum(1 for e in events if e["status"] == "offline" and e["reason"] == "keepalive-timeout")
                    print(
                        f"  t={trio.current_time() - start:5.1f}s  connected={sum(d.connected for d in devices):5d}"
                        f"  open={online:5d}  detected dead={dead:5d}",
                        flush=True,
                    )
                    await trio.sleep(1.0)
            nursery.cancel_scope.cancel()
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID, never by name
        await trio.to_thread.run_sync(proc.wait)
    return summarize(devices, events, baseline, peak, args, log)


def summarize(
    devices: list[Device],
    events: list[dict[str, Any]],
    baseline: int,
    peak: int,
    args: argparse.Namespace,
    log: Path,
) -> dict[str, Any]:
    window = 1.5 * args.keepalive
    offline = {e["client_id"]: e for e in events if e["status"] == "offline"}
    silent = [d for d in devices if d.went_silent]
    healthy = [d for d in devices if not d.silent and d.connected]
    detected = [d for d in silent if offline.get(d.client_id, {}).get("reason") == "keepalive-timeout"]
    server_late = [(float(offline[d.client_id]["silent_for"]) - window) * 1000 for d in detected]
    client_late = [(d.closed_at - d.last_ping - window) * 1000 for d in detected if not math.isnan(d.closed_at)]
    # A healthy device cut by the server is a false expiry if it had sent a packet
    # less than 1.5 x keep-alive before the cut (wall clock, shared by the processes
    # of one machine). Otherwise it really was silent that long: this generator,
    # overloaded, sent its pings late. Ending after the run or at shutdown is fine.
    false_expiries: list[str] = []
    generator_late: list[str] = []
    for d in healthy:
        event = offline.get(d.client_id, {})
        if event.get("reason") not in SERVER_CUTS and not d.cut_early:
            continue
        cut_at = float(event.get("time", math.inf))
        before = [p for p in d.pings if p <= cut_at]
        if before and cut_at - before[-1] < window - 0.005:
            false_expiries.append(d.client_id)
        else:
            generator_late.append(d.client_id)
    connected = sum(d.connected for d in devices)

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        return {"min": min(values), "p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}

    return {
        "devices": len(devices),
        "connected": connected,
        "workers": args.workers,
        "keepalive_s": args.keepalive,
        "tick_s": args.tick,
        "silent": len(silent),
        "detected": len(detected),
        "lateness_ms_server": stats(server_late),
        "lateness_ms_client": stats(client_late),
        "false_expiries": len(false_expiries),
        "generator_late": len(generator_late),
        "generator_max_gap_s": max(
            (max((b - a for a, b in zip(d.pings, d.pings[1:], strict=False)), default=0.0) for d in healthy),
            default=0.0,
        ),
        "rss_per_device_bytes": (peak - baseline) / connected if connected else math.nan,
        "server_rss_peak_mb": peak / 1e6,
        "presence_log": str(log),
    }


def print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print()
    print(f"devices connected      {r['connected']} of {r['devices']} (over {r['workers']} workers)")
    print(f"silent devices found   {r['detected']} of {r['silent']}")
    for view in ("server", "client"):
        late = r[f"lateness_ms_{view}"]
        if late:
            print(
                f"lateness ({view} view)   min {late['min']:.1f} / p50 {late['p50']:.1f} / p99 {late['p99']:.1f} / "
                f"max {late['max']:.1f} ms past 1.5 x keep-alive (tick {args.tick * 1000:.0f} ms)"
            )
    print(f"false expiries         {r['false_expiries']} healthy devices dropped")
    if r["generator_late"]:
        print(
            f"generator overloaded   {r['generator_late']} devices went silent because this generator sent their "
            f"pings late (longest gap {r['generator_max_gap_s']:.1f} s); use fewer devices per process"
        )
    per_device = r["rss_per_device_bytes"] / 1024
    print(f"server memory          {per_device:.1f} KiB RSS per device, peak {r['server_rss_peak_mb']:.0f} MB")
    print(f"presence log           {r['presence_log']}")
    print(f"JSON                   {args.json}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=2000, help="simulated devices (default: 2000)")
    p.add_argument("--workers", type=int, default=2, help="server worker processes (default: 2)")
    p.add_argument("--keepalive", type=int, default=2, help="device keep-alive in seconds (default: 2)")
    p.add_argument("--silent", type=float, default=0.2, help="share of devices that go silent (default: 0.2)")
    p.add_argument("--duration", type=float, default=14.0, help="seconds the devices run (default: 14)")
    p.add_argument("--tick", type=float, default=0.05, help="server keeper tick in seconds (default: 0.05)")
    p.add_argument("--json", default="results/demo.json", help="where to write the JSON result")
    args = p.parse_args(argv)
    started = time.time()
    result = trio.run(demo, args)
    result["wall_s"] = round(time.time() - started, 1)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print_report(result, args)
    late = result["lateness_ms_server"]
    ok = (
        result["false_expiries"] == 0
        and result["generator_late"] == 0
        and result["detected"] == result["silent"]
        and (not late or late["min"] >= 0)
        and result["connected"] == result["devices"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
