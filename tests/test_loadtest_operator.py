"""The load tester as an operator meets it (issue 61): options spelled out in full,
``--version`` on every command, one line naming the missing extra, a progress clock that
never runs negative, and reports with no ``nan`` and no "1 workers"."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import loadtest.__main__ as entry
from loadtest import devices
from loadtest.__main__ import COMMANDS, main
from loadtest.fleet.results import report as fleet_report
from loadtest.http import targets
from loadtest.http.targets import start_http_target
from loadtest.http.workload import HttpResult
from loadtest.live import run_progress
from loadtest.mqtt_targets import PeerUnavailable
from loadtest.workload import DeviceLoad, Timeline, plan
from servers.extras import EXTRAS, version

ROOT = Path(__file__).resolve().parent.parent
LOADTEST = ROOT / "loadtest"


def _hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make ``names`` look uninstalled to :func:`importlib.util.find_spec` (nothing is imported)."""
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name in names else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# 1. No prefix matching.


def test_a_prefix_of_an_option_is_refused_not_taken_for_it(capsys: pytest.CaptureFixture[str]) -> None:
    # The parser alone: were the prefix taken, main would start a real load run.
    with pytest.raises(SystemExit) as refused:
        devices.parser().parse_args(["--dev", "10"])
    assert refused.value.code == 2
    assert "unrecognized arguments: --dev 10" in capsys.readouterr().err
    # Every command: "--versio" is a prefix of --version, which would print and exit 0.
    for command in COMMANDS:
        with pytest.raises(SystemExit) as refused:
            main([command, "--versio"])
        assert refused.value.code == 2, command
    capsys.readouterr()


def test_every_parser_in_the_load_tester_goes_through_command_parser() -> None:
    # command_parser is where allow_abbrev=False and --version are set.
    made_elsewhere = []
    for path in LOADTEST.rglob("*.py"):
        if path.name == "options.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("ArgumentParser", "add_parser")
            ):
                made_elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert made_elsewhere == []


# 2. --version on every command, and the console script's name.


