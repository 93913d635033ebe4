"""An operator's mistakes, on both servers: each gets one line naming the option or
the file (and its line), exit 2, before anything is bound; never a traceback, never
argparse's usage block, never a value taken in silence (issue 61).

Each case runs the real command in a subprocess, as an operator would.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers.extras import version

HEARTBEAT = "servers.heartbeat"
HTTP = "servers.http"
BOTH = (HEARTBEAT, HTTP)


def run(module: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``python -m module args``: what an operator typed."""
    return subprocess.run(
        [sys.executable, "-m", module, "--port", "0", *args], capture_output=True, text=True, timeout=timeout
    )


def one_line(result: subprocess.CompletedProcess[str], *names: str, code: int = 2) -> str:
    """The one line a refusal owes, checked: exit ``code``, no traceback, no usage, ``names`` in it."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


# Item 1, 3, 8 and 10 of the issue: values out of range, each told in one line.
BAD_VALUES = [
    (HTTP, ("--keep-alive-timeout", "0"), "more than 0"),
    (HTTP, ("--send-timeout", "0"), "more than 0"),
    (HEARTBEAT, ("--send-timeout", "0"), "more than 0"),
    (HEARTBEAT, ("--port", "70000"), "65535"),
    (HTTP, ("--port", "70000"), "65535"),
    (HEARTBEAT, ("--status-port", "70001"), "65535"),
    (HEARTBEAT, ("--ws-port", "-1"), "65535"),
    (HEARTBEAT, ("--tick", "0"), "more than 0"),
    (HTTP, ("--tick", "0"), "more than 0"),
    (HEARTBEAT, ("--log-level", "LOUD"), "WARNING"),
    (HTTP, ("--log-level", "LOUD"), "WARNING"),
    (HEARTBEAT, ("--coalesce", "-1"), "at least 0"),
    (HEARTBEAT, ("--host", "999.1.1.1"), "999.1.1.1"),
    (HTTP, ("--host", "999.1.1.1"), "999.1.1.1"),
    (HEARTBEAT, ("--status-host", "no-such-host.invalid"), "no-such-host.invalid"),
    (HTTP, ("--grace", "-3"), "at least 0"),
    (HEARTBEAT, ("--workers", "0"), "at least 1"),
    (HEARTBEAT, ("--workers", "-2"), "at least 1"),
    (HTTP, ("--workers", "0"), "at least 1"),
    (HEARTBEAT, ("--lease", "0"), "at least 2"),
    (HEARTBEAT, ("--connect-timeout", "-5"), "more than 0"),
    (HTTP, ("--header-timeout", "-1"), "more than 0"),
    (HEARTBEAT, ("--max-qos", "3"), "from 0 to 2"),
    (HEARTBEAT, ("--max-connections", "lots"), "'lots'"),
    (HTTP, ("--max-body-size", "1e6"), "whole number"),
    (HEARTBEAT, ("--tick", "nan"), "'nan'"),
    (HEARTBEAT, ("--presence-prefix", "devices"), "/"),
]


@pytest.mark.parametrize(("module", "args", "says"), BAD_VALUES, ids=[f"{m}{' '.join(a)}" for m, a, _ in BAD_VALUES])
def test_an_operator_who_gives_a_value_out_of_range_is_told_in_one_line(
    module: str, args: tuple[str, ...], says: str
) -> None:
    one_line(run(module, *args), args[0], says)


@pytest.mark.parametrize("module", BOTH)
@pytest.mark.parametrize("typed", [("--keepalive", "10"), ("--worker", "2"), ("--tic", "0.5")])
def test_an_operator_who_types_part_of_an_option_name_is_refused(module: str, typed: tuple[str, ...]) -> None:
    """No prefix matching: ``--keepalive`` is not ``--keepalive-over-max``, nor ``--worker``
    the supervisor's hidden ``--worker-index``."""
    one_line(run(module, *typed), "unrecognized arguments", typed[0])


def test_an_operator_who_asks_a_free_status_port_for_each_of_two_workers_is_refused() -> None:
    """``--status-port 0`` once meant port 0 and port 1 (which root may bind)."""
    one_line(run(HEARTBEAT, "--workers", "2", "--status-port", "0"), "--status-port 0", "--workers 1")


def test_an_operator_whose_status_ports_would_pass_65535_is_refused() -> None:
    one_line(run(HEARTBEAT, "--workers", "3", "--status-port", "65534"), "--status-port", "65536")


@pytest.mark.parametrize("option", ["--status-port", "--ws-port"])
def test_an_operator_who_picks_a_taken_port_for_a_second_listener_is_told_in_one_line(
    option: str, taken_port: int
) -> None:
    line = one_line(run(HEARTBEAT, option, str(taken_port)), option, f"port {taken_port}", "already in use")
    assert "--port)" not in line  # it names the option in question, not the MQTT one


