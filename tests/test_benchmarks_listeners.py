"""``python -m benchmarks.listeners`` on a tiny fleet: ours and Mosquitto each serve a
plain, a TLS and a WebSocket listener at once, every device connects and beats on each,
and ours' status port counts each listener's devices as connected; a count that is off
fails the run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.listeners import KINDS, Served, check_figures, main
from loadtest.mqtt_targets import MqttTarget

from .mosquitto_peer import require_mosquitto


@pytest.mark.slow
def test_a_tiny_run_measures_each_listener_on_both_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_mosquitto()
    out = tmp_path / "listeners.json"
    code = main(["--devices", "20", "--keepalive", "1", "--seconds", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0 and report["ok"], printed
    assert printed.rstrip().endswith(f"written                {out}") and "result                 PASS" in printed
    for name in ("idlekeeper", "mosquitto"):
        target = report["targets"][name]
        assert target["devices"] == 60 and not target["problems"], (name, target["problems"])
        assert target["rss_after"] > target["rss_before"] > 1_000_000, name
        assert target["cpu_per_1000_heartbeats"] > 0, name
        assert list(target["listeners"]) == list(KINDS)
        for kind, listener in target["listeners"].items():
            assert listener["connected"] == 20 and listener["open_errors"] == 0, (name, kind)
            assert listener["closed_by_server"] == 0 and listener["unanswered"] == 0, (name, kind)
            # 20 devices beating each second for 3 s, their first beats spread over the first.
            assert 30 <= listener["heartbeats"] <= 90, (name, kind, listener["heartbeats"])
            assert 0 < listener["p50_ms"] <= listener["p99_ms"] <= listener["max_ms"], (name, kind)
            assert 0 < listener["connect_p50_ms"] <= listener["connect_p99_ms"], (name, kind)
        assert target["heartbeats"] == sum(v["heartbeats"] for v in target["listeners"].values())
    # Ours' own figures, read twice, name each listener and count its devices alone.
    ours = report["targets"]["idlekeeper"]
    for when in ("connected", "end"):
        for source in ("metrics", "presence"):
            seen = ours["figures"][when][source]
            assert sorted(name.split(":")[0] for name in seen) == sorted(KINDS), (when, source)
            assert all(f["online"] == 20 and f["refused"] == 0 for f in seen.values()), (when, source, seen)
    ratios = report["ratios_ours_over_mosquitto"]
    assert set(ratios) == {"rss_per_device", "cpu_per_1000_heartbeats"} | {
        f"{kind}_{q}" for kind in KINDS for q in ("p50", "p99")
    }
    assert all(v > 0 for v in ratios.values() if not math.isnan(v))


def test_figures_that_disagree_with_the_devices_are_problems() -> None:
    ports = {"mqtt": 1883, "mqtts": 8883, "ws": 9001}
    served = Served(MqttTarget("idlekeeper", None, 1883), ports, 8080)  # type: ignore[arg-type]
    before = {
        source: {served.listener_name(k): {"online": 0, "accepted": 5, "refused": 0} for k in KINDS}
        for source in ("metrics", "presence")
    }
    right = {
        source: {served.listener_name(k): {"online": 3, "accepted": 8, "refused": 0} for k in KINDS}
        for source in ("metrics", "presence")
    }
    connected = dict.fromkeys(KINDS, 3)
    assert check_figures(served, right, before, connected, "now") == []
    # The TLS device counted on the plain listener (by /metrics), and the WebSocket listener missing from the page.
    wrong = json.loads(json.dumps(right))
    wrong["metrics"]["mqtt://127.0.0.1:1883"]["online"] = 4
    wrong["metrics"]["mqtts://127.0.0.1:8883"]["online"] = 2
    del wrong["presence"]["ws://127.0.0.1:9001"]
    problems = check_figures(served, wrong, before, connected, "now")
    assert len(problems) == 3, problems
    assert "metrics says mqtt://127.0.0.1:1883 has online/accepted/refused 4/3/0, the devices 3/3/0" in problems[0]
    assert "presence has no listener ws://127.0.0.1:9001" in problems[2]


def test_its_options_are_bounded() -> None:
    for bad in (
        ["--devices", "0"],
        ["--devices", "6000"],
        ["--seconds", "0"],
        ["--keepalive", "0"],
        ["--targets", "x"],
    ):
        with pytest.raises(SystemExit):
            main(bad)
