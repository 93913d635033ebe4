"""The wake-up benchmark, CI-sized: every heartbeat answered with and without coalescing,
and figures that are figures (the speed itself is measured by the benchmark, not here)."""

from __future__ import annotations

import signal
import socket

from benchmarks.wakeups import ROOT, measure_server, wakeup_floor
from loadtest.processes import free_port, start_server
from servers.heartbeat.mqtt import encoders


def test_the_wakeup_floor_is_measured_for_both_loops() -> None:
    floor = wakeup_floor(rate=50, seconds=0.5)
    assert floor["epoll_us_per_wakeup"] > 0 and floor["trio_us_per_wakeup"] > 0


def test_the_python_floor_answers_like_a_broker_and_stops_on_sigterm() -> None:
    """The floor row's server: CONNACK, then a PINGRESP per PINGREQ, and a clean exit on
    SIGTERM (which benchmarks.instructions needs, to read callgrind's totals)."""
    port = free_port()
    proc = start_server("ping_floor", port, 1, module="benchmarks.ping_floor", cwd=str(ROOT))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(encoders.encode_connect("floor-1", keep_alive=60))
            assert sock.recv(4) == encoders.encode_connack(False, 0)
            for _ in range(3):
                sock.sendall(encoders.encode_pingreq())
                assert sock.recv(2) == encoders.encode_pingresp()
    finally:
        proc.send_signal(signal.SIGTERM)  # by PID
        code = proc.wait(timeout=10)
    assert code == 0


def test_a_row_splits_a_heartbeats_cpu_into_user_and_kernel_time() -> None:
    row = measure_server(devices=20, rate=40, seconds=0.5, coalesce=None, floor=True)
    assert row["answered"] == 1.0 and row["coalesce"] == -2.0
    assert row["user_us"] >= 0 and row["kernel_us"] >= 0
    # The split is read in 10 ms clock ticks, the total from the scheduler's clock: they
    # agree within a few ticks' worth a heartbeat (a split in the wrong unit would not).
    per_heartbeat = row["cpu_pct_per_1k"] * 10  # µs
    tick = 10_000 / (row["heartbeats_per_s"] * 0.5)  # µs a heartbeat, of one tick in this window
    assert abs(row["user_us"] + row["kernel_us"] - per_heartbeat) <= 3 * tick
