"""The device load tester: how it deals out work and judges results (pure), and a
CI-sized run against the real server: 2,000 devices, some silent, some vanishing,
some reconnecting, and a SIGSTOP stall of the server. Zero false expiries, every
silent device found, never early, within one tick at p99.
"""

from __future__ import annotations

import http.server
import json
import math
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from loadtest.device_results import merge, passed
from loadtest.generator.events import Generator
from loadtest.generator.records import HANDSHAKE as _HANDSHAKE
from loadtest.generator.records import Conn, Device
from loadtest.generator.report import generator_results
from loadtest.generator.spec import GeneratorSpec
from loadtest.sampler import Sample, Sampler, histogram_quantile, parse_metrics
from loadtest.workload import DeviceLoad, Timeline, plan, specs
from servers.prometheus import Families, LiveCollector, open_descriptors, render

ROOT = Path(__file__).resolve().parent.parent


def test_specs_deal_every_device_once_and_the_roles_disjoint(tmp_path: Path) -> None:
    load = DeviceLoad(devices=40_001, silent=0.1, vanish=0.02, reconnect=0.03, per_generator=15_000)
    timeline = plan(load, 3)
    out = specs(load, timeline, 1883, tmp_path)
    assert len(out) == 3
    assert sum(s.count for s in out) == 40_001
    assert all(s.count <= 15_000 for s in out)
    assert len({s.source for s in out}) == 3 and all(s.source.startswith("127.") for s in out)
    assert [s.first for s in out] == [0, 13_334, 26_668]
    for role, share in (("silent", 0.1), ("vanish", 0.02), ("reconnect", 0.03)):
        assert sum(len(getattr(s, role)) for s in out) == round(40_001 * share)
    for s in out:
        locals_ = [i for role in ("silent", "vanish", "reconnect") for i, _ in getattr(s, role)]
        assert len(locals_) == len(set(locals_)), "a device got two roles"
        assert all(0 <= i < s.count for i in locals_)
        times = [t for role in ("silent", "vanish", "reconnect") for _, t in getattr(s, role)]
        assert all(timeline.acts <= t <= timeline.acts + load.keepalive / 2 for t in times)
    assert sum(s.rate for s in out) == load.rate


def test_plan_orders_the_phases() -> None:
    tl = plan(DeviceLoad(devices=1000, keepalive=4, stall=True), 1)
    assert tl.start < tl.acts < tl.detect_by <= (tl.stall or 0) < (tl.stall_end or 0) < tl.end
    assert tl.stall_end is not None and tl.stall is not None and tl.stall_end - tl.stall == 8  # 2 x K
    assert tl.phase(tl.stall + 1) == "server stalled (SIGSTOP)"
    plain = plan(DeviceLoad(devices=1000, keepalive=4), 1)
    assert plain.stall is None and plain.end > plain.detect_by


def _generator(tmp_path: Path) -> Generator:
    spec = GeneratorSpec(
        index=0,
        host="127.0.0.1",
        port=1,
        source="127.0.0.2",
        first=0,
        count=4,
        keepalive=10,
        jitter=0.2,
        rate=1.0,
        max_inflight=1,
        start_at=math.inf,
        end_at=0.0,
        results=str(tmp_path / "r.json"),
        silent=[(1, 100.0)],
    )
    return Generator(spec)


def _closed(d: Device, last_sent: float, closed_at: float, max_gap: float = 9.0) -> None:
    d.connack_at = d.connect_started = 0.0
    d.last_sent, d.closed_at, d.max_gap = last_sent, closed_at, max_gap


def test_results_judge_false_expiries_lateness_and_generator_lag(tmp_path: Path) -> None:
    g = _generator(tmp_path)
    healthy_cut, silent, lagging, fine = g.devices
    _closed(healthy_cut, 100.0, 110.0)  # cut 10 s after a ping, window 15 s: the server's fault
    _closed(silent, 100.0, 115.05)
    silent.acted_at = 105.0
    _closed(lagging, 100.0, 116.0, max_gap=16.0)  # our own ping was 16 s late: not the server's fault
    fine.connack_at = fine.connect_started = 0.0
    r = generator_results(g)
    assert [f["client_id"] for f in r["false_expiries"]] == ["dev-0"]
    assert r["generator_late"] == 1
    assert r["lateness"] == [115.05 - 115.0]
    assert r["undetected"] == 0 and r["connected"] == 4


