"""The HTTP load tester against servers.http: slowloris attackers are cut at the
header deadline (never before it), slow readers at the send timeout, and legitimate
keep-alive load is served throughout. On the wall clock, a few seconds each."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import psutil
import pytest

from loadtest.asgi_app import BODY, app
from loadtest.http import attack
from loadtest.http.load import run_http
from loadtest.http.loadgen import run_load, run_own_client
from loadtest.http.targets import start_http_target
from loadtest.http.workload import HttpLoad, LoadFigures
from loadtest.processes import free_port, stop
from servers.http.server import TIMEOUT_LINGER

HEADER_TIMEOUT = 1.0
TICK = 0.05


@pytest.fixture
def started() -> Iterator[tuple[int, int]]:
    port = free_port()
    proc = start_http_target("idlekeeper", port, header_timeout=HEADER_TIMEOUT, keep_alive=5.0, tick=TICK)
    yield port, proc.pid
    stop(proc)


@pytest.fixture
def server(started: tuple[int, int]) -> int:
    return started[0]


def test_slowloris_is_cut_at_the_header_deadline(server: int) -> None:
    """Each attacker trickles a header line every 0.2 s; the 408 and the close come
    at the deadline from its first byte, however many lines it sent."""
    socks = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        sock.setblocking(False)
        socks.append((sock, time.monotonic()))
    cut: dict[int, float] = {}
    replies: dict[int, bytes] = {}
    n = 0
    end = time.monotonic() + HEADER_TIMEOUT + 3
    while len(cut) < len(socks) and time.monotonic() < end:
        n += 1
        for i, (sock, _) in enumerate(socks):
            if i in cut:
                continue
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                with contextlib.suppress(OSError):
                    sock.send(b"X-Trickle-%d: y\r\n" % n)
                continue
            except OSError:
                data = b""
            replies[i] = replies.get(i, b"") + data
            if b"\r\n\r\n" in replies[i] or not data:
                cut[i] = time.monotonic()
        time.sleep(0.02 if n % 10 else 0.2)
    for sock, _ in socks:
        sock.close()
    assert len(cut) == 20, "an attacker was never cut"
    for i, (_, started) in enumerate(socks):
        held = cut[i] - started
        assert held >= HEADER_TIMEOUT, f"cut early, after {held:.3f} s"
        assert held <= HEADER_TIMEOUT + TICK + 0.4, f"cut late, after {held:.3f} s"
        assert replies[i].startswith(b"HTTP/1.1 408 ")


def test_http_load_run_under_attack(started: tuple[int, int]) -> None:
    """The tool's own run: load alone, then under slowloris and slow readers, then hold times."""
    r = run_http(
        "idlekeeper",
        HttpLoad(connections=10, duration=2.0, slowloris=30, slow_readers=3, header_timeout=HEADER_TIMEOUT),
        port=started[0],
        pids=[started[1]],
        tool="own",
        window=6.0,
        idle=300,
    )
    assert r.alone is not None and r.attacked is not None
    assert r.alone.requests > 100 and r.alone.errors == 0
    assert r.attacked.requests > 100 and r.attacked.errors == 0  # served during the attack
    assert r.attackers_connected == 33
    assert r.slowloris_still_held == 0 and r.slow_readers_still_held == 0
    assert r.idle_connections == 300 and 0 < r.idle_rss_per_conn < 64 * 1024
    # Held from connect to the server's release: the header deadline, at most a tick,
    # the short linger after the 408, and the tool's 0.2 s polling.
    assert all(HEADER_TIMEOUT <= h <= HEADER_TIMEOUT + TICK + TIMEOUT_LINGER + 0.5 for h in r.slowloris_hold_s)
    assert all(h <= HEADER_TIMEOUT + 3.0 for h in r.slow_reader_hold_s)  # the send timeout is the header timeout


@pytest.mark.skipif(
    shutil.which("wrk") is None and os.environ.get("CI") != "true",
    reason="wrk is not installed (apt-get install wrk; .ci/run installs it in CI)",
)
def test_wrk_figures_are_parsed(server: int) -> None:
    from loadtest.http.loadgen import run_wrk

    f = run_wrk(server, 10, 1.0)
    assert f.tool == "wrk" and f.requests > 100 and f.rps > 100 and f.errors == 0
    assert 0 < f.p50_ms <= f.p99_ms


def test_own_client_counts_responses(server: int) -> None:
    f: LoadFigures = run_own_client(server, 4, 1.0)
    assert f.requests > 50 and f.errors == 0 and f.p50_ms > 0


def test_a_loads_cpu_a_request_is_what_the_server_spent_in_user_space_and_the_kernel(
    started: tuple[int, int],
) -> None:
    """Given the server's PID, a load run says what a request cost it, user and kernel
    apart: times the requests, the CPU the server's process used meanwhile (psutil's
    clock ticks are 10 ms). Without PIDs it says nothing rather than a guess."""
    port, pid = started
    proc = psutil.Process(pid)
    before = proc.cpu_times()
    f = run_load(port, 4, 1.0, tool="own", pids=[pid])
    after = proc.cpu_times()
    assert f.requests > 50 and f.user_us > 0 and f.kernel_us > 0
    for per_request, spent in ((f.user_us, after.user - before.user), (f.kernel_us, after.system - before.system)):
        assert per_request * f.requests / 1e6 == pytest.approx(spent, abs=0.025)
    blind = run_load(port, 4, 0.5, tool="own")
    assert blind.requests > 20 and math.isnan(blind.user_us) and math.isnan(blind.kernel_us)