def test_version_on_the_top_command_and_every_subcommand(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    line = f"idlekeeper-loadtest {version()}\n"
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == line
    for command in COMMANDS:
        with pytest.raises(SystemExit) as shown:
            main([command, "--version"])
        assert shown.value.code == 0, command
        assert capsys.readouterr().out == line, command
    # The console script (pyproject: idlekeeper-loadtest = "loadtest.__main__:main").
    signature = inspect.signature(main)
    assert list(signature.parameters) == ["argv"] and signature.parameters["argv"].default is None
    assert signature.return_annotation in (int, "int")
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/idlekeeper-loadtest"])
    assert devices.parser().prog == "idlekeeper-loadtest devices"
    assert main([]) == 2
    assert "idlekeeper-loadtest devices --devices" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", [str(LOADTEST / "__main__.py")])
    assert devices.parser().prog == "python -m loadtest devices"


def test_version_from_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert (done.returncode, done.stdout) == (0, f"idlekeeper-loadtest {version()}\n"), done.stderr


# 3. Extras: one line naming what to install, before anything is imported or run.


def test_a_missing_extra_is_one_line_before_the_command_is_imported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _hide(monkeypatch, "rich", "matplotlib")
    # Were require() not called first, this import would fail with a traceback instead.
    monkeypatch.setattr(entry, "COMMANDS", {"devices": "loadtest.no_such_module"})
    assert main(["devices", "--devices", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "idlekeeper-loadtest devices: needs the 'loadtest' extra (missing: rich, matplotlib)" in err
    assert "pip install 'idlekeeper[loadtest]'" in err


def test_the_loadtest_extra_covers_every_module_the_load_tester_imports() -> None:
    optional = {
        "selenium",  # page --screenshot only, which says what to install when it is missing
        "anyio",  # loadtest.background_app, for benchmarks/http_faults.py; coredis brings it
    }
    ours = {"loadtest", "servers", "idlekeeper", "trio"}
    imported: dict[str, str] = {}
    for path in LOADTEST.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ours | {"__future__"}:
                    imported.setdefault(top, str(path.relative_to(ROOT)))
    uncovered = {name: where for name, where in imported.items() if name not in EXTRAS["loadtest"] + tuple(optional)}
    assert uncovered == {}
    # The servers it starts are part of every run: their extra is in it too.
    assert set(EXTRAS["servers"]) <= set(EXTRAS["loadtest"])


def test_a_missing_peer_names_the_bench_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _hide(monkeypatch, "uvicorn", "httptools")

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"started {args}: the check must come first")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(targets, "start_http", no_process)
    with pytest.raises(PeerUnavailable, match=r"needs the 'bench' extra \(missing: uvicorn, httptools\)"):
        start_http_target("uvicorn-standard", 1, header_timeout=1.0, keep_alive=1.0)
    assert main(["http", "--target", "uvicorn"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "idlekeeper-loadtest http: --target uvicorn needs the 'bench' extra (missing: uvicorn): "
        "pip install 'idlekeeper[bench]'\n"
    )


# 4. The progress clock.


def test_elapsed_time_is_never_negative_while_the_generators_start() -> None:
    from loadtest.live import elapsed

    assert elapsed(10.0, 7.7) == 0.0
    assert elapsed(10.0, 12.5) == 2.5
    # plan() lays the run out from now, its start a couple of seconds ahead: the first
    # progress comes before it.
    timeline = plan(DeviceLoad(devices=200, rate=1000), 1)
    now = time.monotonic()
    assert timeline.start > now
    shown = run_progress(timeline, now, 200, 0.05, {}, server_online=math.nan, rss_mb=0.0, fds=math.nan)
    assert shown["elapsed"] == 0.0 and shown["phase"] == "starting"
    later = Timeline(start=0.0, acts=10.0, detect_by=15.0, stall=None, stall_end=None, end=16.0)
    assert run_progress(later, 3.5, 1, 0.0, {}, server_online=1.0, rss_mb=1.0, fds=1.0)["elapsed"] == 3.5


# 5. Reports: no nan, no "1 workers".


def test_figures_without_samples_and_counts_of_one_read_as_words() -> None:
    from loadtest.report import figure, plural

    assert figure(math.nan, ".1f", " s", why="none came") == "n/a (none came)"
    assert figure(None) == "n/a"
    assert figure(math.nan, ".2f", missing="—") == "—"
    assert figure(2.345, ".2f", " s") == "2.35 s"
    assert figure(1234.5, ",.0f", "/s") == "1,234/s"
    assert [plural(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    assert plural(1, "process", "processes") == "1 process" and plural(1_000, "gateway") == "1,000 gateways"


def _fleet_result() -> dict[str, Any]:
    # A one-gateway, one-worker fleet that stopped before most figures had two samples.
    nan = math.nan
    history = {"ok": True, "sessions": 4, "devices": 4, "violations": {}, "longest_overlap_s": 0.0, "examples": []}
    return {
        "options": {"nodes": 1, "keepalive": 2, "redis_restart": True},
        "workers_per_node": 1,
        "devices": 4,
        "connected": 1,
        "generators_missing": 0,
        "connect_rate_per_s": nan,
        "connect_failed": 0,
        "refused": 0,
        "stream_entries": 4,
        "redis_incarnations": 1,
        "log_entries": 4,
        "feed": {
            "sessions": 4,
            "lost": 0,
            "duplicated": 0,
            "online_duplicated": 0,
            "offline_by_reason": {},
            "reannounced_after_restart": 0,
            "offline_without_online": 0,
        },
        "node_lost_on_live_gateways": 0,
        "queues_drained_s": nan,
        "history": {"lease_s": 13.0, "stream": history, "logs": history},
        "detected": 0,
        "silent": 0,
        "undetected": 0,
        "lateness_ms": {"n": 0},
        "false_expiries": 0,
        "drops": {"generator_late": 0, "by_kill": 0},
        "reconnected": 0,
        "takeover_ms": {"n": 0, "before_connack": 0},
        "takeover_missed": 0,
        "retries": 0,
        "kill": {
            "gateway": "gw0",
            "at_s": 3.0,
            "pids": [1],
            "held": 1,
            "node_lost": 0,
            "taken_over": 1,
            "other": {},
            "unended": 0,
            "first_node_lost_s": nan,
            "last_node_lost_s": nan,
        },
        "redis_outage": {"down_at_s": 4.0, "down_for_s": nan, "stream_length": nan, "read_before": nan},
        "reader_lag_ms": {"n": 0},
        "redis": {
            "ops_per_s_steady": nan,
            "ops_per_s_run": nan,
            "ops_per_s_peak": nan,
            "ops_per_device_hour": nan,
            "rss_mb_steady": 0.0,
            "rss_mb_peak": 0.0,
        },
        "gateways": [
            {
                "name": "gw0",
                "port": 1,
                "killed": False,
                "online_at_settle": nan,
                "sessions": 4,
                "rss_mb_steady": nan,
                "rss_mb_peak": 50.0,
                "exit_code": 0,
                "stop_s": nan,
            }
        ],
    }


def test_the_fleet_report_has_no_nan_and_counts_one_worker() -> None:
    text = fleet_report(_fleet_result())
    assert "nan" not in text.lower(), text
    assert "workers" not in text.split("\n")[0] and "1 gateway x 1 worker," in text, text
    assert "offline queues drained n/a (not measured)" in text, text
    assert "node-lost events     none" in text and "not back when the run ended" in text, text
    assert "1 run of Redis" in text and "(1 process SIGKILLed)" in text, text


def test_the_http_report_has_no_nan_without_measurements() -> None:
    from loadtest.http.load import describe

    r = HttpResult(target="idlekeeper", connections=0, duration=1.0, slowloris=1, slow_readers=0, header_timeout=2.0)
    r.idle_connections = 1
    text = describe(r.to_json())
    assert "nan" not in text.lower(), text
    assert "slow readers held" not in text and "slowloris held         p50 n/a, max n/a" in text, text