def test_an_online_device_wakes_its_generator_for_the_server_s_close_not_for_pingresps(tmp_path: Path) -> None:
    """A generator runs thousands of devices; waking for each PINGRESP was half of its
    wake-ups. Online, only the end of the connection is reported, and PINGRESPs are read
    when the device next pings."""
    g = _generator(tmp_path)
    device = g.devices[0]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with server:
        client.setblocking(False)
        conn = Conn(device, client, 0)
        conn.phase = _HANDSHAKE  # CONNECT sent, CONNACK awaited
        device.conn, device.last_sent = conn, time.monotonic()
        g.conns[client.fileno()] = conn
        g.epoll.register(client.fileno(), select.EPOLLIN)
        g.inflight = 1
        server.sendall(b"\x20\x02\x00\x00")  # CONNACK
        assert g.epoll.poll(2.0)
        g.on_readable(conn, time.monotonic())
        assert g.online == 1 and device.timer is not None
        server.sendall(b"\xd0\x00" * 3)  # PINGRESPs: no wake-up
        assert g.epoll.poll(0.2) == []
        g.ping(device)  # reads them, then pings
        assert server.recv(16) == b"\xc0\x00"
        with pytest.raises(BlockingIOError):
            client.recv(16)  # nothing left unread
        server.sendall(b"\xd0\x00")
        server.shutdown(socket.SHUT_WR)  # the server closes: reported at once
        assert [fd for fd, _ in g.epoll.poll(2.0)] == [client.fileno()]
        g.on_readable(conn, time.monotonic())
    assert g.online == 0 and device.conn is None and device.closed_at == device.closed_at
    assert device.timer is None and client.fileno() == -1