def test_asgi_app_answers_like_ours() -> None:
    import trio

    sent: list[MutableMapping[str, Any]] = []

    async def main() -> None:
        messages = iter([{"type": "http.request", "body": b"", "more_body": False}])

        async def receive() -> dict[str, object]:
            return next(messages)

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        await app({"type": "http"}, receive, send)

    trio.run(main)
    assert sent[0]["status"] == 200 and sent[1]["body"] == BODY


def test_the_median_round_is_a_measured_one() -> None:
    from loadtest.http.loadgen import median_round

    rounds = [
        LoadFigures("wrk", n, rps, 1.0, p99, 0) for n, rps, p99 in ((1, 900.0, 9.0), (2, 500.0, 5.0), (3, 700.0, 7.0))
    ]
    assert median_round(rounds) is rounds[2]
    assert median_round(rounds[:2]) is rounds[1]  # even count: the lower middle
    with pytest.raises(ValueError):
        median_round([])


def test_the_server_and_its_load_are_pinned_apart() -> None:
    import os
    import subprocess
    import sys

    from loadtest.processes import load_side, pin, split_cpus

    split = split_cpus()
    if split is None:
        pytest.skip("one CPU: nothing to split")
    assert split.server and split.load and not split.server & split.load
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pin([child.pid], split.server)
        assert os.sched_getaffinity(child.pid) == split.server
    finally:
        stop(child, timeout=1)
    before = os.sched_getaffinity(0)
    with load_side(split):
        assert os.sched_getaffinity(0) == split.load
    assert os.sched_getaffinity(0) == before


def test_compare_loads_every_server_in_interleaved_rounds() -> None:
    from loadtest.compare import compare_http
    from loadtest.processes import split_cpus

    load = HttpLoad(connections=4, duration=1.0, slowloris=5, slow_readers=1, header_timeout=HEADER_TIMEOUT)
    out = compare_http(load, ["idlekeeper", "idlekeeper-native"], rounds=2)
    assert set(out["runs"]) == {"idlekeeper", "idlekeeper-native"} and not out["missing"]
    for r in out["runs"].values():
        assert len(r["alone_rounds"]) == 2 and all(f["requests"] > 50 for f in r["alone_rounds"])
        assert r["rps"] == min(f["rps"] for f in r["alone_rounds"])  # the lower middle of two
        assert r["slowloris_still_held"] == 0 and r["attacked"]["requests"] > 50
        # What a request cost the server, from the median round's own measurement.
        assert r["cpu_us"] == r["alone"]["user_us"] + r["alone"]["kernel_us"] > 0
        assert bool(r["cpus"]) == (split_cpus() is not None)
        # The attacked load sits between two unattacked loads of its own.
        assert len(r["beside"]) == 2 and all(f["requests"] > 50 for f in r["beside"])
        assert r["rps_beside"] == pytest.approx(sum(f["rps"] for f in r["beside"]) / 2)


@pytest.mark.parametrize("target", ["idlekeeper", "idlekeeper-native", "uvicorn-standard", "granian", "hypercorn"])
def test_every_peer_row_serves_the_same_answer_on_its_own_implementation(target: str) -> None:
    """Each HTTP row starts as its users run it and answers ``/`` with the same bytes."""
    port = free_port()
    proc = start_http_target(target, port, header_timeout=HEADER_TIMEOUT, keep_alive=5.0, tick=TICK)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert body == BODY
        if target == "granian":
            cmdline = " ".join(psutil.Process(proc.pid).cmdline())
            assert "--interface asgi" in cmdline and "--http1-header-read-timeout 1000" in cmdline
    finally:
        stop(proc)


def test_the_attack_watcher_reads_the_socket_tables_as_psutil_does(started: tuple[int, int]) -> None:
    """The watcher asks sock_diag (not psutil, which was too dear on the load's core):
    the same held set as psutil's, a closed connection leaves it, and /proc's text
    table, the fallback, says the same."""
    port, pid = started
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        time.sleep(0.3)

        def by_psutil() -> set[tuple[str, int]]:
            conns = psutil.Process(pid).net_connections(kind="tcp")
            return {(c.raddr[0], c.raddr[1]) for c in conns if c.laddr and c.laddr[1] == port and c.raddr}

        mine = {s.getsockname()[:2] for s in socks}
        assert attack.held_by_server([pid], port) == by_psutil() == mine
        assert attack.held_by_server([], port) == mine  # any process's
        assert attack.waiting_in_kernel(port) == mine
        assert sorted(attack._diag_rows(port)) == sorted(attack._proc_rows(port))
        gone = socks.pop()
        gone_addr = gone.getsockname()[:2]
        gone.close()
        deadline = time.monotonic() + 5
        while gone_addr in attack.held_by_server([pid], port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert attack.held_by_server([pid], port) == by_psutil() == mine - {gone_addr}
    finally:
        for s in socks:
            s.close()
