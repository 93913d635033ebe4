"""loadtest.partition's island: each way of cutting a link loses packets both ways
without a word to either end (no refusal, no unreachable error: a connect just
waits), and a heal carries them again."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from loadtest.partition import Island, partitions_possible

why_not = partitions_possible()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no partitions here: {why_not}")

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except TimeoutError:
    print("timed out")
except OSError as exc:
    print(f"error {exc.errno}")
"""


@pytest.fixture
def place() -> Iterator[Island]:
    island = Island()
    try:
        island.make()
        yield island
    finally:
        island.remove()


def from_island(place: Island, port: int, timeout: float = 1.0) -> str:
    """What a connect from inside the island to the host's backend address came to."""
    command = [*place.prefix, sys.executable, "-c", CONNECT, place.host_backend, str(port), str(timeout)]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def link_up(device: str) -> bool:
    shown = subprocess.run(["ip", "-o", "link", "show", device], capture_output=True, text=True, check=True).stdout
    return ",UP" in shown or "<UP" in shown


@pytest.mark.parametrize("how", ["drop", "down"])
def test_a_cut_link_loses_packets_silently_and_a_heal_carries_them_again(place: Island, how: str) -> None:
    with socket.create_server((place.host_backend, 0)) as listener:
        port = listener.getsockname()[1]
        assert from_island(place, port) == "connected"
        place.cut("backend", how)
        assert link_up(place.links["backend"][0]) == (how == "drop")  # "drop" leaves both ends up
        assert from_island(place, port) == "timed out"  # no RST, no ICMP: the SYN is lost
        with pytest.raises(RuntimeError, match="cut already"):
            place.cut("backend", how)
        place.heal("backend")
        assert from_island(place, port, timeout=5.0) == "connected"
        assert place.cut_how == {}


def test_a_cut_is_one_of_two_ways(place: Island) -> None:
    with pytest.raises(ValueError, match="'drop' or 'down'"):
        place.cut("backend", "unplug")
    assert place.cut_how == {}