def test_a_device_sends_its_connect_with_its_connect_not_a_loop_later(tmp_path: Path) -> None:
    """On loopback the handshake is over when connect() returns: the CONNECT goes then,
    and the device waits for its CONNACK, as a real device does."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        g = _generator(tmp_path)
        g.ports = [listener.getsockname()[1]]
        device = g.devices[0]
        device.connect_started = time.monotonic()
        g.open(device)
        assert device.conn is not None and device.conn.phase == _HANDSHAKE
        server, _ = listener.accept()
        with server:
            server.settimeout(2)
            assert server.recv(64)[:1] == b"\x10"  # CONNECT, with no turn of the loop
        assert g.connect_sent_late == 0 and device.last_sent == device.last_sent


def test_a_connect_the_generator_itself_answered_late_is_counted_as_its_own(tmp_path: Path) -> None:
    """A CONNECT sent over the server's connect timeout after connect() is closed by the
    server unanswered; on loopback only an overloaded generator makes it late."""
    g = _generator(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        socks = [socket.create_connection(listener.getsockname()) for _ in range(2)]
        for sock, device, started in zip(socks, g.devices, (50.0, 40.0), strict=False):
            device.connect_started = started
            conn = Conn(device, sock, 0)
            g.conns[sock.fileno()] = conn
            g.epoll.register(sock.fileno(), select.EPOLLOUT)
            g.on_writable(conn, 60.0)  # 10 s after the first connect(), 20 s after the second
        for sock in socks:
            sock.close()
    r = generator_results(g)
    assert r["connect_sent_late"] == 1 and r["connect_send_max"] == 20.0


def test_steady_state_cost_excludes_a_ramp_that_overran(tmp_path: Path) -> None:
    """CONNECTs cost far more than heartbeats: the steady window opens after the last one."""
    r = generator_results(_generator(tmp_path))
    r["connack_times"] = [float(t) for t in range(80)]  # planned by 60, last CONNACK at 79
    samples, cpu = [], 0.0
    for t in range(101):
        samples.append(Sample(t=float(t), rss=1_000_000, cpu=cpu, fds=10, processes=1))
        cpu += 1.0 if t < 80 else 0.1  # a core while accepting, a tenth after
    progress = [(float(t), {"pings": 10.0 * t, "online": 80.0, "started": 80.0, "detected": 0.0}) for t in range(101)]
    timeline = Timeline(start=0.0, acts=100.0, detect_by=150.0, stall=None, stall_end=None, end=160.0)
    steady = merge(DeviceLoad(devices=80, keepalive=40), timeline, [r], progress, samples, {})["steady"]
    assert steady["cpu_cores"] == pytest.approx(0.1)
    assert steady["heartbeats_per_s"] == pytest.approx(10.0)
    assert steady["window_s"] == pytest.approx(20.0)
    assert steady["ramp_overran_s"] == pytest.approx(19.0)


def test_a_longer_steady_state_is_planned_and_read_whole(tmp_path: Path) -> None:
    """``--steady S``: the devices settle for S seconds (not one keep-alive) before the
    scenarios act, and CPU and heartbeats are read over those S seconds."""
    short = plan(DeviceLoad(devices=1000, keepalive=5), 1)
    long = plan(DeviceLoad(devices=1000, keepalive=5, steady=30), 1)
    assert (long.acts - long.start) - (short.acts - short.start) == pytest.approx(25, abs=0.1)
    assert long.detect_by - long.acts == pytest.approx(short.detect_by - short.acts)
    r = generator_results(_generator(tmp_path))
    r["connack_times"] = [float(t) for t in range(10)]
    samples = [Sample(t=float(t), rss=1_000_000, cpu=0.1 * t, fds=10, processes=1) for t in range(101)]
    progress = [(float(t), {"pings": 10.0 * t, "online": 80.0, "started": 80.0, "detected": 0.0}) for t in range(101)]
    timeline = Timeline(start=0.0, acts=100.0, detect_by=150.0, stall=None, stall_end=None, end=160.0)
    for steady, window in ((0.0, 5.0), (30.0, 30.0), (95.0, 90.0)):  # the last: from the last CONNACK (9) + 1 s
        load = DeviceLoad(devices=80, keepalive=5, steady=steady)
        out = merge(load, timeline, [r], progress, samples, {})["steady"]
        assert out["window_s"] == pytest.approx(window), steady
        assert out["cpu_cores"] == pytest.approx(0.1) and out["heartbeats_per_s"] == pytest.approx(10.0)


def _page(worker: str, reason: str = "idle") -> str:
    """A worker's /metrics page as the servers write it (prometheus-client's exposition)."""
    f = Families({"worker": worker})
    f.gauge("heartbeat_devices_online", "Online.", 7)
    f.histogram("idlekeeper_reaper_lag_seconds", "Lag.", [(0.01, 3), (0.05, 9), (0.1, 10), (math.inf, 10)], 0.2)
    f.counter("idlekeeper_stall_saves_total", "Saves.", 4)
    f.counter_by("idlekeeper_expired_total", "Expired.", "reason", {reason: 5})
    f.gauge("heartbeat_fleet_queued", "Reports waiting for Redis.", 3)
    registry = CollectorRegistry()
    registry.register(LiveCollector(lambda: f.families))
    return render(registry).decode()


def test_metrics_pages_fold_over_workers() -> None:
    one = parse_metrics(_page("0"))
    two = parse_metrics(_page("1"))
    one.add(two)
    assert one.online == 14 and one.stall_saves == 8 and one.lag_count == 20
    assert one.fleet_queued == 6  # what the fleet load test waits to see drained
    assert one.expired == {"idle": 10}
    assert histogram_quantile(one.lag_buckets, 0.5) == 0.05
    assert histogram_quantile(one.lag_buckets, 0.99) == 0.1


def test_metrics_label_values_may_hold_any_character() -> None:
    """A '}', a quote or a newline inside a label value is not the end of the labels
    (the old regex reader stopped at the first '}' and lost the sample)."""
    for worker in ("w}1", 'w"2', "w\n3", "w{}\\4"):
        m = parse_metrics(_page(worker, reason="id}le"))
        assert m.online == 7 and m.stall_saves == 4 and m.lag_count == 10
        assert m.expired == {"id}le": 5}


def test_ci_smoke_run_with_a_stall(tmp_path: Path) -> None:
    """2,000 devices, keep-alive 2 s, 2% silent, 0.5% vanish, 0.5% reconnect, a 4 s SIGSTOP;
    a mixed fleet (20% MQTT 3.1, 40% 3.1.1, 40% 5.0), as real fleets are mid-upgrade: none
    refused or dropped, every silent one found (the 5.0 ones told why), across the stall."""
    out = tmp_path / "devices.json"
    plots = tmp_path / "plots"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "devices",
            *("--devices", "2000", "--keepalive", "2", "--silent", "0.02", "--vanish", "0.005"),
            *("--reconnect", "0.005", "--stall", "--tick", "0.1", "--quiet", "--protocol", "3.1:0.2,5:0.4"),
            *("--json", str(out), "--plots", str(plots)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(out.read_text())
    assert passed(r)
    assert r["connected"] == 2000 and r["connect_failed"] == 0 and r["refused"] == 0
    assert r["protocols"] == {"3.1": 400, "3.1.1": 800, "5.0": 800}
    told = r["disconnects"]  # what the 5.0 devices' DISCONNECTs said, by reason code
    assert told and all(code.startswith(("0x8D", "0x8E")) for code in told), told
    assert r["false_expiries"] == 0, r["false_expiry_examples"]
    assert r["detected"] == r["silent"] == 40
    sv = r["server_view"]
    close = sv["close_lateness_ms"]
    assert close["n"] == 40
    assert close["min"] >= 0  # never early: the server's close, past the device's last send + 1.5 K
    assert close["p99"] <= 100  # one tick
    late = r["lateness_ms"]
    assert late["min"] >= 0  # never early either as the devices saw it
    assert late["max"] <= 1000
    assert sv["vanished_seen"] == {"connection-lost": 10}
    assert r["takeover_ms"]["n"] == 10 and r["takeover_missed"] == 0
    # Stopped for 2 K: every healthy device's deadline (1.5 K after its last ping read)
    # passed while its next pings waited in the kernel, and none was dropped (above).
    # The server spares them by reading first (its engine waits itself while trio is
    # idle, and wakes to its sockets) or, where the reaper looks first, by the stall
    # check (stall saves; tested under MockClock in test_engine and test_sockets).
    assert r["stall"]["to"] - r["stall"]["from"] >= 1.5 * 2 + 0.1 + 0.8
    assert r["steady"]["rss_per_device_bytes"] > 0
    assert sorted(p.name for p in plots.iterdir()) == [
        "devices-idlekeeper-2000-lateness.png",
        "devices-idlekeeper-2000-online.png",
        "devices-idlekeeper-2000-rss.png",
    ]
    assert time.monotonic() - started < 120


def test_demo_entry_point(tmp_path: Path) -> None:
    """``make demo``'s command, small: the report and its own pass/fail."""
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "demo",
            *("--devices", "400", "--keepalive", "1", "--json", str(out), "--plots", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "silent devices found   40 of 40" in done.stdout
    assert "false expiries         0 healthy devices dropped" in done.stdout
    r = json.loads(out.read_text())
    assert r["connected"] == 400 and r["lateness_ms"]["min"] >= 0


def test_timeline_phase_names() -> None:
    tl = Timeline(start=10, acts=20, detect_by=30, stall=None, stall_end=None, end=31)
    assert [tl.phase(t) for t in (5, 15, 25, 30.5, 40)] == [
        "starting",
        "connecting / settling",
        "silencing, detecting",
        "watching for false expiries",
        "finishing",
    ]


def test_a_page_that_is_not_prometheus_text_is_a_missed_round() -> None:
    """A worker whose /metrics answers garbage counts as not having answered; the
    other workers' pages are still read, and nothing raises."""
    pages = {"/good": _page("0").encode(), "/bad": b"this is {not prometheus text\n"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    with pytest.raises(ValueError):
        parse_metrics(pages["/bad"].decode())
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert Sampler(list, [f"{base}/good"]).scrape(timeout=5) is not None
        both = Sampler(list, [f"{base}/good", f"{base}/bad"])
        assert both.scrape(timeout=5) is None  # the bad worker has not answered yet
        assert f"{base}/good" in both._pages and f"{base}/bad" not in both._pages
    finally:
        server.shutdown()
        server.server_close()


def test_the_sampler_counts_a_process_s_descriptors_without_listing_them() -> None:
    """Open files are read from the size of /proc/PID/fd: listing 29 workers' 17,000
    sockets every second had cost the load tester 63% of a core beside the server."""
    code = (
        "import os, time\n"
        "fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(300)]\n"
        "print(1, flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"
        listed = len(os.listdir(f"/proc/{child.pid}/fd"))
        assert listed > 300
        assert open_descriptors(child.pid) == listed
        sample = Sampler(lambda: [child.pid]).take()
        assert sample.fds == listed and sample.processes == 1
    finally:
        child.kill()
        child.wait()
    with pytest.raises(OSError):
        open_descriptors(child.pid)  # gone
    # A process that is gone is skipped, not an error.
    assert Sampler(lambda: [child.pid]).take().processes == 0
