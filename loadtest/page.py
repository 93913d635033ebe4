"""``python -m loadtest page``: what the operator's page costs a loaded server.

A heartbeat server with ``--devices`` MQTT devices (the device load of ``loadtest
devices``: pinging every keep-alive, some going silent, vanishing and reconnecting),
and, once they are online, phases of ``--phase`` seconds taken in turn: nobody
watching, then ``--watchers`` live pages (server-sent event streams, all on the first
worker's status port, as an operator's browsers would be), and so on, ``--rounds``
times. Each phase's CPU is read from every server process, so the page's cost is the
difference between the two kinds of phase in the same run, on the same devices.

It also checks what the watchers were sent (a snapshot a second each, every one
within a second of its making) and, with ``--screenshot PATH``, saves the page as
headless Chromium shows it then (the README's picture).
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import threading
import time
import timeit
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .devices import run_devices
from .mqtt_targets import HeartbeatTarget
from .options import command_parser
from .report import plural
from .sampler import cpu_seconds, processes
from .stats import percentile
from .workload import DeviceLoad

__all__ = ["Watcher", "fetch", "main"]


@dataclass
class Watcher:
    """One live page, as the server sees it: a stream of snapshots read as they come."""

    port: int
    snapshots: int = 0
    bytes: int = 0
    delays: list[float] = field(default_factory=list)
    """Seconds from each snapshot's making (its ``time``) to its arrival here."""
    arrivals: list[float] = field(default_factory=list)
    """``time.monotonic()`` of each snapshot's arrival."""
    last: dict[str, Any] = field(default_factory=dict)
    """The latest snapshot."""
    failed: str = ""
    _sock: socket.socket | None = None

    def run(self, stop: threading.Event) -> None:
        try:
            sock = self._sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            sock.sendall(b"GET /presence/stream HTTP/1.1\r\nHost: page\r\nAccept: text/event-stream\r\n\r\n")
            buffer = b""
            while not stop.is_set():
                chunk = sock.recv(65536)
                if not chunk:
                    self.failed = "the server closed the stream"
                    return
                self.bytes += len(chunk)
                buffer += chunk
                while b"\n\n" in buffer:
                    message, buffer = buffer.split(b"\n\n", 1)
                    for line in message.split(b"\n"):
                        if line.startswith(b"data: "):
                            snapshot = self.last = json.loads(line[6:])
                            self.snapshots += 1
                            self.delays.append(time.time() - snapshot["time"])
                            self.arrivals.append(time.monotonic())
        except OSError as exc:
            if not stop.is_set():
                self.failed = repr(exc)

    def longest_gap(self, since: float, until: float) -> float:
        """The longest wait between two snapshots (or the span's ends) within the span."""
        times = [since, *[t for t in self.arrivals if since <= t <= until], until]
        return max(b - a for a, b in itertools.pairwise(times))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


def cpu_seconds_each(pids: Sequence[int]) -> dict[int, float]:
    """User and system CPU seconds of each process still there."""
    return {proc.pid: cpu_seconds([proc]) for proc in processes(pids)}


def fetch(port: int, path: str) -> Any:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: page\r\nConnection: close\r\n\r\n".encode())
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    return json.loads(raw.partition(b"\r\n\r\n")[2])