def test_an_operator_whose_second_workers_status_port_is_taken_is_told_before_any_starts(taken_port: int) -> None:
    one_line(
        run(HEARTBEAT, "--workers", "2", "--status-port", str(taken_port - 1)), "--status-port", str(taken_port)
    )


@pytest.mark.parametrize(
    ("module", "option"),
    [
        (HEARTBEAT, "--auth-file"),
        (HEARTBEAT, "--acl-file"),
        (HEARTBEAT, "--status-token-file"),
        (HEARTBEAT, "--tls-cert"),
        (HTTP, "--tls-cert"),
        (HEARTBEAT, "--tls-ca-file"),
    ],
)
def test_an_operator_who_names_a_missing_file_is_told_which(module: str, option: str, tmp_path: Path) -> None:
    missing = tmp_path / "not-there.pem"
    line = one_line(run(module, option, str(missing)), option, str(missing), "No such file")
    assert "Errno" not in line


def test_an_operator_whose_tls_key_does_not_match_is_told_which_files(tmp_path: Path) -> None:
    cert = tmp_path / "server.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    key = tmp_path / "server.key"
    key.write_text("nor a key\n")
    for module in BOTH:
        one_line(run(module, "--tls-cert", str(cert), "--tls-key", str(key)), str(cert), str(key))


def test_an_operator_whose_presence_log_cannot_be_written_is_told(tmp_path: Path) -> None:
    target = tmp_path / "no-such-folder" / "presence.jsonl"
    one_line(run(HEARTBEAT, "--presence-log", str(target)), "--presence-log", str(target))


def test_an_operator_whose_acl_file_has_a_bad_line_is_told_its_number(tmp_path: Path) -> None:
    acl = tmp_path / "acl"
    acl.write_text("user alice\ntopic readwrite sensors/#\nfrobnicate everything\ntopic read other\n")
    one_line(run(HEARTBEAT, "--acl-file", str(acl)), "--acl-file", f"{acl}:3")


def test_an_operator_whose_password_file_has_a_bad_line_is_told_its_number(tmp_path: Path) -> None:
    passwords = tmp_path / "passwords"
    passwords.write_text("# users\nalice\n")
    one_line(run(HEARTBEAT, "--auth-file", str(passwords)), "--auth-file", f"{passwords}:2")


def test_an_operator_whose_token_file_needs_a_status_port_is_told(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# the page's\nsecret-token-0123456789abcdef\n")
    one_line(run(HEARTBEAT, "--status-token-file", str(tokens)), "--status-token-file", "--status-port")


def test_an_operator_who_asks_an_unknown_redis_url_is_told(tmp_path: Path) -> None:
    one_line(run(HEARTBEAT, "--cluster", "http://127.0.0.1:6379"), "--cluster")


@pytest.mark.parametrize("module", BOTH)
def test_an_operator_who_asks_the_version_gets_it(module: str) -> None:
    result = run(module, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"python -m {module} {version()}"


def test_the_help_names_every_mqtt_version_served() -> None:
    result = run(HEARTBEAT, "--help")
    assert result.returncode == 0
    assert "MQTT 3.1, 3.1.1 and 5.0" in " ".join(result.stdout.split())


def test_every_option_has_its_help_and_is_declared_once() -> None:
    from servers.heartbeat.settings import SETTINGS as MQTT_SETTINGS
    from servers.http.__main__ import SETTINGS as HTTP_SETTINGS

    for settings in (MQTT_SETTINGS, HTTP_SETTINGS):
        options = [s.option for s in settings]
        assert len(options) == len(set(options)), sorted(o for o in options if options.count(o) > 1)
        assert [s.option for s in settings if not s.hidden and not s.help] == []


FAILING_APP = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no database"})
"""


def test_an_operator_whose_app_cannot_start_under_two_workers_gets_exit_3_not_restarts(tmp_path: Path) -> None:
    """The supervisor once restarted such workers for ever, a traceback each time."""
    (tmp_path / "failing_app.py").write_text(FAILING_APP)
    result = subprocess.run(
        [sys.executable, "-m", HTTP, "failing_app:app", "--port", "0", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "no database" in result.stderr
    assert "cannot start (exit 3); stopping every worker" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 6  # the supervisor's two lines, each worker's two


def test_a_worker_that_cannot_listen_says_where_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A port taken between the supervisor's check and a worker's bind (the check cannot close that race)."""
    import argparse

    from servers import runner
    from servers.listeners import open_listeners
    from servers.workers import CANNOT_START

    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]

        async def run_worker(args: argparse.Namespace, worker: int, reuse_port: bool) -> None:
            open_listeners("127.0.0.1", port)

        args = argparse.Namespace(worker_index=None, workers=1, host="127.0.0.1", port=0)
        assert runner.main("servers.http", args, [], run_worker, prog="idlekeeper-http") == CANNOT_START
    err = capsys.readouterr().err
    assert err == f"idlekeeper-http: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
