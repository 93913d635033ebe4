"""``python -m benchmarks.heap_per_connection`` measures each kind of connection it serves."""

from __future__ import annotations

import re

import pytest

from benchmarks.heap_per_connection import main


@pytest.mark.slow
def test_each_kind_is_measured_and_broken_down(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--connections", "40", "--top", "3"]) == 0
    out = capsys.readouterr().out
    totals = {
        kind: int(size.replace(",", ""))
        for kind, size in re.findall(r"^(\S+) on dense: ([\d,]+) B of Python heap per idle connection", out, re.M)
    }
    assert set(totals) == {"asgi-ws", "mqtt-ws", "mqtt-tcp"}, out
    # An ASGI WebSocket holds its app's task; a WebSocket device holds a frame layer a TCP one has not.
    assert totals["asgi-ws"] > totals["mqtt-ws"] > totals["mqtt-tcp"] > 0, totals
    assert "wsproto's frame layer" in out and "the ASGI scope" in out
