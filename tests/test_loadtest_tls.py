"""``python -m loadtest tls``, tiny: the report holds every figure for our server and,
when it is installed, Mosquitto, with the ratios between them. Wall clock, a few seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest import tls_load
from loadtest.__main__ import main
from loadtest.mqtt_targets import mosquitto_binary


def test_report_ratios_are_each_of_ours_over_mosquitto() -> None:
    load = tls_load.TlsLoad(connections=10, seconds=1)
    dense = tls_load.TlsResult(
        "idlekeeper", connections=10, rss_per_connection=8192, handshakes_per_s=500, handshake_cpu_ms=2.4
    )
    streams = tls_load.TlsResult(
        "idlekeeper-streams", connections=10, rss_per_connection=12288, handshakes_per_s=400, handshake_cpu_ms=3.2
    )
    theirs = tls_load.TlsResult(
        "mosquitto", connections=10, rss_per_connection=4096, handshakes_per_s=2000, handshake_cpu_ms=0.8
    )
    table = tls_load.report({"idlekeeper": dense, "idlekeeper-streams": streams, "mosquitto": theirs}, load)
    assert "| ours / Mosquitto | idlekeeper | idlekeeper-streams |" in table
    assert "| RSS per idle TLS connection | 2.00x | 3.00x |" in table
    assert "| full handshakes/s | 0.25x | 0.20x |" in table
    assert "| server CPU per handshake | 3.00x | 4.00x |" in table
    assert "| MQTT connects/s over TLS | - | - |" in table  # not measured: no ratio invented


def test_load_is_bounded() -> None:
    with pytest.raises(ValueError):
        tls_load.TlsLoad(connections=100_000)
    with pytest.raises(ValueError):
        tls_load.TlsLoad(seconds=3600)


def test_tls_command_measures_both_side_by_side(tmp_path: Path) -> None:
    targets = "idlekeeper,mosquitto" if mosquitto_binary() is not None else "idlekeeper"
    out = tmp_path / "tls.json"
    code = main(["tls", "--connections", "30", "--seconds", "1", "--targets", targets, "--json", str(out), "--quiet"])
    assert code == 0
    data = json.loads(out.read_text())
    for name in targets.split(","):
        run = data["runs"][name]
        assert run["connections"] == 30 and run["open_errors"] == 0
        assert run["rss_after"] > 0 and math.isfinite(run["rss_per_connection"])
        assert run["connects_per_s"] > 0 and run["connect_errors"] == 0
        assert run["handshakes_per_s"] > 0  # openssl s_time ran against its TLS port
    table = out.with_suffix(".md").read_text()
    assert "| idlekeeper | 30 |" in table
    if "mosquitto" in targets:
        assert "| ours / Mosquitto | idlekeeper |" in table
