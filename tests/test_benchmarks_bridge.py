"""``python -m benchmarks.bridge`` small: this server's bridge and Mosquitto's side by
side on loopback (throughput, a stopped remote, a remote restarted under load); every
figure is there and this server's bridge lost nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bridge.__main__ import main

from .mosquitto_peer import require_mosquitto


@pytest.mark.slow
def test_the_bridge_benchmark_reports_every_figure_and_ours_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_mosquitto()
    out = tmp_path / "bridge.json"
    argv = ["--qos0", "500", "--qos1", "500", "--keepalive", "5", "--restart-messages", "300"]
    assert main([*argv, "--restart-rate", "200", "--timeout", "30", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for kind in ("ours", "mosquitto"):
        for qos in ("qos0", "qos1"):
            assert figures["throughput"][kind][qos]["rate"] > 0, figures
        assert figures["stopped_remote"][kind]["noticed_s"] is not None, figures
        assert figures["stopped_remote"][kind]["serving_again_s"] is not None, figures
        assert figures["restart"][kind]["published"] == 300, figures
    ours = figures["throughput"]["ours"]
    assert (ours["qos0"]["lost"], ours["qos1"]["lost"], figures["restart"]["ours"]["lost"]) == (0, 0, 0)
    stopped = figures["stopped_remote"]["ours"]
    # Noticed once a keep-alive passed without an answer, within one and a half.
    assert 5 - 0.5 < stopped["noticed_s"] <= 1.5 * 5 + 1, stopped
    assert stopped["notification_0_s"] is not None, stopped
    assert "ours/mosq" in capsys.readouterr().out
