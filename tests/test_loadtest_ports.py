"""``free_port``: the ports handed to servers the tests start.

A port picked by binding to 0 lies in the kernel's ephemeral range, and any outgoing
connection (a test suite makes thousands, on two xdist workers at once) may take it as
its source port before the server binds it: the server then refuses to start. These
tests pin what ``free_port`` does instead.
"""

from __future__ import annotations

import importlib
import itertools
import socket
from collections.abc import Iterator
from types import ModuleType

import pytest

from loadtest import processes


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def _reloaded(monkeypatch: pytest.MonkeyPatch, worker: str | None, count: str | None) -> ModuleType:
    for name, value in (("PYTEST_XDIST_WORKER", worker), ("PYTEST_XDIST_WORKER_COUNT", count)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return importlib.reload(processes)


@pytest.fixture(autouse=True)
def _restore_module() -> Iterator[None]:
    yield
    importlib.reload(processes)  # back to this worker's own slice


def test_ports_lie_below_the_ephemeral_range_and_do_not_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _reloaded(monkeypatch, None, None)
    ports = [module.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < _ephemeral_low() for p in ports), ports


def test_side_by_side_workers_take_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    slices = []
    for worker in range(3):
        module = _reloaded(monkeypatch, f"gw{worker}", "3")
        slices.append(module._PORTS)
        port = module.free_port()
        assert port in slices[-1]
    for a, b in itertools.pairwise(slices):
        assert a.stop <= b.start, (a, b)
    assert all(len(s) > 3000 for s in slices)


def test_a_run_is_consecutive_and_every_port_of_it_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _reloaded(monkeypatch, None, None)
    first = module.free_port(run=4)
    held = []
    try:
        for port in range(first, first + 4):
            s = socket.socket()
            s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: the strictest bind a peer may do
            held.append(s)
    finally:
        for s in held:
            s.close()


def test_a_port_some_socket_holds_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _reloaded(monkeypatch, None, None)
    upcoming = module._PORTS[module._next_port[0] % len(module._PORTS)]
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", upcoming))
    except OSError:
        pytest.skip(f"port {upcoming} is already held by something else")
    try:
        port = module.free_port()
        assert port != upcoming
    finally:
        holder.close()
