"""``python -m loadtest scorecard``: each target judged from its part's figures, on its
side of its line, with the conditions beside the ratio; a real TLS round at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from loadtest.__main__ import main
from loadtest.mqtt_targets import mosquitto_binary
from loadtest.scorecard import GOALS, Workloads, judge, render, run_round
from loadtest.tls_load import TlsLoad


def _device(rss: float, cpu: float, p99_ms: float = 50.0, false_expiries: float = 0.0) -> dict[str, float]:
    return {
        "rss_per_conn_bytes": rss,
        "cpu_pct_per_1k_hbps": cpu,
        "lateness_p99_ms": p99_ms,
        "false_expiries": false_expiries,
    }


def _qos(msgs: float, drain: float, lost: float = 0.0, queued_lost: float = 0.0) -> dict[str, float]:
    return {
        "msgs_per_s": msgs,
        "lost": lost,
        "duplicates": 0.0,
        "out_of_order": 0.0,
        "drain_msgs_per_s": drain,
        "queued_lost": queued_lost,
        "queued_out_of_order": 0.0,
    }


def a_round(**changes: Any) -> dict[str, Any]:
    """A round of every part: ours at 1,100 B a device against 738, and so on."""
    r: dict[str, Any] = {
        "mqtt": {
            "rows": {
                "idlekeeper": _device(1100, 5.0),
                "idlekeeper-pings": _device(1120, 3.6),
                "mosquitto": _device(738, 4.0),
            },
            "runs": {name: {"tick_s": 0.1} for name in ("idlekeeper", "idlekeeper-pings", "mosquitto")},
            "missing": {},
        },
        "qos": {
            "rows": {"idlekeeper": _qos(30_000, 80_000), "mosquitto": _qos(20_000, 200_000)},
            "runs": {},
            "missing": {},
        },
        "http": {
            "rows": {"idlekeeper": {"rps": 24_000}, "uvicorn-standard": {"rps": 20_000}, "granian": {"rps": 25_000}},
            "runs": {
                "idlekeeper": {
                    "alone": {"rps": 24_000, "p99_ms": 10.0, "errors": 0},
                    "attacked": {"rps": 21_600, "p99_ms": 25.0, "errors": 0},
                }
            },
            "missing": {},
        },
        "tls": {
            "runs": {"idlekeeper": {"handshake_cpu_ms": 1.2}, "mosquitto": {"handshake_cpu_ms": 1.0}},
            "missing": {},
        },
    }
    for path, value in changes.items():
        *keys, last = path.split("__")
        node = r
        for key in keys:
            node = node[key]
        node[last] = value
    return r


def test_each_target_is_a_ratio_of_ours_judged_on_its_side_of_the_line() -> None:
    got = judge(a_round())
    assert set(got) == {g.key for g in GOALS}
    expected = {
        "http_uvicorn": (1.2, True),
        "http_granian": (0.96, False),
        "http_attack_p99": (2.5, False),
        "http_attack_kept": (0.9, True),
        "mqtt_memory": (1100 / 738, False),
        "mqtt_cpu": (1.25, False),
        "mqtt_cpu_pings": (0.9, True),
        "qos_forwarding": (1.5, True),
        "qos_drain": (0.4, False),
        "tls_handshake": (1.2, True),
    }
    for key, (ratio, met) in expected.items():
        assert got[key].ratio == pytest.approx(ratio), key
        assert got[key].met is met, key
        assert got[key].why == "", key


def test_a_condition_beside_the_ratio_fails_a_target_whose_ratio_is_met() -> None:
    r = a_round(
        mqtt__rows__idlekeeper=_device(700, 3.0, p99_ms=140.0),
        qos__rows__idlekeeper=_qos(30_000, 150_000, lost=3, queued_lost=1),
    )
    r["http"]["runs"]["idlekeeper"]["attacked"]["errors"] = 7
    got = judge(r)
    assert got["mqtt_memory"].met  # lateness is the CPU target's condition, not memory's
    assert not got["mqtt_cpu"].met and got["mqtt_cpu"].ratio == pytest.approx(0.75)
    assert "lateness p99 140 ms, past the 100 ms tick" in got["mqtt_cpu"].why
    assert not got["qos_forwarding"].met and got["qos_forwarding"].why == "3 lost"
    assert not got["qos_drain"].met and got["qos_drain"].why == "1 lost from the queue"
    assert not got["http_attack_kept"].met and got["http_attack_kept"].why == "7 errors under attack"
    # Mosquitto's own losses and reordering are said beside its rate, and fail nothing.
    theirs = _qos(20_000, 200_000, lost=34)
    theirs["out_of_order"] = 386_673
    got = judge(a_round(qos__rows__mosquitto=theirs))
    assert got["qos_forwarding"].met and got["qos_forwarding"].why == "Mosquitto 34 lost, 386673 out of order"
    # False expiries fail it too.
    got = judge(a_round(**{"mqtt__rows__idlekeeper-pings": _device(1120, 3.0, false_expiries=2)}))
    assert not got["mqtt_cpu_pings"].met and got["mqtt_cpu_pings"].why == "2 false expiries"


def test_the_attack_is_judged_against_the_loads_beside_it_when_there_are_any() -> None:
    r = a_round()
    ours = r["http"]["runs"]["idlekeeper"]
    # The interleaved median (24,000) is minutes old; the loads beside the attack ran
    # at 22,000 req/s with a p99 of 12.5 ms.
    ours.update(rps_beside=22_000.0, p99_ms_beside=12.5)
    got = judge(r)
    assert got["http_attack_kept"].ratio == pytest.approx(21_600 / 22_000)
    assert got["http_attack_kept"].met
    assert got["http_attack_p99"].ratio == pytest.approx(2.0) and got["http_attack_p99"].met
    # Not measured beside (NaN, as a run without them writes): the median again.
    ours.update(rps_beside=float("nan"), p99_ms_beside=float("nan"))
    assert judge(r)["http_attack_kept"].ratio == pytest.approx(0.9)


def test_a_peer_that_did_not_run_leaves_its_targets_not_measured_never_met() -> None:
    r = a_round()
    del r["mqtt"]["rows"]["mosquitto"]
    r["mqtt"]["missing"]["mosquitto"] = "mosquitto is not installed"
    del r["http"]["rows"]["granian"]
    got = judge(r)
    for key in ("mqtt_memory", "mqtt_cpu", "mqtt_cpu_pings"):
        assert math.isnan(got[key].ratio) and not got[key].met
        assert got[key].why == "mosquitto: mosquitto is not installed"
    assert not got["http_granian"].met and got["http_granian"].why == "granian: did not run"
    assert got["http_uvicorn"].met  # the other peer's figure stands


def test_the_table_gives_every_rounds_ratio_their_median_and_how_many_met() -> None:
    rounds = [
        a_round(**{"http__rows__granian": {"rps": 20_000}}),  # 1.20x: met
        a_round(),  # 0.96x
        a_round(**{"http__rows__granian": {"rps": 23_000}}),  # 1.04x: met
    ]
    text = render(rounds)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["HTTP req/s, against granian"].endswith("| 1.20× | 0.96× ✗ | 1.04× | 1.04× | met in 2 of 3 |")
    assert rows["HTTP req/s, against uvicorn[standard]"].endswith("| 1.20× | met |")
    assert rows["stored-queue drain msg/s, against Mosquitto"].endswith("| 0.40× | not met |")
    assert rows["CPU per TLS handshake, against Mosquitto"].startswith(
        "| CPU per TLS handshake, against Mosquitto | ≤ 1.5× |"
    )
    # Only the parts that ran have rows.
    assert "QoS 1" not in render([{"tls": rounds[0]["tls"]}])


def test_the_command_renders_an_earlier_run_and_refuses_an_unknown_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "scorecard.json"
    saved.write_text(json.dumps({"parts": ["tls"], "rounds": [a_round(tls__runs__idlekeeper={"handshake_cpu_ms": 2})]}))
    assert main(["scorecard", "--render", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "| CPU per TLS handshake, against Mosquitto | ≤ 1.5× | 2.00× ✗ | 2.00× | not met |" in out
    with pytest.raises(SystemExit) as exc:
        main(["scorecard", "--only", "tls,disk"])
    assert exc.value.code == 2
    assert "--only: disk is not one of mqtt, qos, http, tls" in capsys.readouterr().err


def test_a_tls_round_against_real_servers_is_judged() -> None:
    """A small real round: our server and Mosquitto (when installed) each take full TLS
    handshakes from ``openssl s_time``; the target is their CPU per handshake."""
    r = run_round(["tls"], Workloads(tls=TlsLoad(connections=20, seconds=1, concurrency=1)), quiet=True)
    ours = r["tls"]["runs"]["idlekeeper"]
    assert ours["connections"] == 20 and ours["open_errors"] == 0 and ours["handshake_cpu_ms"] > 0
    got = judge(r)["tls_handshake"]
    if mosquitto_binary() is None:
        assert math.isnan(got.ratio) and got.why.startswith("mosquitto: ")
    else:
        theirs = r["tls"]["runs"]["mosquitto"]["handshake_cpu_ms"]
        assert got.ratio == pytest.approx(ours["handshake_cpu_ms"] / theirs)
        assert got.met is (got.ratio <= 1.5)


def test_the_scoreboard_keeps_each_targets_latest_reading(tmp_path: Path) -> None:
    from loadtest import scoreboard

    board = tmp_path / "performance.md"
    first = [judge(a_round()), judge(a_round(http__rows__granian={"rps": 20_000}))]
    scoreboard.update(board, GOALS, first, command="python -m loadtest scorecard --rounds 2", where="M-one")
    page = board.read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in page.splitlines() if line.startswith("| ")}
    # The median of the rounds (0.96 and 1.20), met in one of two, with its peer and machine.
    assert "| 1.08× | 1 of 2 rounds | granian " in rows["HTTP req/s, against granian"]
    assert rows["HTTP req/s, against granian"].endswith("| M1 |")
    assert "- M1: M-one" in page and "python -m loadtest scorecard --rounds 2" in page
    # A later run of one part updates its targets and keeps the others.
    later = [judge({"tls": a_round(tls__runs__idlekeeper={"handshake_cpu_ms": 2})["tls"]})]
    scoreboard.update(board, GOALS, later, command="python -m loadtest scorecard --only tls", where="M-two")
    page = board.read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in page.splitlines() if line.startswith("| ")}
    assert "| 2.00× | none of 1 round |" in rows["CPU per TLS handshake, against Mosquitto"]
    assert rows["CPU per TLS handshake, against Mosquitto"].endswith("| M2 |")
    assert "| 1.08× | 1 of 2 rounds |" in rows["HTTP req/s, against granian"]  # kept
    record = json.loads(board.with_suffix(".json").read_text())
    assert set(record["targets"]) >= {"http_granian", "tls_handshake"}
    # A target no run has measured says so.
    empty = scoreboard.render({"targets": {}}, GOALS)
    assert empty.count("not measured yet") == len(GOALS)


def test_the_scoreboards_command_leaves_out_where_the_results_went() -> None:
    from loadtest.scoreboard import measured_by

    run = ["--only", "mqtt,qos", "--quiet", "--out", "/tmp/x/run.json", "--board=docs/p.md", "--rounds", "2"]
    assert measured_by(run) == "python -m loadtest scorecard --only mqtt,qos --rounds 2"
    assert measured_by([]) == "python -m loadtest scorecard"