def per_event_cost() -> float:
    """Seconds the registry's side of the page adds to one presence event (a ring append
    and two counts), measured here, for the "nobody watching" claim."""
    from servers.heartbeat.mqtt.endings import Offline
    from servers.heartbeat.presence.event import PresenceEvent
    from servers.heartbeat.presence.overview import RecentEnds

    recent = RecentEnds()
    event = PresenceEvent("offline", "sensor-0001", "127.0.0.1:1", Offline.KEEPALIVE_TIMEOUT, 1.5, time.time())
    runs = 200_000
    return min(timeit.repeat(lambda: recent(event), number=runs, repeat=5)) / runs


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server and the devices, take the phases, return the figures."""
    # Connections opened over one keep-alive: their pings then come evenly, not in waves
    # that would swamp the difference the phases measure.
    rate = args.rate or max(100.0, args.devices / args.keepalive)
    load = DeviceLoad(
        devices=args.devices, keepalive=args.keepalive, silent=0.05, vanish=0.01, reconnect=0.01, rate=rate
    )
    target = HeartbeatTarget.start(load.devices, tick=0.1, workers=args.workers)
    status = int(target.metrics_urls[0].rsplit(":", 1)[1].split("/", 1)[0])
    outcome: dict[str, Any] = {}
    devices = threading.Thread(target=lambda: outcome.update(run_devices(load, target)), daemon=True)
    phases: list[dict[str, Any]] = []
    try:
        devices.start()
        deadline = time.monotonic() + 60 + load.devices / load.rate * 2
        while time.monotonic() < deadline:
            registry = fetch(status, "/presence.json?limit=0")["registry"]
            if registry and registry["online"] >= load.devices * 0.97:
                break
            time.sleep(1)
        else:
            raise SystemExit("the devices did not come online in time")
        pids = target.pids()
        first_pid = int(fetch(status, "/presence/worker.json")["pid"])
        for round_ in range(args.rounds):
            for watched in (False, True):
                stop = threading.Event()
                watchers = [Watcher(status) for _ in range(args.watchers if watched else 0)]
                threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in watchers]
                before, t0 = cpu_seconds_each(pids), time.monotonic()
                for thread in threads:
                    thread.start()
                time.sleep(args.phase)
                after, t1 = cpu_seconds_each(pids), time.monotonic()
                stop.set()
                for w in watchers:
                    w.close()
                for thread in threads:
                    thread.join(timeout=5)
                used = {pid: after[pid] - before[pid] for pid in after if pid in before}
                delays = [d for w in watchers for d in w.delays]
                phases.append(
                    {
                        "round": round_,
                        "watchers": len(watchers),
                        "seconds": t1 - t0,
                        "cpu_share": sum(used.values()) / (t1 - t0),
                        "cpu_share_first_worker": used.get(first_pid, 0.0) / (t1 - t0),
                        "cpu_share_supervisor": used.get(target.proc.pid, 0.0) / (t1 - t0),
                        "snapshots_per_watcher": [w.snapshots for w in watchers],
                        "bytes_per_watcher_per_s": statistics.fmean([w.bytes / (t1 - t0) for w in watchers])
                        if watchers
                        else 0.0,
                        "delay_p99": percentile(delays, 99) if delays else 0.0,
                        "delay_max": max(delays, default=0.0),
                        "failed": [w.failed for w in watchers if w.failed],
                    }
                )
                time.sleep(1)  # the streams' ends settle before the next phase counts
        first = fetch(status, "/presence/worker.json")
        snapshot_cpu = _snapshot_cost(status, pids)
        if args.screenshot:
            # Half-way through finding the silent devices, so the picture has them and their
            # lateness, and comes well before the run's end closes every connection.
            silent = int(load.devices * load.silent)
            while devices.is_alive():
                registry = fetch(status, "/presence.json?limit=0")["registry"] or {}
                if registry.get("ends", {}).get("keepalive-timeout", 0) >= silent * 0.5:
                    break
                time.sleep(0.5)
            _screenshot(status, Path(args.screenshot))
        devices.join(timeout=60 + load.keepalive * 3)
    finally:
        target.stop()
    off = [p["cpu_share"] for p in phases if not p["watchers"]]
    on = [p["cpu_share"] for p in phases if p["watchers"]]
    return {
        "devices": load.devices,
        "workers": target.workers,
        "watchers": args.watchers,
        "phase_s": args.phase,
        "phases": phases,
        "cpu_share_unwatched": statistics.fmean(off),
        "cpu_share_watched": statistics.fmean(on),
        "page_cost_share": statistics.fmean(on) - statistics.fmean(off),
        "page_figures": first.get("page"),
        "snapshot_cpu_seconds": snapshot_cpu,
        "per_event_seconds": per_event_cost(),
        "device_run": {
            key: outcome.get(key)
            for key in ("connected", "silent_detected", "false_expiries", "result")
            if key in outcome
        },
    }


def _snapshot_cost(status: int, pids: Sequence[int], count: int = 500) -> float:
    """CPU seconds one snapshot costs the server, every process together (the asking
    worker, the others it asks for their figures, the supervisor's authority): ``count``
    snapshots asked for one after another, against the same span unasked."""
    before, t0 = cpu_seconds_each(pids), time.monotonic()
    for _ in range(count):
        fetch(status, "/presence.json")
    asked, span = cpu_seconds_each(pids), time.monotonic() - t0
    time.sleep(span)  # the same time with nobody asking: the devices' own cost
    idle = cpu_seconds_each(pids)
    used = sum(asked[p] - before[p] for p in asked if p in before)
    baseline = sum(idle[p] - asked[p] for p in idle if p in asked)
    return max(0.0, used - baseline) / count


def _screenshot(status: int, path: Path) -> None:
    from .browser import chromium_missing, open_chromium

    missing = chromium_missing()
    if missing is not None:
        print(f"no screenshot: {missing}")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_chromium(1400, 1900) as chrome:
        chrome.get(f"http://127.0.0.1:{status}/")
        time.sleep(4)  # a few snapshots: the event-rate chart has a line
        chrome.save_screenshot(str(path))
        print(f"screenshot: {path}")
        # And a search, as an operator looking for one device would type it.
        from selenium.webdriver.common.by import By

        chrome.set_window_size(1400, 700)
        chrome.find_element(By.ID, "search").send_keys("dev-42")
        time.sleep(1.5)
        searched = path.with_name(path.stem + "-search" + path.suffix)
        chrome.find_element(By.CSS_SELECTOR, "section[aria-label='recent offline']").screenshot(str(searched))
        print(f"screenshot: {searched}")


def report(result: dict[str, Any]) -> str:
    """The figures, as the BENCHMARKS.md table has them."""
    lines = [
        f"devices                {result['devices']:,} on {plural(result['workers'], 'worker')}",
        f"pages                  {result['watchers']} live streams on the first worker's status port, "
        f"phases of {result['phase_s']:.0f} s in turn",
    ]
    for p in result["phases"]:
        counts = p["snapshots_per_watcher"]
        got = (
            f"; snapshots per page {min(counts)}-{max(counts)}, delay p99 {p['delay_p99'] * 1000:.0f} ms"
            if counts
            else ""
        )
        failed = f"; FAILED {p['failed']}" if p["failed"] else ""
        lines.append(
            f"  round {p['round']} {'watched  ' if p['watchers'] else 'unwatched'} server CPU "
            f"{p['cpu_share'] * 100:5.1f} % of a core (the watched worker "
            f"{p['cpu_share_first_worker'] * 100:4.1f} %, the supervisor {p['cpu_share_supervisor'] * 100:4.1f} %)"
            f"{got}{failed}"
        )
    lines += [
        f"server CPU unwatched   {result['cpu_share_unwatched'] * 100:.1f} % of a core (mean of the phases)",
        f"server CPU watched     {result['cpu_share_watched'] * 100:.1f} % of a core",
        f"the pages' cost        {result['page_cost_share'] * 100:+.2f} % of a core "
        f"({result['cpu_share_watched'] / max(result['cpu_share_unwatched'], 1e-9):.3f}x)",
        f"page figures           {result['page_figures']}",
        f"one snapshot           {result['snapshot_cpu_seconds'] * 1000:.2f} ms of server CPU, every process "
        f"together: {result['snapshot_cpu_seconds'] * 100:.2f} % of a core at one a second, however many pages watch",
        f"per presence event     {result['per_event_seconds'] * 1e9:.0f} ns kept for the page (ring and counts)",
        f"device run             {result['device_run']}",
    ]
    return "\n".join(lines)


def parser(prog: str = "python -m loadtest page") -> argparse.ArgumentParser:
    """The command's options."""
    p = command_parser(prog, __doc__)
    p.add_argument("--devices", type=int, default=20_000, help="MQTT devices (default: 20,000)")
    p.add_argument("--keepalive", type=int, default=60, help="their keep-alive, seconds (default: 60)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="connections a second at the start (default: --devices / --keepalive, so that pings come evenly)",
    )
    p.add_argument("--workers", type=int, default=None, help="server workers (default: enough for --devices)")
    p.add_argument("--watchers", type=int, default=10, help="live pages in a watched phase (default: 10)")
    p.add_argument("--phase", type=float, default=12.0, help="seconds a phase lasts (default: 12)")
    p.add_argument("--rounds", type=int, default=3, help="unwatched-then-watched rounds (default: 3)")
    p.add_argument("--screenshot", default="", help="save the page as Chromium shows it to this PNG")
    p.add_argument("--json", default="", help="write the figures to this JSON file too")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run it, print the figures; 0 if every page got its snapshots in time."""
    args = parser().parse_args(argv)
    if args.phase * 2 * args.rounds > args.keepalive * 1.4:
        raise SystemExit("--phase x 2 x --rounds must fit before the silent devices' detection (1.5 x --keepalive)")
    result = run(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    watched = [p for p in result["phases"] if p["watchers"]]
    ok = all(
        not p["failed"] and min(p["snapshots_per_watcher"]) >= args.phase - 2 and p["delay_max"] <= 1.0 for p in watched
    )
    print(f"result                 {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1
