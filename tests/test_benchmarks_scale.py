"""The scale benchmark's parts, CI-sized: shapes parsed and refused, keep-alives that
outlast a round of heartbeats, and the kernel's cost per ready socket measured."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.scale import cold_touch, keepalive_for, parse_shape


def test_a_shape_is_devices_by_rate() -> None:
    assert parse_shape("17000x72") == (17_000, 72.0)
    assert parse_shape("10x0.5") == (10, 0.5)
    for bad in ("17000", "x72", "0x5", "10x0", "10x-1", "ax1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_shape(bad)


def test_no_device_can_expire_while_the_shape_runs() -> None:
    for devices, rate in ((17_000, 72.0), (10_000, 1000.0), (50, 20.0), (500_000, 1.0), (7, 3.0)):
        keepalive = keepalive_for(devices, rate)
        # Every device pings once per devices / rate seconds; the broker allows 1.5 x K.
        assert keepalive >= 30 and keepalive >= devices / rate + 30


def test_the_kernel_s_cost_per_ready_socket_is_measured_for_each_pause() -> None:
    out = cold_touch(sockets=20, ready=5, sleeps=(0.001, 0.002), rounds=3)
    assert set(out) == {0.001, 0.002}
    assert all(0 < us < 1e6 for us in out.values())
